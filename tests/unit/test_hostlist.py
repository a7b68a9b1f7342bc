"""Slurm hostlist expand/compress: tricky cases (checked against scontrol 22.05), errors, round trips."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcring.hostlist import MAX_DIGITS, MAX_RANGE, compress, expand
from hpcring.cli.hostlist_cmd import app
from hpcring.errors import HostlistError

# (expression, expected hosts) -- each expected list is what `scontrol show hostnames` printed.
CASES = [
    ("", []),
    ("  , ,\t", []),
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    # whitespace separates, like a comma (python-hostlist and submitit mis-split these)
    ("a b,c  d", ["a", "b", "c", "d"]),
    ("n[1-2]\tn3", ["n1", "n2", "n3"]),
    ("n[1-2],,n[3-4]  n5", ["n1", "n2", "n3", "n4", "n5"]),
    ("n[1,3] m[2,4]", ["n1", "n3", "m2", "m4"]),
    (",n1,", ["n1"]),
    # zero padding: width of the low bound as written
    ("n[098-102]", ["n098", "n099", "n100", "n101", "n102"]),
    ("n[01-3]", ["n01", "n02", "n03"]),
    ("n[1-03]", ["n1", "n2", "n3"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("n9,n10,n010", ["n9", "n10", "n010"]),
    # duplicates and order are kept
    ("n[1-3,2]", ["n1", "n2", "n3", "n2"]),
    ("n[1-3,2-4]", ["n1", "n2", "n3", "n2", "n3", "n4"]),
    ("n[3,1,2]", ["n3", "n1", "n2"]),
    ("n1,n1", ["n1", "n1"]),
    # several bracket groups: Slurm's order
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("a[1-2]b[3-4]c[5-6]", ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]),
    ("a[1-2]b[3-4]c[5-6]d[7-8]", [
        "a1b3c5d7", "a1b3c5d8", "a2b3c5d7", "a2b3c5d8", "a1b4c5d7", "a1b4c5d8", "a2b4c5d7", "a2b4c5d8",
        "a1b3c6d7", "a1b3c6d8", "a2b3c6d7", "a2b3c6d8", "a1b4c6d7", "a1b4c6d8", "a2b4c6d7", "a2b4c6d8"]),
    ("n[1-2][3]", ["n13", "n23"]),
    ("x[1-2]y[01-2],z", ["x1y01", "x1y02", "x2y01", "x2y02", "z"]),
    ("n[01-2]b[1],n[3]", ["n01b1", "n02b1", "n3"]),
    ("[1-2]", ["1", "2"]),
    ("[1]", ["1"]),
    # literal characters other than brackets are part of names
    ("rack1-n[1-2]", ["rack1-n1", "rack1-n2"]),
    ("n1-2", ["n1-2"]),
    ("a.b.c", ["a.b.c"]),
    # suffix after the last group (Slurm >= 23.02.5; 22.05 rejects it)
    ("node[01-02]-ib", ["node01-ib", "node02-ib"]),
    ("a[1-2]b[3-4].x", ["a1b3.x", "a1b4.x", "a2b3.x", "a2b4.x"]),
    # the limit itself is fine
    ("n[0-65535]", [f"n{i}" for i in range(65536)]),
]


@pytest.mark.parametrize("expr, hosts", CASES, ids=[repr(c[0])[:40] for c in CASES])
def test_expand(expr, hosts):
    assert expand(expr) == hosts


# (expression, caret position, words in the message)
ERRORS = [
    ("n[1", 1, "never closed"),
    ("n[1-2", 1, "never closed"),
    ("n[1,2 n3", 5, "whitespace inside brackets"),
    ("n[ 1-2]", 2, "whitespace inside brackets"),
    ("n]", 1, "without a matching"),
    ("a]b[1]", 1, "without a matching"),
    ("n[1-2]]", 6, "without a matching"),
    ("n[[1]]", 2, "do not nest"),
    ("n[]", 2, "empty brackets"),
    ("n[1,,2]", 4, "empty item"),
    ("n[1,]", 4, "empty item"),
    ("n[a-b]", 2, "'a' in brackets"),
    ("n[1x2]", 3, "'x' in brackets"),
    ("n[+1]", 2, "'+' in brackets"),
    ("n[3-1]", 2, "goes backwards"),
    ("n[1-2-3]", 5, "more than one '-'"),
    ("n[-1]", 2, "no start"),
    ("n[1-]", 4, "no end"),
    ("ok,n[0-65536]", 5, "65537 hosts"),
    ("a[0-65536]b[1]", 2, "65537 hosts"),
    ("n[99999999999999999999]", 2, "64 bits"),
    ("n99999999999999999999", 1, "64 bits"),
    ("a[3-1]b[1-2]c[1-2]", 2, "goes backwards"),   # scontrol 22.05 prints errors yet returns nothing
    ("ok a[0-2000]b[0-2000]", 3, "more than 1048576 hosts"),
]


@pytest.mark.parametrize("expr, pos, words", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_point_at_the_problem(expr, pos, words):
    with pytest.raises(HostlistError) as info:
        expand(expr)
    msg = info.value.message
    lines = msg.splitlines()
    assert words in lines[0]
    assert lines[1] == "  " + expr
    assert lines[2] == "  " + " " * pos + "^", msg


def test_caret_stays_aligned_with_tabs():
    with pytest.raises(HostlistError) as info:
        expand("a\tn[1")
    assert info.value.message.splitlines()[1:] == ["  a n[1", "     ^"]


def test_max_hosts_is_adjustable():
    assert len(expand("n[1-10]", max_hosts=10)) == 10
    with pytest.raises(HostlistError, match="more than 9 hosts"):
        expand("n[1-10]", max_hosts=9)


def test_non_last_group_limit_matches_slurm():
    # Slurm's MAX_PREFIX_CNT: a group before the last may yield at most 65536 hosts in all.
    with pytest.raises(HostlistError, match="before the last"):
        expand("a[0-40000,0-40000]b[1]")


def test_type_errors():
    with pytest.raises(TypeError):
        expand(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        compress("n1,n2")


# ------------------------------------------------------------------------------------ compress

COMPRESS = [
    ([], ""),
    (["n1"], "n1"),
    (["n1", "n2", "n3"], "n[1-3]"),
    (["n098", "n099", "n100", "n101", "n102"], "n[098-102]"),
    (["n9", "n10", "n11"], "n[9-11]"),
    (["n9", "n010"], "n[9,010]"),
    (["n1", "n3", "n2"], "n[1,3,2]"),
    (["n1", "n1"], "n[1,1]"),
    (["a", "b1", "b2", "a"], "a,b[1-2],a"),
    (["n1", "m1", "n2"], "n1,m1,n2"),
    (["1", "2"], "[1-2]"),
    (["x-1", "x-2"], "x-[1-2]"),
    (["n", "n1"], "n,n1"),
]


@pytest.mark.parametrize("hosts, expr", COMPRESS)
def test_compress(hosts, expr):
    assert compress(hosts) == expr
    assert expand(expr) == hosts


def test_compress_splits_ranges_at_slurm_limit():
    hosts = [f"n{i}" for i in range(MAX_RANGE + 5)]
    expr = compress(hosts)
    assert expr == f"n[0-{MAX_RANGE - 1},{MAX_RANGE}-{MAX_RANGE + 4}]"
    assert expand(expr) == hosts


@pytest.mark.parametrize("bad", ["", "a b", "a,b", "n[1]", "x]", "n99999999999999999999"])
def test_compress_refuses_unrepresentable_names(bad):
    with pytest.raises(HostlistError):
        compress(["ok", bad])


# ------------------------------------------------------------------------------------ round trips

_names = st.builds(
    lambda prefix, num, width: prefix + (f"{num:0{width}d}" if num is not None else ""),
    st.text(alphabet="abcxyz-._", min_size=0, max_size=4),
    st.one_of(st.none(), st.integers(0, 1200)),
    st.integers(0, 4),
).filter(bool)


@settings(max_examples=300, deadline=None)
@given(st.lists(_names, max_size=40))
def test_compress_round_trip(hosts):
    assert expand(compress(hosts)) == hosts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["gpu", "n", "rack1-n", ""]), min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(0, 150), st.integers(0, 20), st.integers(1, 4)), min_size=1, max_size=4))
def test_expand_compress_expand_is_stable(prefixes, ranges):
    items = ",".join(f"{lo:0{w}d}-{lo + n}" if n else f"{lo:0{w}d}" for lo, n, w in ranges)
    expr = " ".join(f"{p}[{items}]" for p in prefixes)
    hosts = expand(expr)
    assert expand(compress(hosts)) == hosts
    assert compress(expand(compress(hosts))) == compress(hosts)


# ------------------------------------------------------------------------------------ CLI

def test_cli_expand_and_compress(cli):
    out = cli("expand", "n[1-2] m3", app=app)
    assert out.exit_code == 0 and out.stdout == "n1\nn2\nm3\n"
    out = cli("compress", "n1", "n2", "n4", app=app)
    assert out.exit_code == 0 and out.stdout == "n[1-2,4]\n"


def test_cli_errors_go_to_stderr_with_exit_1(cli):
    out = cli("expand", "n[1", app=app)
    assert out.exit_code == 1
    assert out.stdout == ""
    assert out.stderr.startswith("error: invalid hostlist: '[' is never closed")
    out = cli("compress", "a b", app=app)
    assert out.exit_code == 1 and out.stderr.startswith("error: cannot compress")


# ------------------------------------------------------------------------------------ long numbers

@pytest.mark.parametrize("expr", ["n[1-" + "9" * 5000 + "]", "n" + "9" * 5000, "n[" + "0" * 4999 + "1]"],
                         ids=["range", "suffix", "padding"])
def test_numbers_too_long_to_convert_are_hostlist_errors(expr):
    # int() refuses more than 4300 digits with a ValueError: the length is checked first
    with pytest.raises(HostlistError, match=f"number of 5000 digits.*at most {MAX_DIGITS}") as info:
        expand(expr)
    assert len(info.value.message) < 400          # the expression is shown around the caret, not whole


def test_zero_padding_is_kept_up_to_a_host_names_length():
    # scontrol 22.05 keeps any padding (n[000...01-2] with 100 zeros gives 2 hosts of 101 digits)
    assert expand("n[" + "0" * (MAX_DIGITS - 1) + "1-2]") == ["n" + f"{i:0{MAX_DIGITS}d}" for i in (1, 2)]
    with pytest.raises(HostlistError, match=f"number of {MAX_DIGITS + 1} digits"):
        expand("n[" + "0" * MAX_DIGITS + "1]")


def test_caret_points_into_a_long_expression():
    expr = "x" * 300 + ",n[1-2-3]," + "y" * 300
    with pytest.raises(HostlistError) as info:
        expand(expr)
    _, shown, caret = info.value.message.splitlines()
    assert shown.startswith("  ...") and shown.endswith("...") and len(shown) < 120
    at = len(caret) - 1                        # the second '-' of 1-2-3
    assert shown[at - 3:at + 2] == "1-2-3" and shown[at] == "-"


def test_compress_refuses_a_number_too_long_to_convert():
    with pytest.raises(HostlistError, match="number of 5000 digits"):
        compress(["n" + "9" * 5000])

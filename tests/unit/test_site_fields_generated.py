"""Every field of the site-config schema, mutated by type (generated from the pydantic models, so a new
field is covered the day it is added), through `hpcring submit --site FILE`: the submission must stop
with one message naming the file, line and key, with no traceback, no escape sequence on the terminal
and nothing started. Then a fixed list of cases that once got through.

HPCRING_SITE_FIELD_EXAMPLES raises the examples per (field, mutation) (default 5).
"""
from __future__ import annotations

import os
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hpcring.config.text import MAX_TEXT
from helpers.site_fields import Field, schema_fields, write_site, yaml_text

EXAMPLES = int(os.environ.get("HPCRING_SITE_FIELD_EXAMPLES", "5"))
FIELDS = schema_fields()

# characters that must never pass: C0/C1 controls (line breaks, ESC), Unicode line separators, bidi
CONTROLS = [chr(c) for c in (*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029, 0x202E, 0x2066)]
_text = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters='"\\'), max_size=12)


@st.composite
def _with_control(draw, base=_text):
    s = draw(base)
    i = draw(st.integers(0, len(s)))
    return yaml_text(s[:i] + draw(st.sampled_from(CONTROLS)) + s[i:])


_long_text = st.integers(MAX_TEXT + 1, 3 * MAX_TEXT).map(lambda n: yaml_text("x" * n))
_wrong_container = st.sampled_from(['"text"', "5", "{a: b}", "[a, b]", "true"])


def _numbers(field: Field) -> dict[str, st.SearchStrategy[str]]:
    lo, hi = field.numeric_bounds
    big = int(hi) + 1 if hi is not None else 10**6   # unbounded: test_the_walk_covers_the_schema fails
    out = {
        "wrong_type": st.sampled_from(['"4"', '"1"', "[1]", "{a: 1}", "abc", '""']),
        "bool": st.sampled_from(["true", "false", "yes", "no", "on", "off", "True"]),
        "nan_inf": st.sampled_from([".nan", ".inf", "-.inf", ".NaN", "+.inf"]),
        "negative": st.integers(-10**9, -1).map(str),
        "huge": st.one_of(st.integers(big, 10**30).map(str), st.integers(41, 6000).map(lambda n: "9" * n)),
        "underscores": st.integers(1, 99).flatmap(lambda a: st.integers(0, 999).map(lambda b: f"{a}_{b:03d}")),
        "non_decimal": st.sampled_from(["010", "0x10", "0b11", "0o7", "1:30", "1:00:00"]),
        "unicode": st.sampled_from(['"\\uff14"', '"\\u0661\\u0662"', '"\\u0664"', '"\\u00b2"', "\u0663"]),
        "control": st.integers(0, 9).flatmap(lambda d: _with_control(st.just(str(d)))),
        "very_long": st.integers(41, 6000).map(lambda n: yaml_text("1" * n)),
    }
    if field.kind == "int":
        out["fraction"] = st.sampled_from(["2.5", "1.0", "1e3", "3.0e+0"])
    else:  # a deadline must be positive, and 0 is no deadline
        out["negative"] = st.one_of(st.just("0"), st.just("0.0"), out["negative"])
        out["huge"] = st.one_of(st.floats(hi * 2, 1e300).map(lambda f: f"{f:.3e}"),
                                out["huge"])
    return out


def mutations(field: Field) -> dict[str, st.SearchStrategy[str]]:
    """Mutation family -> strategy of raw YAML text that must be refused for ``field``."""
    if field.kind in ("int", "float"):
        return _numbers(field)
    if field.kind == "bool":
        return {"wrong_type": st.sampled_from(["1", "0", "2", '"true"', '"yes"', "[true]", "{a: 1}", '""']),
                "unicode": st.sampled_from(['"\\uff54rue"', '"tru\\u0435"']),
                "control": _with_control(st.sampled_from(["true", "false"])),
                "very_long": _long_text}
    if field.kind in ("str", "key"):
        out = {"control": _with_control(),
               "unicode": st.sampled_from(["\\u2028", "\\u2029", "\\u202e", "\\u0085", "\\u2066"]).flatmap(
                   lambda u: _text.map(lambda s: '"' + s.replace('"', "") + u + 'x"')),
               "very_long": _long_text}
        if field.kind == "str":
            out["wrong_type"] = st.sampled_from((["5"] if not field.takes_int else []) +
                                                ["2.5", "true", "[a]", "{a: b}", "[]"])
        return out
    if field.kind == "literal":
        return {"wrong_type": st.sampled_from(["5", "true", "[a]", "{a: b}"]),
                "bad_choice": _text.filter(lambda s: s not in field.choices and s.strip()).map(yaml_text),
                "unicode": st.sampled_from(field.choices).map(lambda c: yaml_text(c.upper() + "\u200b")),
                "control": st.sampled_from(field.choices).flatmap(lambda c: _with_control(st.just(c))),
                "very_long": _long_text}
    if field.kind == "list":
        return {"wrong_type": _wrong_container.filter(lambda r: not r.startswith("[")),
                "item_type": st.sampled_from(["[5]", "[[a]]", "[{a: b}]", "[true]", "[null]"])}
    return {"wrong_type": _wrong_container.filter(lambda r: not r.startswith("{"))}   # dict, model


CASES = [(f, family) for f in FIELDS for family in mutations(f)]


def _expected_key(field: Field) -> str:
    """The key path a message about ``field`` starts with (a mutated key: its parent's)."""
    path = field.path[:-1] if field.kind == "key" else field.path
    return ".".join(str(p) for p in path)


def check_refused(cli, tmp_path, field: Field, raw: str, scheduler: str = "slurm") -> None:
    site, lines = write_site(tmp_path, scheduler, field, raw)
    script = tmp_path / "train.py"
    script.write_text("print('started')\n")
    state = tmp_path / "state"
    # no sbatch on PATH: a site wrongly accepted fails later, without naming the field, and starts nothing
    r = cli("submit", str(script), "--site", str(site), env={"HPCRING_STATE_DIR": str(state), "PATH": str(tmp_path / "no-bin"),
                           "HPCRING_JOB_DIR": str(tmp_path / "jobs")})
    out = r.stdout + r.stderr
    shown = f"{field} = {raw[:80]!r}:\n{out[:2000]}"
    assert r.exit_code == 1, shown
    assert r.exception is None or isinstance(r.exception, SystemExit), shown
    assert "Traceback" not in out and "\x1b" not in out, shown
    named = re.findall(re.escape(str(site)) + r":(\d+) (\S+):", out)
    assert len(named) == 1 and out.count(f"{site}:") == 1, f"want one message naming the file: {shown}"
    line, key = named[0]
    assert int(line) in lines, f"line {line}, want one of {sorted(lines)}: {shown}"
    want = _expected_key(field)
    assert key == want or key.startswith(want + ".") or want.startswith(key + "."), \
        f"names {key!r}, want {want!r}: {shown}"
    assert want.split(".")[0] == key.split(".")[0], shown
    assert not (state / "jobs").exists() or not any((state / "jobs").iterdir()), f"a job was recorded: {shown}"
    assert not (tmp_path / "jobs").exists(), f"a job folder was made: {shown}"


@pytest.mark.parametrize("field,family", CASES, ids=[f"{f.dotted}-{fam}" for f, fam in CASES])
def test_every_field_refuses_every_bad_value(cli, tmp_path_factory, field, family):
    strategy = mutations(field)[family]

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(raw=strategy)
    def run(raw):
        check_refused(cli, tmp_path_factory.mktemp("m"), field, raw)

    run()


def test_the_walk_covers_the_schema():
    """Every kind of field has mutations, and every number is bounded both ways (huge is refused)."""
    kinds = {f.kind for f in FIELDS}
    assert kinds <= {"int", "float", "bool", "str", "literal", "list", "dict", "model", "key"}
    for f in FIELDS:
        if f.kind in ("int", "float"):
            assert f.numeric_bounds and None not in f.numeric_bounds, f"{f.dotted} needs ge/gt and le bounds"
    # print the counts for the report (pytest -s)
    print(f"\n{len(FIELDS)} schema fields, {len(CASES)} (field, mutation) cases, "
          f"{len(CASES) * EXAMPLES} generated site files at {EXAMPLES} examples each")


# -- fixed list: each was once a traceback or silently accepted -----------------------------------------

REGRESSIONS = [
    ("timeout", "9" * 5000),              # traceback: Python's int() digit limit inside the YAML loader
    ("defaults.nodes", "9" * 5000),
    ("timeout", "true"),                  # was a 1 s deadline
    ("defaults.nodes", "true"),           # was 1 node
    ("cpus_per_node", "10000000"),        # was unbounded
    ("partitions.p1.cpus_per_node", "10000000"),
    ("slurm.signal", '"BOGUS@60"'),
    ("slurm.signal", '"USR2@-5"'),
    ("slurm.signal", '"USR2@abc"'),
    ("slurm.signal", '"USR2@60\\ntouch /tmp/hpcring-injected"'),
    ("sched_args.0", '"--comment=x\\ntouch /tmp/hpcring-injected"'),
    ("slurm.gres_name", '"gpu\\ntouch /tmp/hpcring-injected"'),
    ("launcher.args.0", '"--x\\ntouch /tmp/hpcring-injected"'),
    ("python", '"/usr/bin/python3 $(touch /tmp/hpcring-injected)"'),
    ("lsf.warning_time", '"soon"'),
    ("lsf.warning_time", "-5"),
    ("lsf.warning_signal", '"BOGUS"'),
    ("template", '"no-such-template.j2"'),
    ("fabric.data_interfaces.0", '"="'),
    ("fabric.bootstrap_interfaces.0", '"=eth 0"'),
    ("description", '"\\e[31mred\\e[0m"'),
    ("setup.0", '"module load x\\rmodule load y"'),
    ("defaults.exclusive", "1"),
    ("fabric.ring_shm", '"yes"'),
]


@pytest.mark.parametrize("dotted,raw", REGRESSIONS, ids=[f"{d}={r[:20]}" for d, r in REGRESSIONS])
def test_site_values_that_once_got_through(cli, tmp_path, dotted, raw):
    field = next(f for f in FIELDS if f.dotted == dotted)
    check_refused(cli, tmp_path, field, raw)


def test_interface_list_names_each_bad_entry(cli, tmp_path):
    f = next(f for f in FIELDS if f.dotted == "fabric.data_interfaces")
    site, _ = write_site(tmp_path, "slurm", f, '["=eth0", "=eth 0"]')
    r = cli("sites", "validate", str(site))
    assert r.exit_code == 1 and "fabric.data_interfaces.1: '=eth 0' is not an interface entry" in r.stderr


def test_lsf_warning_needs_signal_and_time(cli, tmp_path):
    f = next(f for f in FIELDS if f.dotted == "lsf.warning_time")
    site, _ = write_site(tmp_path, "lsf", f, "null")
    r = cli("sites", "validate", str(site))
    assert r.exit_code == 1 and "lsf.warning_time: LSF's warning needs both" in r.stderr


@pytest.mark.parametrize("value", ["USR2@90", "SIGUSR1@60", "R:USR2@300", "B:TERM", "10@5", "USR2"])
def test_good_slurm_signals_pass(cli, tmp_path, value):
    f = next(f for f in FIELDS if f.dotted == "slurm.signal")
    site, _ = write_site(tmp_path, "slurm", f, yaml_text(value))
    r = cli("sites", "validate", str(site))
    assert r.exit_code == 0, r.stderr


def test_bundled_sites_still_validate(cli):
    r = cli("sites", "validate", env={"HPCRING_SITE_DIRS": "", "XDG_CONFIG_HOME": "/nonexistent"})
    assert r.exit_code == 0, r.stderr

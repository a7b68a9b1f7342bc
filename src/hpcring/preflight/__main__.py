"""``python -m hpcring.preflight``: one node's part of the gang check, or (``--verdict``) the verdict.

Exit codes: 0 the task finished its part (or, with --verdict, every node is good); 1 this task
could not take part (no job secret, the folder not writable); 2 usage; 3 (--verdict) bad nodes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from hpcring.hostlist import expand
from hpcring.errors import HpcringError
from hpcring.fsutil import write_json
from hpcring.preflight.record import check_host
from hpcring.preflight.task import Options, run_task
from hpcring.preflight.verdict import read_verdict

EXIT_BAD_NODES = 3


def _number(kind, lo: float, hi: float, what: str):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a{'n integer' if kind is int else ' number'}, "
                                             f"not {text!r}") from None
        if not (isinstance(v, int) or math.isfinite(v)) or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{what} must be between {lo:g} and {hi:g}, not {text!r}")
        return v
    return parse


def _ifname_for(text: str) -> tuple[str, str]:
    host, sep, spec = text.partition("=")
    if not sep or not host or not spec:
        raise argparse.ArgumentTypeError(f"--ifname-for takes HOST=SPEC (e.g. node2==dead0), not {text!r}")
    return host, spec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpcring.preflight",
                                description="One node's part of hpcring's preflight gang check (run one task "
                                            "per node), or with --verdict the verdict over DIR.")
    p.add_argument("--out", required=True, type=Path, help="the run's folder, on a file system every node sees")
    p.add_argument("--expect-nodes", required=True, metavar="HOSTLIST",
                   help="every node of the check, in ring order (h1,h2,... or a Slurm hostlist: node[1-3])")
    p.add_argument("--deadline", type=_number(float, 1, 3600, "--deadline"), default=30.0, metavar="S",
                   help="seconds each task may take from its start (default 30)")
    p.add_argument("--min-gbps", type=_number(float, 0, 1e6, "--min-gbps"), default=0.0, metavar="X",
                   help="a ring link under X Gbit/s is bad (default 0: only report)")
    p.add_argument("--gpus", type=_number(int, 0, 1024, "--gpus"), default=0, metavar="N",
                   help="expected GPUs per node; checks the count and a short GEMM (default 0: no GPU check)")
    p.add_argument("--ifname", metavar="SPEC", help="interface spec (NCCL syntax; default HPCRING_IFNAME, "
                                                    "the site's fabric, automatic)")
    p.add_argument("--ifname-for", type=_ifname_for, action="append", default=[], metavar="HOST=SPEC",
                   help="the interface spec of one host (repeatable): e.g. a fault injected on one node")
    p.add_argument("--host", help="this task's node name (default: the launcher's, e.g. SLURMD_NODENAME)")
    p.add_argument("--quiet", action="store_true", help="no line on stdout when the task is done")
    p.add_argument("--verdict", action="store_true", help="read DIR, print the verdict, write DIR/verdict.json")
    p.add_argument("--json", action="store_true", help="with --verdict: print the verdict as JSON")
    p.add_argument("--test-blackhole", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        expect = expand(args.expect_nodes)
    except HpcringError as e:
        p.error(f"--expect-nodes: {e.message}")
    if not expect:
        p.error("--expect-nodes names no node")
    if len(set(expect)) != len(expect):
        p.error("--expect-nodes names a node twice")
    try:
        for h in expect:
            check_host(h)
    except ValueError as e:
        p.error(f"--expect-nodes: {e}")
    if args.verdict:
        return _verdict(args, expect)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"hpcring preflight: cannot create {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    opts = Options(out=args.out, expect=expect, deadline=args.deadline, min_gbps=args.min_gbps, gpus=args.gpus,
                   ifname=args.ifname, ifname_for=dict(args.ifname_for), host=args.host,
                   blackhole=args.test_blackhole)
    return run_task(opts, quiet=args.quiet)


def _verdict(args, expect: list[str]) -> int:
    try:
        v = read_verdict(args.out, expect, min_gbps=args.min_gbps or None)
    except HpcringError as e:
        print(f"hpcring preflight --verdict: {e.message}" + (f" (hint: {e.hint})" if e.hint else ""), file=sys.stderr)
        return 1
    try:
        write_json(args.out / "verdict.json", v.to_dict(), indent=1)
    except OSError as e:
        print(f"hpcring preflight --verdict: cannot write {args.out}/verdict.json: {e.strerror or e}", file=sys.stderr)
    print(json.dumps(v.to_dict(), indent=1) if args.json else "\n".join(v.lines), flush=True)
    return 0 if v.ok else EXIT_BAD_NODES


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A thread still importing torch or talking to a GPU must not keep the task past its deadline.
    os._exit(code)

#!/usr/bin/env python3
"""Run Horovod's own PyTorch test file (``test/parallel/test_torch.py`` of a Horovod checkout) on
``hpcring.torch``, the way ``horovodrun`` runs it: one pytest per rank, every test in one process.

    python scripts/horovod_suite.py /path/to/horovod --ranks 2 [--out DIR] [-k EXPR] [--timeout S]

The checkout is not part of hpcring (its licence and size): clone Horovod anywhere and name it.
``import horovod.torch as hvd`` resolves to ``hpcring.torch`` through a two-file package written
to a temporary folder (nothing is installed). Each rank writes a JUnit file; the summary merges
them: per test the outcome on every rank, the tests no rank reached (a cascade or a hang), and
the failures' first lines. Exit 0 when every test that ran passed or skipped on every rank and
every collected test ran, 1 otherwise.

Expected not to pass, and listed as such: tests that need a GPU (they skip), Adasum (not
implemented), and ``--known`` tests that fail the same way on Horovod itself with this torch.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

# Tests that fail with Horovod itself on torch 2.13: they build every torch.optim optimizer, and
# Muon (new in torch 2.9) refuses the 1-D parameters of their models.
# A failure counts as known only with this message; --hide-muon hides Muon from those tests (they
# take every subclass of torch.optim.Optimizer), so that the rest of each test is checked too.
MUON = "Muon only supports 2D parameters"
KNOWN = {"test_broadcast_state": MUON, "test_broadcast_state_options": MUON, "test_force_allreduce": MUON}
# On 3 ranks the scale-factor tests demand a CPU float16 sum of three equal terms to be exactly
# (never above) the float32 product 3*x: a float16 result rounds 3*x to nearest, as Horovod's CPU
# half sum does (Float2HalfBits), so it fails with Horovod too (its CI runs 2 ranks, where 2*x is
# exact). --no-cpu-half leaves HalfTensor out of those tests' dtypes to check the rest of them.
HALF = "produces incorrect results"
KNOWN_3 = {"test_horovod_allreduce_prescale": HALF, "test_horovod_allreduce_postscale": HALF,
           "test_horovod_reducescatter_prescale": HALF, "test_horovod_reducescatter_postscale": HALF,
           "test_horovod_grouped_reducescatter_prescale": HALF, "test_horovod_grouped_reducescatter_postscale": HALF}

SHIM_INIT = "# hpcring's stand-in for the horovod package: horovod.torch is hpcring.torch\n"
SHIM_TORCH = ("import sys\nimport hpcring.torch as _hvd\nsys.modules[__name__] = _hvd\n")

# Horovod's test utilities (test/utils/common.py) import this one runner helper.
SHIM_THREADS = ("import threading\n\n\ndef in_thread(target, args=(), name=None, daemon=True, silent=False):\n"
                "    t = threading.Thread(target=target, args=args, name=name, daemon=daemon)\n"
                "    t.start()\n    return t\n")

RANK_MAIN = r"""
import os, sys
import pytest
rank = os.environ.get("HPCRING_RANK") or os.environ.get("SLURM_PROCID") or "0"
out, launcher = sys.argv[1], sys.argv[2]
# What horovodrun sets and the test file reads to check hvd.rank()/size(): gloo's HOROVOD_*
# (its tearDown then runs barrier + shutdown after every test), or the MPI launcher's.
names = {"gloo": ("HOROVOD_RANK", "HOROVOD_SIZE"), "mpi": ("PMI_RANK", "PMI_SIZE")}[launcher]
os.environ[names[0]] = rank
os.environ[names[1]] = os.environ.get("HPCRING_SIZE", "1")
if launcher == "gloo":
    os.environ["HOROVOD_LOCAL_RANK"] = os.environ.get("HPCRING_LOCAL_RANK", "0")
    os.environ["HOROVOD_LOCAL_SIZE"] = os.environ.get("HPCRING_LOCAL_SIZE", "1")
sys.exit(pytest.main(["-p", "no:cacheprovider", "-p", "suite_plugin", "-q", "-o", "junit_family=xunit1",
                      f"--junitxml={out}/rank{rank}.xml", *sys.argv[3:]]))
"""


# Loaded into each rank's pytest: the opt-in changes to the test file's inputs (never to its checks).
PLUGIN = r"""
import os


def pytest_collection_modifyitems(items):
    import torch
    for cls in {item.cls for item in items if item.cls is not None}:
        if os.environ.get("HOROVOD_SUITE_HIDE_MUON") == "1":
            _subclasses = type.__subclasses__
            torch.optim.Optimizer.__subclasses__ = classmethod(
                lambda c: [k for k in _subclasses(c) if k.__name__ != "Muon"])
        if os.environ.get("HOROVOD_SUITE_NO_CPU_HALF") == "1" and hasattr(cls, "filter_supported_types"):
            keep = cls.filter_supported_types
            cls.filter_supported_types = lambda self, types: [t for t in keep(self, types) if t is not torch.HalfTensor]
"""


def shim(folder: Path) -> Path:
    pkg = folder / "horovod"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(SHIM_INIT)
    (pkg / "torch.py").write_text(SHIM_TORCH)
    util = pkg / "runner" / "util"
    util.mkdir(parents=True, exist_ok=True)
    for init in (pkg / "runner", util):
        (init / "__init__.py").write_text("")
    (util / "threads.py").write_text(SHIM_THREADS)
    (folder / "rank_main.py").write_text(RANK_MAIN)
    (folder / "suite_plugin.py").write_text(PLUGIN)
    return folder


def results(out: Path, ranks: int) -> dict[str, dict[int, tuple[str, str]]]:
    """{test name: {rank: (outcome, first line of the message)}} from each rank's JUnit file."""
    table: dict[str, dict[int, tuple[str, str]]] = {}
    for r in range(ranks):
        f = out / f"rank{r}.xml"
        if not f.exists():
            continue
        for case in ET.parse(f).getroot().iter("testcase"):
            outcome, msg = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = "skipped" if tag == "skipped" else "failed"
                    msg = (el.get("message") or el.text or "").strip().splitlines()[:1]
                    msg = msg[0][:300] if msg else ""
                    break
            # a test that failed and then errored in tearDown has two entries: keep the first failure
            prev = table.setdefault(case.get("name"), {}).get(r)
            if prev is None or prev[0] != "failed":
                table[case.get("name")][r] = (outcome, msg)
    return table


def collected(test_file: Path, env: dict, k: str | None) -> tuple[list[str], str]:
    """The test names pytest collects, and its output (Horovod's test utils need ``mock``)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(test_file)]
    if k:
        cmd += ["-k", k]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return [line.rsplit("::", 1)[1] for line in p.stdout.splitlines() if "::" in line], p.stdout[-3000:]


def score(names: list[str], table: dict, ranks: int, known: dict, alone) -> tuple[dict, list]:
    """Counts per outcome and the (test, why) that did not pass. A test passed when it passed (or
    skipped) on every rank; a known failure counts as known only when every failing rank's
    message holds the known text; a test run alone may miss the ranks its failing peers left in a
    collective (they end with the job, unreported)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "known": 0}
    bad = []
    for name in names:
        per = table.get(name, {})
        outs = {o for o, _ in per.values()}
        failed = [m for o, m in per.values() if o == "failed"]
        is_known = name in known and failed and all(known[name] in m for m in failed)
        if len(per) < ranks:
            if name in alone and is_known:
                counts["known"] += 1
            else:
                bad.append((name, f"ran on ranks {sorted(per)} of {ranks}"))
        elif is_known:
            counts["known"] += 1
        elif failed:
            counts["failed"] += 1
            msgs = sorted({f"rank {r}: {m}" for r, (o, m) in per.items() if o == "failed"})
            bad.append((name, "; ".join(msgs[:2])))
        elif outs == {"skipped"}:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("horovod", type=Path, help="a Horovod checkout (its test/parallel/test_torch.py)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--launcher", choices=("gloo", "mpi"), default="gloo",
                    help="whose variables the ranks see: horovodrun's gloo (default) or an MPI launcher's")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JUnit files and the log")
    ap.add_argument("-k", default=None, help="pytest -k expression (default: the whole file)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    ap.add_argument("--hide-muon", action="store_true",
                    help="hide torch.optim.Muon from the tests that build every optimizer (see KNOWN)")
    ap.add_argument("--no-cpu-half", action="store_true",
                    help="leave torch.HalfTensor out of the tests' dtype lists (see KNOWN_3)")
    ap.add_argument("--no-isolate", dest="isolate", action="store_false",
                    help="run the known rank-dependent failures in the main job too (they then cascade)")
    ap.add_argument("--collective-timeout", default="60", help="HPCRING_TIMEOUT for the ranks")
    a = ap.parse_args()
    test_file = a.horovod / "test" / "parallel" / "test_torch.py"
    if not test_file.is_file():
        print(f"horovod_suite: {test_file} not found; give the root of a Horovod checkout", file=sys.stderr)
        return 2
    out = a.out or Path(tempfile.mkdtemp(prefix="horovod-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    sh = shim(out / "shim")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(sh), os.environ.get("PYTHONPATH")])),
           "HPCRING_TIMEOUT": a.collective_timeout,
           "HOROVOD_SUITE_HIDE_MUON": "1" if a.hide_muon else "0",
           "HOROVOD_SUITE_NO_CPU_HALF": "1" if a.no_cpu_half else "0", "HPCRING_JOB_DIR": str(out / "jobs")}
    names, why = collected(test_file, env, a.k)
    if not names:
        print(f"horovod_suite: pytest collected no test from {test_file}:\n{why}", file=sys.stderr)
        return 2
    known = {**KNOWN, **(KNOWN_3 if a.ranks >= 3 and not a.no_cpu_half else {})}
    # A known failure that fails on some ranks only leaves the others in a collective that never
    # comes (Horovod hangs there for good); the test file's tearDown then skips shutdown and every
    # later test runs out of step. Those run in jobs of their own, after the main one.
    alone = [n for n in names if n in KNOWN_3 and n in known] if a.isolate else []
    # node ids relative to the folder pytest runs in (its rootdir): --deselect matches those only
    main_args = [test_file.name] + (["-k", a.k] if a.k else [])
    main_args += [f"--deselect={test_file.name}::TorchTests::{n}" for n in alone]
    jobs = [("main", main_args)] + [(n, [f"{test_file.name}::TorchTests::{n}"]) for n in alone]
    table: dict = {}
    rcs = []
    for tag, args in jobs:
        folder = out / tag
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(a.ranks), "--",
               sys.executable, str(sh / "rank_main.py"), str(folder), a.launcher, *args]
        with open(folder / "log.txt", "w") as log:
            try:
                rcs.append(subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout,
                                          cwd=test_file.parent).returncode)
            except subprocess.TimeoutExpired:
                rcs.append("timeout")
        table.update(results(folder, a.ranks))
    rc = rcs[0] if len(rcs) == 1 else rcs
    counts, bad = score(names, table, a.ranks, known, alone)
    for name, why in bad:
        print(f"FAIL {name}: {why}")
    never = sum(1 for n, _ in bad if len(table.get(n, {})) < a.ranks)
    print(f"horovod_suite: {a.ranks} ranks ({a.launcher}), {len(names)} tests collected: {counts['passed']} passed, "
          f"{counts['failed']} failed, {counts['skipped']} skipped, {counts['known']} known failures "
          f"(fail with Horovod too{', run alone' if alone else ''}), {never} not run on every rank; "
          f"job exit {rc}; files in {out}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())

"""Fault injection below the collectives on the real dev cluster (3 nodes x 2 ranks, `hpcring submit`
of examples/doctor.py): (6) a site config naming an interface that routes nowhere, (7) one slow
link, (8) a rank that never starts.

Each scenario asserts the content of the error or report, that every rank exited within
deadline + 30 s of the fault (per-rank status records, and Slurm's end time of the step, which also
covers ranks killed without a record), and that sacct marks the job FAILED. The times from the
fault to the error/report and to the last rank's exit are printed (run with -s to see them).
Scenarios 1-5 (hangs inside collectives) are in test_faults_devcluster.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
DOCTOR = ROOT / "examples" / "doctor.py"
from helpers.jobs import sacct_state  # noqa: E402
from helpers.jobs import job_id_of  # noqa: E402


SITE = (ROOT / "site_configs" / "devcluster.yaml").read_text()
INIT_TIMEOUT = 20.0      # HPCRING_INIT_TIMEOUT for these jobs: the bootstrap deadline
DOCTOR_TIMEOUT = 60.0    # hpcring doctor --timeout
SACCT_RESOLUTION = 1.0   # sacct's End has whole seconds


def submit_doctor(tag: str, site_text: str, *, env=None, doctor_args=()) -> dict:
    """Submit examples/doctor.py on 3x2 ranks with a site config written from ``site_text``; wait.

    Returns rc, the output of `submit --wait`, the job id, per-rank status records, the doctor's JSON
    report (if it got that far), the sacct state and the end of the job's srun step (epoch s).
    """
    folder = Path("/srv/hpcring/pytest-faults") / f"{tag}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    site = folder / "site.yaml"   # on the shared file system: the doctor reads it on every node
    site.write_text(site_text)
    report_path = folder / "doctor.json"
    e = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_STATE_DIR=str(folder / "state"),
             HPCRING_INIT_TIMEOUT=f"{INIT_TIMEOUT:g}", **(env or {}))
    cmd = [sys.executable, "-m", "hpcring", "submit", str(DOCTOR), "--site", str(site), "--nodes", "3",
           "--tasks-per-node", "2", "--time", "5", "--wait", "--",
           "--json", str(report_path), "--timeout", f"{DOCTOR_TIMEOUT:g}", *doctor_args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=e, cwd=str(ROOT), stdin=subprocess.DEVNULL)
    job = job_id_of(r)
    statuses = {s["rank"]: s for s in (json.loads(p.read_text()) for p in
                                       (Path("/srv/hpcring/jobs") / job).glob("*_status.json"))}
    return {"rc": r.returncode, "out": r.stdout, "err": r.stderr, "job": job, "folder": folder,
            "statuses": statuses, "state": sacct_state(job), "step_end": step_end(job),
            "report": json.loads(report_path.read_text()) if report_path.exists() else None}


def step_end(job: str) -> float | None:
    """When Slurm saw the last task of the job's srun step (``JOB.0``) end, as epoch seconds."""
    for _ in range(30):
        r = subprocess.run(["sacct", "-j", job, "-n", "-P", "-o", "JobID,End"], capture_output=True, text=True,
                           timeout=30)
        for line in r.stdout.splitlines():
            step, _, end = line.partition("|")
            if step == f"{job}.0" and end not in ("", "Unknown"):
                return time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S"))
        time.sleep(1)
    return None


def check_exits(res: dict, fault: float, deadline: float, extra_ends=()) -> float:
    """Every rank (status records, ``extra_ends``, the step's end) exited within deadline + 30 s of
    ``fault``; returns the last exit."""
    assert res["state"] == "FAILED", (res["state"], res["err"][-3000:])
    assert res["step_end"] is not None, f"sacct has no end for step {res['job']}.0"
    ends = [s["ended"] for s in res["statuses"].values()] + list(extra_ends)
    for end in ends:
        assert end - fault <= deadline + 30, (end - fault, res["statuses"])
    assert res["step_end"] - fault <= deadline + 30 + SACCT_RESOLUTION, res["step_end"] - fault
    return max(ends + [res["step_end"]])


def report_times(name: str, fault: float, error_at: float, last_exit: float, deadline: float) -> None:
    print(f"\n[{name}] fault -> error/report {error_at - fault:.1f} s, fault -> last rank exit "
          f"{last_exit - fault:.1f} s (deadline {deadline:g} s)")


def test_6_dead_interface_fails_fast_naming_it():
    res = submit_doctor("dead0", SITE.replace('data_interfaces: ["=eth0"]', 'data_interfaces: ["=dead0"]'))
    assert res["rc"] != 0
    assert "dead0" in res["err"] and "10.98.0." in res["err"], res["err"][-3000:]
    assert "eth0" in res["err"]   # the interfaces that did connect are named
    statuses = res["statuses"]
    assert sorted(statuses) == list(range(6)), statuses
    for s in statuses.values():   # every rank: the verification error (no rank waited for a timeout)
        assert s["exit_code"] == 1 and "interface verification failed" in s["error"], s
        assert "dead0" in s["error"] and "10.98.0." in s["error"], s
    fault = min(s["started"] for s in statuses.values())   # the broken config is in place from the start
    last = check_exits(res, fault, INIT_TIMEOUT)
    report_times("6 dead interface", fault, max(s["ended"] for s in statuses.values()), last, INIT_TIMEOUT)


def test_7_slow_link_is_named_by_the_doctor():
    tc = ["tc", "qdisc", "add", "dev", "hpcv-node2", "root", "tbf", "rate", "200mbit", "burst", "64kb",
          "latency", "100ms"]
    subprocess.run(tc, check=True)
    fault = time.time()
    try:
        res = submit_doctor("slowlink", SITE)
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "hpcv-node2", "root"], check=False)
    assert res["rc"] != 0, res["out"][-3000:]
    rep = res["report"]
    assert rep is not None, res["err"][-3000:]
    checks = {c["name"]: c for c in rep["checks"]}
    assert rep["verdict"] == "FAIL" and checks["bandwidth"]["status"] == "FAIL", checks
    # tbf on node2's root-side veth shapes traffic *into* node2: the ring link 1 -> 2 (node1 -> node2)
    assert "slow link rank 1 on node1 -> rank 2 on node2 via eth0 (10.99.0.1 -> 10.99.0.2)" in checks["bandwidth"]["detail"]
    slowest = min((lk for lk in rep["links"] if "rate" in lk), key=lambda lk: lk["rate"])
    assert (slowest["src"], slowest["dst"]) == (1, 2), rep["links"]
    for name in ("interfaces", "names/MTU", "env", "connectivity eth0"):
        assert checks[name]["status"] == "OK", checks[name]
    assert "verdict: FAIL: 1 failed (bandwidth)" in res["out"]   # rank 0's table, through submit --wait
    assert sorted(res["statuses"]) == list(range(6)) and all(s["exit_code"] == 1 for s in res["statuses"].values())
    # the deadline that applies is the doctor's, counted from when it started
    last = check_exits(res, rep["started"], DOCTOR_TIMEOUT)
    report_times("7 slow link (from tc)", fault, rep["finished"], last, DOCTOR_TIMEOUT)
    report_times("7 slow link (from the doctor's start)", rep["started"], rep["finished"], last, DOCTOR_TIMEOUT)


WRAPPER = """#!/bin/bash
# The interpreter of rank 3 never starts (stuck before hpcring.init(), like a hung module load or
# file system); every other rank runs the real one.
if [ "${SLURM_PROCID:-}" = "3" ]; then
  echo "fault: rank 3 on $(hostname) hangs before starting python" >&2
  trap 'date +%s.%N > {folder}/rank3.ended; exit 143' TERM
  sleep 600 & wait $!
fi
exec {python} "$@"
"""


def test_8_rank_that_never_starts_is_named_with_its_host():
    folder = Path("/srv/hpcring/pytest-faults") / f"wrap-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    wrapper = folder / "python"
    wrapper.write_text(WRAPPER.replace("{python}", sys.executable).replace("{folder}", str(folder)))
    wrapper.chmod(0o755)
    # --kill-on-bad-exit: once the others fail, Slurm ends the stuck rank too (the bundled template
    # does not pass it, so a rank stuck before init would otherwise hold the job to its time limit).
    site = SITE.replace("  mpi: pmix\n", '  mpi: pmix\n  args: ["--kill-on-bad-exit=1"]\n') + f"python: {wrapper}\n"
    res = submit_doctor("norank", site)
    assert res["rc"] != 0
    statuses = res["statuses"]
    assert sorted(statuses) == [0, 1, 2, 4, 5], statuses   # rank 3 never ran any Python
    for s in statuses.values():   # every rank that came names the one that did not, and its host
        assert "1 of 6 ranks never reached hpcring.init(): rank 3 on node2" in s["error"], s
    assert "rank 3 on node2" in res["err"], res["err"][-3000:]
    fault = min(s["started"] for s in statuses.values())   # rank 3 should have started with the others
    stuck = folder / "rank3.ended"
    last = check_exits(res, fault, INIT_TIMEOUT, [float(stuck.read_text())] if stuck.exists() else [])
    report_times("8 rank never starts", fault, max(s["ended"] for s in statuses.values()), last, INIT_TIMEOUT)
    shutil.rmtree(folder, ignore_errors=True)

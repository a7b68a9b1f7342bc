"""Fault matrix: 3 ranks, one fault each, on this machine and on the Slurm dev cluster, ring and MPI.

    python benchmarks/fault_matrix.py                          # everything (about 15-25 min)
    python benchmarks/fault_matrix.py --where local --backends ring --faults stop,kill

Faults (tests/workers/fault_worker.py; the victim is rank 1, on node2 on the dev cluster):
  stop       the victim SIGSTOPs itself inside an allreduce (a frozen rank)
  kill       the victim SIGKILLs itself inside an allreduce
  exit       the victim exits 0 before the collective
  different  the victim calls barrier where the others call allreduce
  mismatch   the victim all-reduces half the count (on MPI too: the signature check names it)
  late       the victim sits in its data loader before its first collective (the ring connects there)
  cut        node2's link goes down while every rank loops over 16 MiB allreduces (dev cluster)
  slow       node2's link drops to 1 Mbit/s (tc tbf) during the same loop (dev cluster)
  never      the victim never reaches hpcring.init()

Where: ``local`` = ``hpcring submit --site local`` (the local backend's supervisor) for ring, and
``mpirun -np 3`` on this machine for MPI; ``slurm`` = ``hpcring submit --site devcluster`` with
3 nodes x 1 rank; ``lsf`` = ``hpcring submit --site devcluster-lsf`` through the LSF emulation
(tests/lsf_emulation, blaunch on the dev cluster's nodes; ring only: blaunch gives no MPI
environment). Per run (HPCRING_TIMEOUT = --deadline, HPCRING_DIAG_GRACE 3 s):

  named     the victim appears in the hang report's headline (or, for ``never``, in the ranks'
            bootstrap error; for ``cut`` the victim's host is named unreachable)
  ->report  fault to the hang report on disk (or the first rank's bootstrap error)
  ->gone    fault to the last rank process gone from this machine's process table (ranks on dev
            cluster nodes are processes here too: the nodes are network namespaces)
  ->squeue  fault to the job leaving squeue (local backend: its state file turning final; LSF:
            bjobs showing DONE/EXIT)
  state     sacct's state (local: the local backend's; mpirun: its exit code)

A row passes when the victim is named, ->gone and ->squeue are within deadline + 30 s, the
state is FAILED and, on the dev cluster, no node is left drained or down (a step slurmd could not
kill drains its node "Kill task failed" and blocks later jobs). The exit status is the number of failing rows. The fault matrix in the test suite
(tests/integration/test_fault_matrix.py) runs a subset of these rows through the same code.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "fault_worker.py"
FAULTS = ["stop", "kill", "exit", "different", "mismatch", "late", "cut", "slow", "never"]
LINK_FAULTS = {"cut", "slow"}
VICTIM = 1
SIZE = 3
VETH = "hpcv-node2"      # node2's link on the dev cluster's bridge (the victim's node)
SHARED = Path("/srv/hpcring")
LSF_ENV = {"PATH": f"{ROOT / 'tests' / 'lsf_emulation' / 'bin'}:{os.environ['PATH']}",
           "HPCRING_LSF_EMU_DIR": str(SHARED / ".lsf-emulation-fault-matrix")}
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl": "tcp,self",
           "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo",
           "OMPI_MCA_mpi_yield_when_idle": "1", "HPCRING_MASTER_ADDR": "127.0.0.1"}


@dataclass
class Result:
    where: str
    backend: str
    fault: str
    rc: int | None = None
    state: str = "?"
    named: bool = False
    headline: str = ""
    fault_at: float | None = None
    report_at: float | None = None
    gone_at: float | None = None
    queue_at: float | None = None
    job: str = ""
    out: str = ""
    folder: Path | None = None
    bad_nodes: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def dt(self, t: float | None) -> float | None:
        return None if t is None or self.fault_at is None else t - self.fault_at

    def ok(self, deadline: float) -> bool:
        limit = deadline + 30
        return (self.named and self.state == "FAILED" and not self.bad_nodes and self.dt(self.gone_at) is not None
                and self.dt(self.gone_at) <= limit and self.dt(self.queue_at) is not None
                and self.dt(self.queue_at) <= limit)


class ProcWatch:
    """Remembers when the last process whose command line contains ``marker`` was seen."""

    def __init__(self, marker: str, exclude: tuple[str, ...] = ()) -> None:
        self.marker, self.exclude = marker.encode(), exclude
        self.last_seen: float | None = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def alive(self) -> list[int]:
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                cmd = (d / "cmdline").read_bytes()
                stat = (d / "stat").read_text().rsplit(") ", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if stat == "Z" or self.marker not in cmd:
                continue
            argv0 = os.path.basename(cmd.split(b"\0")[0].decode(errors="replace"))
            if argv0 in self.exclude or b"hpcring submit" in cmd.replace(b"\0", b" ") or b"-m\0hpcring\0submit" in cmd:
                continue
            pids.append(int(d.name))
        return pids

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.alive():
                self.last_seen = time.time()
            time.sleep(0.2)

    def stop(self) -> float | None:
        self._stop.set()
        self._t.join(5)
        return self.last_seen


def _env(deadline: float, folder: Path, extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_TIMEOUT=f"{deadline:g}", HPCRING_DIAG_GRACE="3",
               HPCRING_INIT_TIMEOUT=f"{max(10.0, deadline * 2):g}", HPCRING_JOB_DIR=str(folder),
               HPCRING_STATE_DIR=str(folder / "state"))
    env.update(extra or {})
    return env


def _link_fault(fault: str, folder: Path, deadline: float) -> float:
    """Wait until every rank loops, then cut or slow node2's link; restore it afterwards."""
    end = time.time() + 120
    while time.time() < end:
        logs = "".join(p.read_text(errors="replace") for p in folder.glob("*/*_log.out"))
        if logs.count("phase=looping") >= 3:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    t = time.time()
    if fault == "cut":
        cmd, undo = ["ip", "link", "set", VETH, "down"], ["ip", "link", "set", VETH, "up"]
    else:
        cmd = ["tc", "qdisc", "add", "dev", VETH, "root", "tbf", "rate", "1mbit", "burst", "32kb", "latency", "400ms"]
        undo = ["tc", "qdisc", "del", "dev", VETH, "root"]
    subprocess.run(cmd, check=True)
    try:
        # Keep it until node2's ranks had to give up (deadline + store timeout + grace), then heal
        # it so that slurmd can report the step: a link that stays down is a NODE_FAIL.
        time.sleep(deadline + 5 + 3 + 4)
    finally:
        subprocess.run(undo, check=False)
    return t


def _squeue_gone(job: str, timeout: float = 300) -> float | None:
    end = time.time() + timeout
    while time.time() < end:
        r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and not r.stdout.strip():
            return time.time()
        if r.returncode != 0 and "Invalid job id" in r.stderr:
            return time.time()
        time.sleep(0.3)
    return None


def unusable_nodes() -> list[str]:
    """Dev cluster nodes drained, draining, down or failed, with Slurm's reason."""
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %E"], capture_output=True, text=True, timeout=30)
    return [ln for ln in r.stdout.splitlines() if len(ln.split()) > 1
            and any(w in ln.split()[1] for w in ("drain", "down", "fail"))]


def _sacct(job: str) -> str:
    state = "?"
    for _ in range(30):
        r = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True,
                           timeout=30)
        state = r.stdout.strip().split()[0] if r.stdout.strip() else "?"
        if state not in ("?", "RUNNING", "COMPLETING", "PENDING"):
            return state
        time.sleep(1)
    return state


def _bjobs_final(job: str, env: dict, timeout: float = 300) -> tuple[float | None, str]:
    """When bjobs shows the job finished (DONE/EXIT), and hpcring's state for it."""
    end = time.time() + timeout
    while time.time() < end:
        r = subprocess.run(["bjobs", "-o", "jobid stat", "-noheader", job], capture_output=True, text=True,
                           env=env, timeout=30)
        stat = r.stdout.split()[1] if len(r.stdout.split()) > 1 else "?"
        if stat in ("DONE", "EXIT"):
            return time.time(), {"DONE": "COMPLETED", "EXIT": "FAILED"}[stat]
        time.sleep(0.3)
    return None, "?"


def _local_final(folder: Path, job: str, timeout: float = 300) -> tuple[float | None, str]:
    """When the local backend's state file turned final (its mtime), and the state."""
    path = folder / job / f"{job}_local.json"
    end = time.time() + timeout
    while time.time() < end:
        try:
            data = json.loads(path.read_text())
            if data.get("state") not in ("PENDING", "RUNNING"):
                return path.stat().st_mtime, data["state"]
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return None, "?"


def run_one(where: str, backend: str, fault: str, deadline: float = 6.0) -> Result:
    res = Result(where, backend, fault)
    folder = SHARED / "fault-matrix" / f"{where}-{backend}-{fault}-{uuid.uuid4().hex[:6]}"
    folder.mkdir(parents=True)
    res.folder = folder
    args = [fault, str(VICTIM), "--backend", backend]
    if where == "local" and backend == "mpi":
        # no scheduler: Open MPI's mpirun starts and ends the ranks (one exits non-zero: all go)
        mpirun = shutil.which("mpirun")
        cmd = [mpirun, "-np", "3", "--oversubscribe", sys.executable, str(WORKER), *args, "--tag", folder.name]
        env = _env(deadline, folder, {**MPI_ENV, "HPCRING_SECRET": uuid.uuid4().hex * 2})
        watch = ProcWatch(folder.name, exclude=("mpirun", "orterun", "prterun"))
    else:
        site = {"local": "local", "slurm": "devcluster", "lsf": "devcluster-lsf"}[where]
        shape = ["--nodes", "1", "--tasks-per-node", "3"] if where == "local" else ["--nodes", "3", "--tasks-per-node", "1"]
        cmd = [sys.executable, "-m", "hpcring", "submit", str(WORKER), "--site", site, *shape, "--time", "5",
               "--wait", "--", *args]
        env = _env(deadline, folder, LSF_ENV if where == "lsf" else None)
        watch = ProcWatch(str(folder))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=str(folder), stdin=subprocess.DEVNULL)
    link = {}
    if fault in LINK_FAULTS:
        th = threading.Thread(target=lambda: link.update(t=_link_fault(fault, folder, deadline)), daemon=True)
        th.start()
    try:
        res.out, _ = p.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        p.kill()
        try:    # bounded: a child of the runner may still hold its output open
            res.out, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            res.out = ""
        res.notes.append("runner timed out")
    res.rc = p.returncode
    if fault in LINK_FAULTS:
        th.join(60)
    m = re.search(r"Submitted job (\S+)", res.out)
    res.job = m.group(1) if m else ""
    if where == "slurm" and res.job:
        res.queue_at = _squeue_gone(res.job)
        res.state = _sacct(res.job)
        res.bad_nodes = unusable_nodes()
        if res.bad_nodes:
            res.notes.append(f"nodes not usable: {'; '.join(res.bad_nodes)}")
    elif where == "local" and res.job:
        res.queue_at, res.state = _local_final(folder, res.job)
    elif where == "lsf" and res.job:
        res.queue_at, res.state = _bjobs_final(res.job, env)
    else:                                   # mpirun: returned = out of the "queue"
        res.queue_at, res.state = time.time(), ("FAILED" if res.rc else "COMPLETED")
    time.sleep(1.0)
    res.gone_at = watch.stop()
    faults = [float(t) for t in re.findall(r"phase=fault t=([\d.]+)", res.out + _rank_logs(folder))]
    res.fault_at = link.get("t") or (min(faults) if faults else None)
    _read_report(res, folder)
    return res


def _rank_logs(folder: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in folder.glob("*/*_log.*"))


def names_victim(text: str) -> bool:
    """"rank 1 (node2)", "ranks 1-2", "rank(s) 1 (local0)": the victim is named (in a group of
    ranks that is not all of them)."""
    for m in re.finditer(r"\brank(?:s|\(s\))? ([\d,\-]+)", text):
        named = set()
        for part in m.group(1).strip(",-").split(","):
            lo, _, hi = part.partition("-")
            if lo.isdigit():
                named.update(range(int(lo), int(hi if hi.isdigit() else lo) + 1))
        if VICTIM in named and named != set(range(SIZE)):
            return True
    return False


def _read_report(res: Result, folder: Path) -> None:
    reports = list(folder.glob("**/diag/hang-report.json"))
    if reports:
        rep = json.loads(reports[0].read_text())
        res.report_at = reports[0].stat().st_mtime
        res.headline = rep.get("headline", "")
        res.named = names_victim(res.headline) or VICTIM in rep.get("categories", {}).get("unreachable", [])
        return
    statuses = [json.loads(p.read_text()) for p in folder.glob("*/*_status.json")]
    errors = [s for s in statuses if s.get("error")]
    if errors:                              # no collective ran: the bootstrap error names the rank
        first = min(errors, key=lambda s: s.get("ended", 0))
        res.report_at, res.headline = first.get("ended"), first["error"].splitlines()[0]
        res.named = any(names_victim(s["error"].splitlines()[0]) for s in errors)
        return
    m = re.search(r"(\d+ of \d+ ranks never reached hpcring\.init\(\): rank \d+ [^\n;]*|ranks? [\d,\-]+ \(\S+\) (?:was|were) killed first[^\n]*"
                  r"|mpirun noticed that process rank \d+ [^\n]*)", res.out)
    if m:                                   # mpirun/srun's own word, or the bootstrap error on stderr
        res.headline, res.named = m.group(1).strip(), names_victim(m.group(1))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_table(rows: list[Result], deadline: float) -> None:
    print(f"\n# fault matrix: 3 ranks, victim rank {VICTIM}, deadline {deadline:g} s, diag grace 3 s; "
          f"times in s from the fault; limit deadline + 30 = {deadline + 30:g} s")
    print(f"{'where':<6} {'backend':<7} {'fault':<9} {'named':>5} {'->report':>8} {'->gone':>7} {'->squeue':>8} "
          f"{'state':<10} {'ok':<3} headline")
    for r in rows:
        print(f"{r.where:<6} {r.backend:<7} {r.fault:<9} {'yes' if r.named else 'NO':>5} {_fmt(r.dt(r.report_at)):>8} "
              f"{_fmt(r.dt(r.gone_at)):>7} {_fmt(r.dt(r.queue_at)):>8} {r.state:<10} {'ok' if r.ok(deadline) else 'NO':<3} "
              f"{r.headline[:90]}" + (f"  [{'; '.join(r.notes)}]" if r.notes else ""))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--where", default="local,slurm")
    ap.add_argument("--backends", default="ring,mpi")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--deadline", type=float, default=6.0)
    ap.add_argument("--keep", action="store_true", help="keep the job folders under /srv/hpcring/fault-matrix")
    a = ap.parse_args(argv)
    rows = []
    for where in a.where.split(","):
        for backend in a.backends.split(","):
            for fault in a.faults.split(","):
                if where == "local" and fault in LINK_FAULTS:
                    continue               # one host: no link to cut (loopback is shared by everyone)
                if where == "lsf" and backend == "mpi":
                    continue               # blaunch gives no MPI environment (mpirun under LSF: not emulated)
                r = run_one(where, backend, fault, a.deadline)
                rows.append(r)
                print(f"  {where}/{backend}/{fault}: {'ok' if r.ok(a.deadline) else 'FAIL'} "
                      f"(->gone {_fmt(r.dt(r.gone_at))} s, state {r.state})", file=sys.stderr, flush=True)
                if not a.keep and r.ok(a.deadline):
                    shutil.rmtree(r.folder, ignore_errors=True)
    print_table(rows, a.deadline)
    return sum(not r.ok(a.deadline) for r in rows)


if __name__ == "__main__":
    sys.exit(main())

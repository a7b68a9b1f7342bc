"""How long a lost node costs: restarts inside the allocation, side by side with torchrun's agent.

    python benchmarks/recovery.py [--steps 40] [--kill-at 12] [--deadline 10] [--only kill,freeze,torchrun]
    python benchmarks/recovery.py --long 20 --every 4      # effective training time under faults

Needs the dev cluster (``hpcring devcluster up``, 3 nodes or more) and torch. The job is DDP on the
``hpcring`` backend (benchmarks/recovery_train.py: a checkpoint every step, deterministic data), on
2 nodes with 1 spare (``submit --spare-nodes 1 --max-restarts 2``). Each scenario prints one line:

* ``kill``: every process of rank 1's node namespace but slurmd SIGKILLed (the node lost; slurmd
  is spared so the dev cluster stays usable) at step ``--kill-at``;
* ``freeze``: the same processes SIGSTOPped (the node frozen); thawed and killed afterwards;
* ``torchrun``: ``srun -N3 torchrun --nnodes=2:2 --max-restarts=3 --rdzv-backend=c10d`` (DDP on
  gloo, the third node standing by), the same kill;
* ``--long M --every E``: an M-minute run with a rank's node killed every E minutes, effective
  training time (productive step time / wall time) for restarts in the allocation (``--spares K``
  spare nodes, ``--min-nodes 1``) and for resubmission (``--wait --max-restarts``, no spare), side
  by side. A kill goes to the node of rank 1's latest start (never the job's first node, where
  the batch script runs: losing it ends any allocation); ``--spares 4`` on a 6-node dev cluster
  (``hpcring devcluster up --nodes 6``) lets every kill of a 20-minute run land on a live rank.

Columns: fault-to-next-step seconds (the kill to the first step that completes after it), the
jobs it took, the end state, whether the final weights equal an uninterrupted run's (the same
checkpoint schedule). Times from one run on this 2-core machine: bounded by Python and torch
start-up (several seconds a rank when the cores are shared), not by the network.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "benchmarks" / "recovery_train.py"
SHARED = Path("/srv/hpcring/bench-recovery")
PY = sys.executable
STEP = re.compile(r"STEP (\d+) rank (\d+) size (\d+) t=([\d.]+)")
START = re.compile(r"START rank (\d+) size (\d+) step (\d+) restarts (\d+) host (\S+) t=([\d.]+)")


BACKEND = "ring"


def env_for(base: Path, deadline: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_JOB_DIR=str(base / "jobs"),
               HPCRING_STATE_DIR=str(base / "state"), HPCRING_TIMEOUT=str(deadline), HPCRING_BACKEND=BACKEND)
    for v in ("HPCRING_MAX_RESTARTS", "HPCRING_SPARE_NODES", "HPCRING_MIN_NODES"):
        env.pop(v, None)
    return env


def node_pids(node: str) -> list[tuple[int, str]]:
    """(pid, command) of every process in the node's network namespace but slurmd."""
    out = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split()
    pids = []
    for p in out:
        try:
            comm = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        if comm != "slurmd":
            pids.append((int(p), comm))
    return pids


def signal_node(node: str, sig: int) -> int:
    n = 0
    for pid, _ in node_pids(node):
        try:
            os.kill(pid, sig)
            n += 1
        except OSError:
            pass
    return n


def lines_of(folder: Path, pattern: str = "*_log.out") -> list[str]:
    out = []
    for f in sorted(folder.rglob(pattern)):
        try:
            out += f.read_text(errors="replace").splitlines()
        except OSError:
            pass
    return out


def wait_for(pred, timeout: float, poll: float = 0.1):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    return None


def first_step_after(lines: list[str], t: float) -> float | None:
    """When the first training step after the fault completed on the new set of ranks: the first
    STEP line after the first (re)start after ``t`` (steps the survivors finished in flight do not
    count)."""
    starts = [float(m.group(6)) for m in map(START.search, lines) if m and float(m.group(6)) > t]
    if not starts:
        return None
    ts = [float(m.group(4)) for m in map(STEP.search, lines) if m and float(m.group(4)) > min(starts)]
    return min(ts) if ts else None


def site_for(base: Path, nodes: int) -> str:
    """The devcluster site, or a copy of it whose partition takes ``nodes`` (its max_nodes is the
    3 of `hpcring devcluster up`'s default; a larger cluster is made with --nodes)."""
    if nodes <= 3:
        return "devcluster"
    text = (ROOT / "site_configs" / "devcluster.yaml").read_text()
    path = base / "devcluster-wide.yaml"
    path.write_text(re.sub(r"max_nodes: 3\b", f"max_nodes: {nodes}", text, count=1))
    return str(path)


def submit(base: Path, args, *flags, wait=True, deadline=10.0) -> subprocess.Popen:
    out = base / "out"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [PY, "-m", "hpcring", "submit", str(TRAIN), "--site", site_for(base, 2 + args.spares), "--nodes", "2",
           "--tasks-per-node", "1", "--time", str(args.time), *(["--wait"] if wait else []), *flags, "--",
           str(out), "--steps", str(args.steps), "--step-s", str(args.step_s)]
    log = open(base / "submit.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env_for(base, deadline), cwd=str(ROOT),
                            stdin=subprocess.DEVNULL)


def job_folders(base: Path) -> list[Path]:
    return sorted((p for p in (base / "jobs").glob("*") if p.is_dir() and p.name[0].isdigit()),
                  key=lambda p: int(re.sub(r"\D.*", "", p.name) or 0))


def rank_host(base: Path, rank: int) -> str | None:
    for line in lines_of(base / "jobs"):
        m = START.search(line)
        if m and int(m.group(1)) == rank:
            return m.group(5)
    return None


def reference(args) -> str:
    base = SHARED / f"ref-{uuid.uuid4().hex[:6]}"
    p = submit(base, args)
    p.wait(timeout=600)
    return json.loads((base / "out" / "result.json").read_text())["sha256"]


def hpcring_fault(args, how: str, ref: str) -> dict:
    base = SHARED / f"{how}-{uuid.uuid4().hex[:6]}"
    p = submit(base, args, "--spare-nodes", "1", "--max-restarts", "2", deadline=args.deadline)
    at = wait_for(lambda: any(f"STEP {args.kill_at} rank 1 " in ln for ln in lines_of(base / "jobs")), 300)
    node = rank_host(base, 1)
    if not at or not node:
        p.kill()
        return {"scenario": f"hpcring {how} ({BACKEND})", "error": "the job never reached the step to break"}
    t_fault = time.time()
    n = signal_node(node, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        p.wait(timeout=600)
    finally:
        if how == "freeze":
            signal_node(node, signal.SIGCONT)
            signal_node(node, signal.SIGKILL)
    text = (base / "submit.log").read_text()
    folders = job_folders(base)
    nxt = first_step_after(lines_of(base / "jobs"), t_fault)
    res = json.loads((base / "out" / "result.json").read_text()) if (base / "out" / "result.json").exists() else {}
    steps = json.loads((folders[-1] / "steps.json").read_text()) if folders and (folders[-1] / "steps.json").exists() else {}
    return {"scenario": f"hpcring {how}", "node": node, "processes": n, "fault_to_next_step_s": nxt and nxt - t_fault,
            "jobs": len(re.findall(r"Submitted job", text)), "state": "COMPLETED" if "COMPLETED: 2 ranks" in text
            else "FAILED", "weights_equal": res.get("sha256") == ref, "restarts": res.get("restarts"),
            "steps": [(s.get("hosts"), s.get("end"), s.get("lost_s")) for s in steps.get("steps", [])],
            "folder": str(base)}


TORCHRUN_SCRIPT = """#!/bin/bash
#SBATCH --nodes=3
#SBATCH --no-kill
#SBATCH --ntasks-per-node=1
#SBATCH --time={time}
#SBATCH --partition=debug
#SBATCH --output={base}/torchrun-%j.out
#SBATCH --error={base}/torchrun-%j.err
export GLOO_SOCKET_IFNAME=eth0 PYTHONPATH={root}/src OMP_NUM_THREADS=1
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun --kill-on-bad-exit=0 --output={base}/node-%N.out --error={base}/node-%N.err \\
  {py} -m torch.distributed.run --nnodes=2:2 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d \\
  --rdzv-endpoint="$head":29411 --rdzv-id=$SLURM_JOB_ID {train} {base}/out --backend gloo --steps {steps} \\
  --step-s {step_s}
"""


def torchrun_fault(args, ref: str) -> dict:
    base = SHARED / f"torchrun-{uuid.uuid4().hex[:6]}"
    (base / "out").mkdir(parents=True)
    script = base / "job.sh"
    script.write_text(TORCHRUN_SCRIPT.format(time=args.time, base=base, root=ROOT, py=PY, train=TRAIN,
                                             steps=args.steps, step_s=args.step_s))
    jid = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                         check=True).stdout.strip().split(";")[0]
    at = wait_for(lambda: any(f"STEP {args.kill_at} rank 1 " in ln for ln in lines_of(base, "node-*.out")), 300)
    # a worker's node that does not hold the c10d store (the allocation's first node, torchrun's own
    # single point of failure, which the scenario leaves alone)
    head = subprocess.run(["squeue", "-h", "-j", jid, "-o", "%N"], capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["scontrol", "show", "hostnames", head], capture_output=True, text=True).stdout.split()[:1]
    workers = [m.group(5) for m in map(START.search, lines_of(base, "node-*.out")) if m]
    node = next((h for h in workers if h not in head), None)
    if not at or not node:
        subprocess.run(["scancel", jid])
        return {"scenario": "torchrun kill", "error": f"no step {args.kill_at} on a node other than the store's"}
    t_fault = time.time()
    n = signal_node(node, signal.SIGKILL)
    def over():
        q = subprocess.run(["squeue", "-h", "-j", jid, "-o", "%T"], capture_output=True, text=True)
        return q.returncode == 0 and q.stdout.strip() in ("", "COMPLETED", "FAILED", "CANCELLED")
    done = wait_for(over, args.torchrun_wait, poll=1.0)
    if not done:
        subprocess.run(["scancel", jid])
    time.sleep(1)
    lines = lines_of(base, "node-*.out")
    nxt = first_step_after(lines, t_fault)
    res = json.loads((base / "out" / "result.json").read_text()) if (base / "out" / "result.json").exists() else {}
    errs = "\n".join(lines_of(base, "node-*.err"))
    why = None
    if not nxt:
        cands = [ln for ln in errs.splitlines() if re.search(r"Error|error|Timeout|timed out|CANCELLED", ln)]
        why = (cands[-1].strip()[:300] if cands else "no step after the kill") + \
            ("" if done else f"; still running {args.torchrun_wait:g} s after the kill: cancelled")
    return {"scenario": "torchrun kill", "node": node, "processes": n, "fault_to_next_step_s": nxt and nxt - t_fault,
            "jobs": 1, "state": "COMPLETED" if res else "FAILED", "weights_equal": res.get("sha256") == ref if res else None,
            "how_it_failed": why, "folder": str(base)}


def long_run(args, ref: str | None) -> list[dict]:
    """--long: an M-minute run, a node killed every E minutes; productive step time / wall time."""
    out = []
    modes = {"alloc": (f"in allocation ({args.spares} spares)",
                       ("--spare-nodes", str(args.spares), "--max-restarts", "20", "--min-nodes", "1")),
             "resubmit": ("resubmission (--wait)", ("--max-restarts", "20", "--no-node-history"))}
    for mode, flags in (modes[m] for m in args.long_modes.split(",")):
        base = SHARED / f"long-{uuid.uuid4().hex[:6]}"
        steps = int(args.long * 60 / args.step_s)
        # the time limit: the run, its restarts and a resubmission's queueing (at most the dev
        # cluster partition's 60 minutes)
        a = argparse.Namespace(**{**vars(args), "steps": steps, "time": min(60, int(args.long * 2) + 10)})
        t0 = time.time()
        p = submit(base, a, *flags, deadline=args.deadline)
        kills, last_kill = 0, 0.0
        while p.poll() is None and time.time() - t0 < args.long * 60 * 3:
            time.sleep(1)
            if time.time() - t0 > (kills + 1) * args.every * 60:
                # rank 1's node, once a (re)start after the last kill put a rank there: between a
                # resubmission's jobs the last START names a node with nothing left to kill
                starts = [START.search(ln) for ln in lines_of(base / "jobs")]
                starts = [m for m in starts if m and int(m.group(1)) == 1 and float(m.group(6)) > last_kill]
                node = starts[-1].group(5) if starts else None
                if node:
                    signal_node(node, signal.SIGKILL)
                    kills, last_kill = kills + 1, time.time()
        wall = time.time() - t0
        lines = lines_of(base / "jobs")
        done = {}
        for m in filter(None, map(STEP.search, lines)):
            if int(m.group(2)) == 0:
                done.setdefault(int(m.group(1)), float(m.group(4)))
        productive = len(done) * args.step_s
        if not done and p.returncode:       # the submission itself failed: say why, not "0%"
            raise SystemExit(f"recovery.py: the {mode} run failed: "
                             f"{(base / 'submit.log').read_text(errors='replace')[-2000:]}")
        out.append({"scenario": f"long {args.long:g} min, {mode}", "kills": kills, "wall_s": round(wall, 1),
                    "steps_done": len(done), "effective": round(productive / wall, 3), "folder": str(base)})
        subprocess.run([PY, "-m", "hpcring", "devcluster", "up"], capture_output=True, env=dict(os.environ))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-s", type=float, default=0.25)
    ap.add_argument("--kill-at", type=int, default=12)
    ap.add_argument("--deadline", type=float, default=10.0)
    ap.add_argument("--time", type=int, default=10, help="job time limit, minutes")
    ap.add_argument("--only", default="kill,freeze,torchrun")
    ap.add_argument("--backend", default="ring", choices=("ring", "mpi"),
                    help="hpcring's collective backend under the torch backend (the dev cluster's site picks mpi "
                         "under srun --mpi=pmix; ring notices a dead peer at once, MPI at the deadline)")
    ap.add_argument("--torchrun-wait", type=float, default=150.0)
    ap.add_argument("--long", type=float, default=0.0, help="minutes of the long run (0: skip)")
    ap.add_argument("--every", type=float, default=4.0)
    ap.add_argument("--spares", type=int, default=1,
                    help="--long, in the allocation: spare nodes beside the job's 2 (the dev cluster needs 2 + this "
                         "many nodes: hpcring devcluster up --nodes N)")
    ap.add_argument("--long-modes", default="alloc,resubmit",
                    help="--long: which recoveries to run, comma-separated: alloc (in the allocation), resubmit")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not set(args.long_modes.split(",")) <= {"alloc", "resubmit"}:
        ap.error(f"--long-modes: {args.long_modes!r}: expected alloc, resubmit or both, comma-separated")
    global BACKEND
    BACKEND = args.backend
    SHARED.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    t = time.time()
    ref = reference(args)
    print(f"reference: an uninterrupted run, 2 nodes, {args.steps} steps ({time.time() - t:.0f} s)", flush=True)
    rows = []
    for how in ("kill", "freeze"):
        if how in only:
            rows.append(hpcring_fault(args, how, ref))
            print(json.dumps(rows[-1]), flush=True)
            subprocess.run([PY, "-m", "hpcring", "devcluster", "up"], capture_output=True)   # repair the node
    if "torchrun" in only:
        rows.append(torchrun_fault(args, ref))
        print(json.dumps(rows[-1]), flush=True)
        subprocess.run([PY, "-m", "hpcring", "devcluster", "up"], capture_output=True)
    if args.long:
        for r in long_run(args, ref):
            rows.append(r)
            print(json.dumps(r), flush=True)
    print()
    print(f"{'scenario':<40} {'fault->next step':>17} {'jobs':>5} {'end':>10} {'weights':>8}")
    for r in rows:
        if "effective" in r:
            print(f"{r['scenario']:<40} effective {r['effective']:.1%} ({r['steps_done']} steps in {r['wall_s']} s, "
                  f"{r['kills']} kills)")
            continue
        if r.get("error"):
            print(f"{r['scenario']:<40} {r['error']}")
            continue
        nxt = f"{r['fault_to_next_step_s']:.1f} s" if r.get("fault_to_next_step_s") else "never"
        eq = {True: "equal", False: "DIFFER", None: "-"}[r.get("weights_equal")]
        print(f"{r['scenario']:<40} {nxt:>17} {r['jobs']:>5} {r['state']:>10} {eq:>8}"
              + (f"  ({r['how_it_failed']})" if r.get("how_it_failed") else ""))
    hp = [r for r in rows if r.get("scenario", "").startswith("hpcring kill") and r.get("fault_to_next_step_s")]
    tr = [r for r in rows if r.get("scenario") == "torchrun kill" and r.get("fault_to_next_step_s")]
    if hp and tr:
        print(f"hpcring / torchrun fault-to-next-step: {hp[0]['fault_to_next_step_s'] / tr[0]['fault_to_next_step_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

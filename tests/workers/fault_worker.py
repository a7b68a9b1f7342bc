"""A rank program for fault-injection tests: a few good collectives, then one fault.

Usage: fault_worker.py SCENARIO [VICTIM] [--backend ring|mpi] [--count N]
Scenarios: none, skip (VICTIM skips one allreduce, then sleeps), different (VICTIM calls a
barrier instead), mismatch (VICTIM uses another count), dtype (VICTIM uses float64), kill (VICTIM
SIGKILLs itself inside the collective's time window), sleep (VICTIM sleeps in load_batch), exit
(VICTIM exits normally before the collective), raise (VICTIM raises an exception in its own
code before the collective: a rank that fails and tears down while the others wait), stop
(VICTIM SIGSTOPs itself: a frozen rank, as one stuck in the kernel, in swap or on a hung GPU;
with kill, 0.3 s after it entered the collective, which the others enter only then), never (VICTIM never reaches hpcring.init()),
late (VICTIM sits in its data loader before its very first collective, the one that connects),
cut/slow (no fault here: the test cuts or slows a link while every rank loops over large
allreduces).
Every rank prints `FAULT_WORKER rank=R phase=P t=T` lines (flushed) so tests can time events.
"""
import argparse
import os
import signal
import sys
import threading
import time

import numpy as np

import hpcring


INSIDE = "fault_worker/victim-inside"   # the victim's mark: it is inside the collective, stopping or dying


def say(rank, phase):
    print(f"FAULT_WORKER rank={rank} phase={phase} t={time.time():.3f}", flush=True)


def launcher_rank():
    """This rank's number before init, from whichever launcher started it."""
    for var in ("HPCRING_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    if os.environ.get("LSF_PM_TASKID", "").isdigit():
        return int(os.environ["LSF_PM_TASKID"]) - 1
    return -1


def load_batch(seconds):
    time.sleep(seconds)          # a rank stuck in its data loader


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("victim", type=int, nargs="?", default=-1)
    p.add_argument("--backend", default="ring")
    p.add_argument("--count", type=int, default=1 << 16)
    p.add_argument("--loops", type=int, default=3)
    p.add_argument("--tag", default="", help="ignored: lets a harness find this job's processes")
    a = p.parse_args()
    if a.scenario == "never" and launcher_rank() == a.victim:
        say(a.victim, "fault")
        load_batch(3600)             # stuck before init (a hung import, file system or module load)
    s = hpcring.init()
    if a.scenario == "late" and launcher_rank() == a.victim:
        say(a.victim, "fault")
        load_batch(3600)             # the others' first collective (allreduce#1) waits for it
    comm = s.communicator(a.backend)
    rank = comm.rank
    x = np.ones(a.count, np.float32)
    for _ in range(a.loops):
        comm.allreduce(x)
    say(rank, "warm")
    me = rank == a.victim
    sc = a.scenario
    if sc in ("cut", "slow"):
        say(rank, "looping")
        big = np.ones(1 << 22, np.float32)
        while True:
            comm.allreduce(big)
    if me and sc == "skip":
        say(rank, "fault")
        load_batch(3600)
    elif me and sc == "sleep":
        say(rank, "fault")
        load_batch(3600)
    elif me and sc == "exit":
        say(rank, "fault")
        return 0
    elif me and sc == "raise":
        say(rank, "fault")
        load_batch(0.2)
        raise RuntimeError(f"injected fault: rank {rank} gives up before allreduce#{a.loops + 1}")
    elif me and sc == "different":
        say(rank, "fault")
        comm.barrier()
    elif me and sc == "mismatch":
        say(rank, "fault")
        comm.allreduce(np.ones(a.count // 2, np.float32))
    elif me and sc == "dtype":
        say(rank, "fault")
        comm.allreduce(np.ones(a.count, np.float64))
    elif me and sc in ("stop", "kill"):
        def fault():
            time.sleep(0.3)
            say(rank, "fault")
            s.store.set(INSIDE, b"1")
            os.kill(os.getpid(), signal.SIGSTOP if sc == "stop" else signal.SIGKILL)
        threading.Thread(target=fault, daemon=True).start()
        comm.allreduce(np.ones(1 << 24, np.float32))
    else:
        if sc in ("kill", "stop"):
            # enter the collective only once the victim sits in it and is about to stop or die:
            # with everyone in at once a fast link ends it before the fault (dev cluster, 0.26 s)
            if 0 <= a.victim < comm.size:
                s.store.get(INSIDE, timeout=120)
            comm.allreduce(np.ones(1 << 24, np.float32))
        else:
            comm.allreduce(x)
    say(rank, "after")
    comm.barrier()
    say(rank, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())

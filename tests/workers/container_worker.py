"""A rank program for the container tests (test_container_devcluster.py): proves it runs inside the
CI image, that the fabric's environment, the job folder and the secret file reached it (the secret
never on its command line), then exact collectives; ``--freeze R`` freezes rank R (SIGSTOP) inside
an allreduce, so the hang report must name it.

Prints `CONTAINER_RANK {json}` (flushed) once its checks pass.
"""
import argparse
import json
import os
import signal
import sys

import numpy as np

import hpcring

MARK = "/.hpcring-image-ok"      # written by scripts/build-ci-image.sh; no host has it


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--freeze", type=int, default=-1)
    a = p.parse_args()
    secret_file = os.environ["HPCRING_SECRET_FILE"]
    with open(secret_file) as f:
        secret = f.read().strip()
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace")
    s = hpcring.init()
    comm = s.communicator("ring")
    rank, size = comm.rank, comm.size
    n = 1 << 16
    x = np.arange(n, dtype=np.float64) * (rank + 1)
    got = comm.allreduce(x)
    want = np.arange(n, dtype=np.float64) * (size * (size + 1) // 2)   # integers below 2**53: exact
    gathered = comm.allgather(np.array([rank], dtype=np.int64))
    info = {"rank": rank, "size": size, "in_image": os.path.exists(MARK),
            "host": os.uname().nodename, "exact": bool(np.array_equal(got, want)),
            "allgather": np.asarray(gathered).ravel().tolist(),
            "secret_ok": len(secret) == 64 and secret not in cmdline,
            "secret_file": secret_file,
            "nccl_ifname": os.environ.get("NCCL_SOCKET_IFNAME"),
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "slurm_procid": os.environ.get("SLURM_PROCID"),
            "submitit_folder": os.environ.get("SUBMITIT_FOLDER"), "cwd": os.getcwd()}
    print("CONTAINER_RANK " + json.dumps(info), flush=True)
    if rank == a.freeze:   # every thread stops, its watchdog too: a rank stuck in the kernel or on a hung GPU
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.allreduce(np.ones(1 << 22, np.float32))
    comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The job whose stacks are captured in this folder (local backend, 1 node x 4 ranks):
ranks 0-2 wait in an allreduce that rank 3 never joins, because rank 3 is stuck loading data.

    HPCRING_WATCHDOG=0 hpcring submit tests/data/stacks/train_hang.py --site local -N 1 --tasks-per-node 4
    hpcring stacks JOB --method signal   # faulthandler-*.txt: the appended part of stacks-live-rank<r>.txt
    hpcring stacks JOB --method py-spy   # pyspy-*.txt: py-spy dump --full-filenames
"""
import time

import numpy as np

import hpcring
from hpcring.diagnostics.stacks import install_signal_dump


def load_batch():
    time.sleep(600)
    return np.ones(1024, dtype=np.float32)


def train_step(comm, grads):
    return comm.allreduce(grads, timeout=600)


def main():
    session = hpcring.init()
    install_signal_dump(None, session.rank)
    comm = session.communicator("ring")
    grads = load_batch() if session.rank == 3 else np.ones(1024, dtype=np.float32)
    train_step(comm, grads)


if __name__ == "__main__":
    main()

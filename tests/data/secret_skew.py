"""A short job whose ranks end far apart: rank 0 returns at once, the others later still need the
job's secret (here: a new communicator and a check that the file is still there).

    SKEW_S=2 hpcring submit tests/data/secret_skew.py --nodes 3 --tasks-per-node 2 --wait
"""
import os
import sys
import time

import numpy as np

import hpcring

session = hpcring.init()
rank = session.rank
if rank == 0:
    sys.exit(0)                 # done long before the others: its exit must not end the job's secret
time.sleep(float(os.environ.get("SKEW_S", "2")) * rank / session.size)
path = os.environ["HPCRING_SECRET_FILE"]
if not os.path.exists(path):
    print(f"SKEW rank {rank}: secret file {path} gone while the job runs", flush=True)
    sys.exit(4)
x = np.full(4, rank, dtype=np.int64)
print(f"SKEW rank {rank} ok {int(x.sum())}", flush=True)

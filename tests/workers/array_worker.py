"""One task of an array job (tests/devcluster/test_arrays_devcluster.py): prints what it was given.

``ARRAY_WORKER_SLEEP_TASK=N``: task N sleeps 300 s (to be cancelled); ``ARRAY_WORKER_SLEEP_S``: every
task sleeps that long."""
import json
import os
import sys
import time

task = os.environ.get("HPCRING_ARRAY_TASK")
print("ARRAY " + json.dumps({"task": task, "rank": int(os.environ.get("RANK", "-1")), "args": sys.argv[1:],
                             "host": os.uname().nodename,
                             "lsf_index": os.environ.get("LSB_JOBINDEX")}), flush=True)
if task is not None and task == os.environ.get("ARRAY_WORKER_SLEEP_TASK"):
    time.sleep(300)
time.sleep(float(os.environ.get("ARRAY_WORKER_SLEEP_S") or 0))

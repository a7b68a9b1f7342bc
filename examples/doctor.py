"""`hpcring doctor` as a submitted job: every rank runs this script, rank 0's log has the report.

    hpcring submit examples/doctor.py --site mysite --nodes 4 --tasks-per-node 2 --wait -- --json doctor.json

Arguments after `--` are `hpcring doctor`'s (--timeout, --json, --bw-seconds). The job fails
(exit code 1 on every rank) when a check FAILs.
"""
import sys

from hpcring.cli.main import app

app(["doctor", *sys.argv[1:]], prog_name="hpcring")

"""Every rank says who and where it is: the smallest check that a job's ranks are all there.

    hpcring submit examples/hello.py --nodes 2 --tasks-per-node 2 --wait
"""
import json
import os
import socket
import sys


def my_address(peer: str) -> str:
    """The address this host uses to reach ``peer`` (no packet is sent: UDP connect only routes)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(peer), 9))
            return s.getsockname()[0]
    except OSError:
        return "?"


def main() -> int:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host = os.environ.get("HPCRING_HOSTNAME") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    record = {"rank": rank, "size": size, "local_rank": int(os.environ["LOCAL_RANK"]),
              "host": host, "address": my_address(os.environ["MASTER_ADDR"])}
    print("HELLO " + json.dumps(record, sort_keys=True), flush=True)
    fail_rank = os.environ.get("HELLO_FAIL_RANK")
    if fail_rank is not None and int(fail_rank) == rank:
        print(f"rank {rank}: failing on purpose with exit code 3", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

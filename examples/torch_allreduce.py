"""An unmodified torch.distributed script: gloo backend, init_method="env://".

Runs under `hpcring submit` or `hpcring run` because hpcring exports MASTER_ADDR (rank 0's address
on the verified interface), MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and GLOO_SOCKET_IFNAME.
"""
import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(1000, dtype=torch.float64) + rank
    dist.all_reduce(x)
    expected = world * torch.arange(1000, dtype=torch.float64) + world * (world - 1) / 2
    ok = bool(torch.equal(x, expected))
    print(f"TORCH rank={rank} world={world} ok={ok} iface={os.environ.get('GLOO_SOCKET_IFNAME')} "
          f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

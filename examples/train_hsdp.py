"""Train a small MLP with FSDP2 HSDP on the ``hpcring`` torch.distributed backend (synthetic data).

HSDP (hybrid sharding): ``fully_shard`` on a 2-D DeviceMesh ``(replicate, shard)``; parameters
are sharded over the ``shard`` ranks (all-gather before use, reduce-scatter of gradients) and
replicated over the ``replicate`` ranks (an all-reduce of the gradient shards).

    hpcring run --nodes 1 --tasks-per-node 4 -- python examples/train_hsdp.py --steps 3 --cpu
    hpcring submit examples/train_hsdp.py --site devcluster --nodes 2 --tasks-per-node 2 --wait -- --steps 2 --cpu
    python examples/train_hsdp.py --backend gloo ...                 # compare: gloo, nccl

Mesh: ``--shard N`` ranks per shard group (default: the ranks of one node, so that the frequent
all-gathers stay inside a node; on a single node 2 when the world size is even); the rest
replicate. Rank 0 prints the mean loss over all ranks (gathered, summed in rank order: the same
digits on any backend with the same weights).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="hpcring", help="hpcring (default), gloo or nccl")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--shard", type=int, default=0, help="ranks per shard group (default: see above)")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when a GPU is visible")
    args = p.parse_args()

    if args.backend == "hpcring" and "hpcring" not in dist.Backend.backend_list:
        import hpcring.distributed  # noqa: F401  (registers the backend; hpcring submit did already)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(args.backend)    # RANK, WORLD_SIZE, MASTER_ADDR: exported by hpcring
    rank, size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available() and not args.cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    shard = args.shard or (local if 1 < local < size and size % local == 0 else 2 if size % 2 == 0 else 1)
    if size % shard:
        p.error(f"--shard {shard} does not divide the {size} ranks")
    mesh = init_device_mesh(device.type, (size // shard, shard), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)                      # same initial weights everywhere
    w = args.width
    model = nn.Sequential(nn.Linear(64, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)     # each layer its own all-gather / reduce-scatter
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + rank)   # each rank its own shard of the synthetic data
    data = [(torch.randn(args.batch, 64, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen))
            for _ in range(8)]
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"{size} ranks as {tuple(mesh.mesh.shape)} (replicate, shard), backend {dist.get_backend()}, "
              f"device {device}, {n} parameters", flush=True)

    losses = torch.empty(size, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # torch >= 2.13's name
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in data[step % len(data)])
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if args.steps <= 20 or step % 10 == 0 or step == args.steps - 1:
            gather(losses, loss.detach().reshape(1))
            if rank == 0:
                print(f"step {step:4d} loss {losses.cpu().double().sum().item() / size:.8f}", flush=True)
    took = time.perf_counter() - t0
    if rank == 0:
        print(f"{args.steps} steps in {took:.2f} s ({took / max(1, args.steps) * 1e3:.1f} ms/step)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

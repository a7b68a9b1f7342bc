"""A Horovod-style PyTorch training script on hpcring: only the import differs from Horovod.

    hpcring run --nodes 1 --tasks-per-node 2 -- python examples/train_horovod.py
    hpcring submit --site devcluster --nodes 2 --timeline examples/train_horovod.py -- --epochs 2
    hpcring timeline <job id>           # one Chrome trace, one track per rank

Synthetic data (a noisy linear classification task), so it runs anywhere without downloads.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import hpcring.torch as hvd          # instead of: import horovod.torch as hvd

ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--batch-size", type=int, default=32)
ap.add_argument("--lr", type=float, default=0.05)
ap.add_argument("--fp16-allreduce", action="store_true")
args = ap.parse_args()

hvd.init()
torch.manual_seed(0)
device = "cpu"
if torch.cuda.is_available():
    torch.cuda.set_device(hvd.local_rank())          # pin one GPU per local rank
    device = "cuda"

# the data: every rank builds the same set and reads its own shard
g = torch.Generator().manual_seed(42)
x = torch.randn(4096, 20, generator=g)
y = (x @ torch.randn(20, generator=g) > 0).long()
dataset = torch.utils.data.TensorDataset(x, y)
sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Linear(20, 64), hvd.SyncBatchNorm(64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 2)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)   # scale lr by size
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    model.train()
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        acc = (model(x.to(device)).argmax(1) == y.to(device)).float().mean()
    acc = hvd.allreduce(acc, name="accuracy")          # averaged over ranks
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}, accuracy {acc.item():.3f} ({hvd.size()} ranks)", flush=True)

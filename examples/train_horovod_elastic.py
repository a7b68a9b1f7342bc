"""Horovod Elastic on hpcring: training goes on when a worker dies, and takes in one that joins.

    python -m hpcring.elastic.driver --np 3 --min-np 2 --max-np 4 -- python examples/train_horovod_elastic.py

Kill one worker (``kill -9`` the pid it prints): the others raise HorovodInternalError, restore the
last commit, meet in a new round of 2 and go on (the sampler deals the rest of the epoch over
them). Start one more (the driver's ``--info FILE`` has its variables) and the others reset at
their next commit and hand it the committed state. As with Horovod, no collective runs before
``train(state)``: a joining worker's first collectives are the state's sync.

Synthetic data (a noisy linear classification task), so it runs anywhere without downloads.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

import hpcring.torch as hvd          # instead of: import horovod.torch as hvd

ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--batch-size", type=int, default=32)
ap.add_argument("--lr", type=float, default=0.05)
ap.add_argument("--commit-every", type=int, default=4, help="batches between commits")
ap.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per batch (to watch it)")
ap.add_argument("--samples", type=int, default=2048)
args = ap.parse_args()

hvd.init()
torch.manual_seed(0)
print(f"worker {os.environ.get('HPCRING_ELASTIC_ID', '?')} pid {os.getpid()}: rank {hvd.rank()} of {hvd.size()}",
      flush=True)

g = torch.Generator().manual_seed(42)
x = torch.randn(args.samples, 20, generator=g)
y = (x @ torch.randn(20, generator=g) > 0).long()
dataset = torch.utils.data.TensorDataset(x, y)
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def on_reset() -> None:
    """After a worker left or joined: the learning rate follows the number of workers."""
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()
    if hvd.rank() == 0:
        print(f"reset: now {hvd.size()} workers", flush=True)


@hvd.elastic.run
def train(state) -> None:
    while state.epoch < args.epochs:
        model.train()
        for batch_idx, (data, target) in enumerate(loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            state.sampler.record_batch(batch_idx, args.batch_size)
            state.batch += 1
            if state.batch % args.commit_every == 0:
                state.commit()                 # may raise HostsUpdatedInterrupt: a worker waits to join
            time.sleep(args.pace)
        with torch.no_grad():
            acc = hvd.allreduce((model(x).argmax(1) == y).float().mean(), name="accuracy")
        if hvd.rank() == 0:
            print(f"epoch {state.epoch}: accuracy {acc.item():.3f} on {hvd.size()} workers", flush=True)
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)   # at the end of the epoch: the next one starts afresh
        state.commit()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
state.register_reset_callbacks([on_reset])
train(state)

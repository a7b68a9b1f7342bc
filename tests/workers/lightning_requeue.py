"""Lightning's SLURM auto-requeue under `hpcring submit` (one rank per node, CPU).

    hpcring submit tests/workers/lightning_requeue.py --site devcluster --nodes 2 --sched-arg=--signal=USR1@90 -- OUT

Lightning's own mechanism: on SIGUSR1 every rank saves the HPC checkpoint (OUT/hpc_ckpt_N.ckpt)
and rank 0 runs `scontrol requeue`; the restarted job resumes from it by itself. Each rank prints
its start step; rank 0 writes OUT/result.json at the end.

One change, and why: Lightning runs its handler (save_checkpoint, with a barrier) wherever the
signal lands on each rank, and srun hands a forwarded signal to the ranks milliseconds apart, so
now and then a collective falls between them and one rank's barrier meets another's broadcast
(hpcring reports it as a mismatched collective; gloo and NCCL would pair them silently; seen once
in CI). So the handler runs at a step every rank agrees on: the signal only sets a flag, and an
all_reduce(MAX) of the flag in training_step calls Lightning's own handler on every rank at once
(docs/preemption.md).
"""
import json
import os
import signal
import sys
import time

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy

STEPS = 60


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 2)
        self.lightning_handler = None   # Lightning's SIGUSR1 handler, run at an agreed step
        self.signalled = False
        self.handled = False

    def training_step(self, batch, _idx):
        time.sleep(0.25)            # long enough for the test to signal mid-run
        if self.lightning_handler is not None and not self.handled:
            flag = torch.tensor([int(self.signalled)])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if flag.item():         # some rank has the signal: every rank runs the handler now
                self.handled = True
                self.lightning_handler(signal.SIGUSR1, None)
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_start(self):
        handler = signal.getsignal(signal.SIGUSR1)      # registered by fit() before this hook
        if callable(handler):
            self.lightning_handler = handler
            signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "signalled", True))
        print(f"LREQ rank={self.global_rank} start step={self.global_step} "
              f"restarts={os.environ.get('SLURM_RESTART_COUNT', '0')}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    out = sys.argv[1]
    size = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
    torch.manual_seed(0)
    model = Tiny()
    trainer = L.Trainer(strategy=DDPStrategy(process_group_backend="hpcring"), accelerator="cpu", devices=1,
                        num_nodes=size, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    if trainer.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"steps": trainer.global_step, "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}, f)
    print(f"LREQ rank={trainer.global_rank} done step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()

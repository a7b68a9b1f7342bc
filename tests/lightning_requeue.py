"""Lightning's SLURM auto-requeue under `hpcring submit` (one rank per node, CPU).

    hpcring submit tests/lightning_requeue.py --site devcluster --nodes 2 --sched-arg=--signal=USR1@90 -- OUT

Lightning's own mechanism, untouched: on SIGUSR1 every rank saves the HPC checkpoint
(OUT/hpc_ckpt_N.ckpt) and rank 0 runs `scontrol requeue`; the restarted job resumes from it by
itself. Each rank prints its start step; rank 0 writes OUT/result.json at the end.
"""
import json
import os
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

    def training_step(self, batch, _idx):
        time.sleep(0.25)            # long enough for the test to signal mid-run
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_start(self):
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

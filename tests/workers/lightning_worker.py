"""One rank of Lightning's Trainer(strategy=DDPStrategy(process_group_backend="hpcring")) on CPU,
started by `hpcring run` (which exports RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT). Prints
'lightning OK backend=hpcring ...' when the trained weights agree on every rank (the data differ)."""
import os

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy

import hpcring.distributed  # noqa: F401  (registers "hpcring")


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, _idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    size, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g))
    torch.manual_seed(0)
    model = Tiny()
    trainer = L.Trainer(strategy=DDPStrategy(process_group_backend="hpcring"), accelerator="cpu", devices=local,
                        num_nodes=size // local, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    # use_distributed_sampler=True (default) would shard one dataset; each rank has its own here anyway
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], w) for w in everyone), "weights differ between ranks"
    print(f"lightning OK backend={dist.get_backend()} rank={dist.get_rank()} steps={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()

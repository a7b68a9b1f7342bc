"""``hvd.elastic.ElasticSampler``: a DistributedSampler that carries the epoch's progress over resets.

Within an epoch the permutation is fixed (``seed + epoch``); the sampler counts the samples the
job as a whole has processed (``record_batch`` adds batch_size x ranks) and, after a reset,
deals out only the rest of the permutation over the new ranks. So as long as every rank calls
``record_batch`` once per batch and the count is committed with the model (TorchState keeps the
sampler), no sample is seen twice or skipped within the epoch when the world shrinks or grows,
apart from the padding a DistributedSampler adds to make the last share even. Call
``set_epoch(e + 1)`` at the *end* of epoch ``e``: it clears the count.
"""
from __future__ import annotations

import math
import random

import torch.utils.data
import hpcring.torch as hvd


class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()        # Horovod keeps the attribute; the count is what counts
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new permutation, nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank processed a batch of ``batch_size``."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Deal what is left of this epoch's permutation over the current ranks."""
        self.num_replicas, self.rank = hvd.size(), hvd.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = list(self.remaining_indices)
        pad = self.total_size - len(indices)
        if pad > 0:                             # as DistributedSampler: repeat from the start
            indices += (indices * math.ceil(pad / max(1, len(indices))))[:pad]
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples

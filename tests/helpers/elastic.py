"""What the elastic tests share (tests/integration/test_horovod_elastic.py, test_elastic_devcluster.py):
the worker program, its job's sizes, its logs, and :func:`simulate`, the weights Horovod's
committed-state semantics give for the rounds a job ran (written from Horovod's documented
semantics, not from hpcring's code)."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "horovod_elastic_worker.py")
N, BATCH, EPOCHS, COMMIT = 48, 2, 2, 2


def logs_of(folder: Path) -> dict[str, list[dict]]:
    return {f.stem: [json.loads(x) for x in f.read_text().splitlines() if x.endswith("}")]
            for f in sorted(folder.glob("*.jsonl"))}


def kinds(recs: list[dict], kind: str, **match) -> list[dict]:
    return [r for r in recs if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())]


def features(n: int):
    i = torch.arange(n, dtype=torch.float64)
    return torch.stack([i % 7 - 3, i % 5 - 2, i % 3 - 1, torch.ones(n, dtype=torch.float64)], dim=1)


def _at(pos: tuple[int, int]) -> tuple[int, int]:
    """A position at an epoch's end is the next epoch's start: a round that resumes from a commit
    made after an epoch's last step (a late joiner) has nothing left of that epoch."""
    return (pos[0] + 1, 0) if pos[1] >= N else pos


def simulate(schedule: list[tuple[int, tuple[int, int]]], seed: int = 3) -> list[float]:
    """The weights a job must end with: ``schedule`` lists each round's size and the position
    (epoch, samples processed in it) it resumed from; a round runs until the next one's position.
    Written from Horovod's documented semantics, not from hpcring's code."""
    feats = features(N)
    w = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.25, momentum=0.5)
    pos = (0, 0)
    for k, (size, start) in enumerate(schedule):
        assert pos == _at(start), (pos, start)
        end = _at(schedule[k + 1][1]) if k + 1 < len(schedule) else (EPOCHS, 0)
        while pos < end:
            epoch, done = pos
            order = list(range(N))
            random.Random(seed + epoch).shuffle(order)
            rest = order[done:]
            per = math.ceil(len(rest) / size)
            padded = rest + rest[:per * size - len(rest)]
            shares = [padded[r:per * size:size] for r in range(size)]
            for j in range(math.ceil(per / BATCH)):
                if pos >= end:
                    break
                idx = [i for s in shares for i in s[j * BATCH:(j + 1) * BATCH]]
                opt.zero_grad()
                (feats[idx] @ w.t()).sum().backward()
                opt.step()
                pos = (epoch, pos[1] + BATCH * size)
            else:
                pos = (epoch + 1, 0)
    return w.detach().flatten().tolist()


def rounds_of(recs: dict[str, list[dict]]) -> dict[int, dict]:
    """round -> {size, members (wid by rank), synced position, synced weights}, checked to agree."""
    out: dict[int, dict] = {}
    for wid, rs in recs.items():
        for r in kinds(rs, "synced"):
            pos = (r["epoch"], r["processed"])
            o = out.setdefault(r["round"], {"size": r["size"], "members": {}, "pos": pos, "w": r["w"], "t": r["t"]})
            assert (o["size"], o["pos"], o["w"]) == (r["size"], pos, r["w"]), f"ranks disagree after the sync: {o} {r}"
            o["members"][r["rank"]] = wid
            o["t"] = min(o["t"], r["t"])
    return dict(sorted(out.items()))


def counted_samples(recs: dict[str, list[dict]], rounds: dict[int, dict]) -> dict[int, list[int]]:
    """Per epoch, the samples of every step that was not rolled back: a step of round r counts when
    its position is before the position round r + 1 resumed from."""
    per_epoch: dict[int, list[int]] = {}
    for rs in recs.values():
        for s in kinds(rs, "step"):
            nxt = rounds.get(s["round"] + 1)
            if nxt is None or (s["epoch"], s["processed"]) < nxt["pos"]:
                per_epoch.setdefault(s["epoch"], []).extend(s["idx"])
    return per_epoch

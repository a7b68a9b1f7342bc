"""One rank of a torch.distributed job using point-to-point on the ``hpcring`` backend (started by
``hpcring run`` or mpirun); every result is compared with the same calls on gloo.

    python tests/workers/torch_p2p_worker.py p2p         send/recv, isend/irecv, batch_isend_irecv in any
                                                 order, recv from any source, tags out of order,
                                                 every dtype, 0-dim / empty / non-contiguous
                                                 tensors, point-to-point inside a subgroup
    python tests/workers/torch_p2p_worker.py pipeline    torch.distributed.pipelining: GPipe and 1F1B over
                                                 all ranks as stages; loss and gradients equal gloo
    python tests/workers/torch_p2p_worker.py hang R W    rank R never sends what rank R+1 receives (W: world,
                                                 or group: the pair as a subgroup)
"""
from __future__ import annotations

import copy
import sys
import time

import torch
import torch.distributed as dist

from hpcring.distributed import init_process_group

init_process_group("cpu:hpcring,cuda:hpcring")
RANK, SIZE = dist.get_rank(), dist.get_world_size()
GLOO = dist.new_group(backend="gloo")


def exchange(group, tensor_of):
    """The calls whose results are compared: returns every received tensor, in order."""
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = []
    # blocking send/recv, even ranks first (no deadlock on any backend)
    x = tensor_of(RANK)
    y = torch.empty_like(x)
    if RANK % 2 == 0:
        dist.send(x, nxt, group=group)
        dist.recv(y, prv, group=group)
    else:
        dist.recv(y, prv, group=group)
        dist.send(x, nxt, group=group)
    got.append(y)
    # isend/irecv, the receive posted first
    y2 = torch.empty_like(x)
    r = dist.irecv(y2, prv, group=group, tag=5)
    s = dist.isend(tensor_of(RANK + 10), nxt, group=group, tag=5)
    r.wait()
    s.wait()
    got.append(y2)
    # a batch whose sends come after its receives, both directions at once
    a, b = torch.empty_like(x), torch.empty_like(x)
    ops = [dist.P2POp(dist.irecv, a, prv, group, 1), dist.P2POp(dist.irecv, b, nxt, group, 2),
           dist.P2POp(dist.isend, tensor_of(RANK + 20), nxt, group, 1),
           dist.P2POp(dist.isend, tensor_of(RANK + 30), prv, group, 2)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    got += [a, b]
    # tags out of order: two messages to the same peer, received in the other order
    c1, c2 = torch.empty_like(x), torch.empty_like(x)
    s1 = dist.isend(tensor_of(RANK + 40), nxt, group=group, tag=11)
    s2 = dist.isend(tensor_of(RANK + 50), nxt, group=group, tag=12)
    dist.recv(c2, prv, group=group, tag=12)
    dist.recv(c1, prv, group=group, tag=11)
    s1.wait()
    s2.wait()
    got += [c1, c2]
    return got


def tensors():
    """(name, tensor_of(seed)) for every dtype and shape the comparison covers."""
    def f(dtype, shape=(3, 5)):
        def make(seed):
            g = torch.Generator().manual_seed(seed)
            t = torch.randn(shape, generator=g) * 50
            if dtype == torch.bool:
                return t > 0
            if dtype.is_complex:
                return torch.complex(t, -t).to(dtype)
            return t.to(dtype)
        return make
    out = [(str(d).replace("torch.", ""), f(d)) for d in
           (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
            torch.int8, torch.uint8, torch.bool, torch.complex64)]
    out.append(("0-dim int16", f(torch.int16, ())))
    out.append(("empty", f(torch.float32, (0, 4))))
    out.append(("large", f(torch.float32, (1 << 20,))))
    return out


def mode_p2p() -> None:
    n = 0
    for name, make in tensors():
        mine = exchange(None, make)
        ref = exchange(GLOO, make)
        for i, (p, q) in enumerate(zip(mine, ref)):
            assert p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q), f"{name} #{i}: {p} != {q}"
            n += 1
    # a non-contiguous destination and source
    src = torch.arange(24, dtype=torch.float32).reshape(4, 6) + RANK
    dst = torch.zeros(6, 4).t()
    assert not dst.is_contiguous()
    reqs = [dist.isend(src[:, ::2], (RANK + 1) % SIZE), dist.irecv(dst[:, :3], (RANK - 1) % SIZE)]
    for w in reqs:
        w.wait()
    prev = (RANK - 1) % SIZE
    assert torch.equal(dst[:, :3], (torch.arange(24, dtype=torch.float32).reshape(4, 6) + prev)[:, ::2]), dst
    n += 1
    # recv from any source: rank 0 hears from everybody, in any order; torch returns the sender
    if RANK == 0:
        seen = set()
        for _ in range(SIZE - 1):
            buf = torch.empty(2, dtype=torch.int64)
            src_rank = dist.recv(buf, tag=9)
            assert buf.tolist() == [src_rank, src_rank * 7], (src_rank, buf)
            seen.add(src_rank)
        assert seen == set(range(1, SIZE)), seen
    else:
        dist.send(torch.tensor([RANK, RANK * 7]), 0, tag=9)
    n += 1
    # inside a subgroup of the odd ranks (and the evens): group ranks, global peers
    for members in ([r for r in range(SIZE) if r % 2], [r for r in range(SIZE) if not r % 2]):
        hp, gl = dist.new_group(members), dist.new_group(members, backend="gloo")
        if RANK in members and len(members) > 1:
            i = members.index(RANK)
            res = []
            for grp in (hp, gl):
                x = torch.full((4,), float(RANK))
                y = torch.empty(4)
                w = [dist.isend(x, group=grp, group_dst=(i + 1) % len(members)),
                     dist.irecv(y, group=grp, group_src=(i - 1) % len(members))]
                for q in w:
                    q.wait()
                res.append(y)
            assert torch.equal(res[0], res[1]) and res[0][0] == members[(i - 1) % len(members)], res
            n += 1
    dist.barrier()
    print(f"rank {RANK}: p2p OK ({n} results equal to gloo) on {backend_of()}", flush=True)


def backend_of() -> str:
    comms = getattr(dist.distributed_c10d._get_default_group(), "_comms", {})
    return ",".join(sorted({c.backend.name for c in comms.values()})) or "?"


def mode_pipeline() -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    width, micro, batches = 16, 4, 8
    full = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(SIZE)])
    x = torch.randn(batches, width)
    target = torch.randn(batches, width)

    def run(group, schedule_cls):
        stage_mod = copy.deepcopy(full[RANK])
        stage = PipelineStage(stage_mod, RANK, SIZE, torch.device("cpu"), group=group)
        losses = []
        sched = schedule_cls(stage, n_microbatches=micro, loss_fn=torch.nn.functional.mse_loss)
        if RANK == 0:
            sched.step(x)
        elif RANK == SIZE - 1:
            sched.step(target=target, losses=losses)
        else:
            sched.step()
        grads = [p.grad.clone() for p in stage_mod.parameters()]
        return losses, grads

    n = 0
    for cls in (ScheduleGPipe, Schedule1F1B):
        mine, ref = run(None, cls), run(GLOO, cls)
        assert len(mine[0]) == len(ref[0]) and all(torch.equal(a, b) for a, b in zip(mine[0], ref[0])), (mine[0], ref[0])
        assert all(torch.equal(a, b) for a, b in zip(mine[1], ref[1])), cls.__name__
        n += len(mine[1]) + len(mine[0])
    print(f"rank {RANK}: pipeline OK ({n} results equal to gloo) on {backend_of()}", flush=True)


def mode_hang(victim: int, where: str) -> None:
    """The receiver waits for a 4 MiB message that ``victim`` never sends; ``where``: "world", or
    "group" (the pair as a subgroup: the report must still name global ranks)."""
    receiver = (victim + 1) % SIZE
    group = dist.new_group([min(victim, receiver), max(victim, receiver)]) if where == "group" else None
    dist.barrier()
    if group is not None and RANK in (victim, receiver):
        dist.barrier(group=group)    # both members made the group (on MPI that is collective)
    if RANK == receiver:
        buf = torch.empty(1 << 20)   # 4 MiB
        print(f"FAULT recv at {time.time()}", flush=True)
        if group is None:
            dist.recv(buf, victim, tag=7)
        else:
            dist.recv(buf, group=group, group_src=dist.get_group_rank(group, victim), tag=7)
        print("hang finished", flush=True)
    time.sleep(3600)                 # the victim never sends; the others idle


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "p2p":
        mode_p2p()
    elif mode == "pipeline":
        mode_pipeline()
    elif mode == "hang":
        mode_hang(int(sys.argv[2]), sys.argv[3])
    dist.destroy_process_group()

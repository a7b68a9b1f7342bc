"""One rank of a torch.distributed job on the ``hpcring`` backend (started by ``hpcring run``).

    python tests/workers/torch_worker.py MODE [ARG]

Modes (each prints one 'MODE OK ...' line on success; a failed check raises):
  ops       every op x several dtypes on hpcring == the same op on gloo (or the exact value)
  ddp       DDP on hpcring, DDP on gloo with hpcring's comm hook == DDP on gloo, a few steps
  fsdp      FSDP FULL_SHARD (CPU) on hpcring == on gloo
  fsdp2     fully_shard (FSDP2) on hpcring == on gloo
  bad       bad calls raise clear errors at once, and the group still works afterwards
  skip R    DDP on hpcring where rank R gets stuck in load_batch at step 2 (a hang)
  kill R    DDP on hpcring where rank R is SIGKILLed between steps
The default group is ``cpu:hpcring,cuda:hpcring`` (set TORCH_WORKER_BACKEND to change it); gloo
runs as a second group over the same ranks.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from hpcring.errors import UsageError

PRE_REGISTERED = "hpcring" in dist.Backend.backend_list     # by hpcring submit, before this script ran
if not PRE_REGISTERED:
    import hpcring.distributed  # noqa: F401  (registers "hpcring")

if os.environ.get("TORCH_WORKER_INIT") == "hpcring":     # plain mpirun/srun: no torch env:// variables
    from hpcring.distributed import init_process_group
    init_process_group(os.environ.get("TORCH_WORKER_BACKEND", "cpu:hpcring,cuda:hpcring"))
else:
    dist.init_process_group(os.environ.get("TORCH_WORKER_BACKEND", "cpu:hpcring,cuda:hpcring"))
RANK, SIZE = dist.get_rank(), dist.get_world_size()
HP = dist.group.WORLD
GLOO = dist.new_group(backend="gloo")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.uint8)


def inputs(dtype, n=10, rank=RANK):
    base = torch.arange(n, dtype=torch.float64) % 7 + 1 + rank
    if dtype.is_floating_point:
        base = base / 4
    return base.to(dtype)


def same(a, b, what):
    if a.dtype.is_floating_point:
        ok = torch.allclose(a.double(), b.double(), rtol=1e-2 if a.dtype == torch.bfloat16 else 1e-6)
    else:
        ok = torch.equal(a, b)
    if not ok:
        raise AssertionError(f"rank {RANK}: {what}: hpcring {a} != reference {b}")


def both(fn, what):
    """fn(group) -> tensor(s); run on hpcring and gloo and compare."""
    a, b = fn(HP), fn(GLOO)
    for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
        same(x, y, what)


def mode_ops():
    checks = 0
    R = dist.ReduceOp
    for dt in DTYPES:
        ops = [R.SUM, R.MAX, R.MIN] + ([R.PRODUCT] if dt != torch.uint8 else [])
        for op in ops:
            def ar(g, op=op):
                t = inputs(dt)
                dist.all_reduce(t, op=op, group=g)
                return t
            both(ar, f"all_reduce {dt} {op}"); checks += 1
        if dt.is_floating_point:      # gloo has no AVG: compare with SUM / SIZE
            t = inputs(dt)
            dist.all_reduce(t, op=R.AVG, group=HP)
            s = inputs(dt)
            dist.all_reduce(s, group=GLOO)
            same(t, (s.double() / SIZE).to(dt), f"all_reduce {dt} AVG"); checks += 1

        def ag(g):
            out = [torch.empty(10, dtype=dt) for _ in range(SIZE)]
            dist.all_gather(out, inputs(dt), group=g)
            return out
        both(ag, f"all_gather {dt}"); checks += 1

        def agt(g):
            out = torch.empty(SIZE * 10, dtype=dt)
            dist.all_gather_into_tensor(out, inputs(dt), group=g)
            return out
        both(agt, f"all_gather_into_tensor {dt}"); checks += 1

        def bc(g):
            t = inputs(dt)
            dist.broadcast(t, SIZE - 1, group=g)
            return t
        both(bc, f"broadcast {dt}"); checks += 1

        def rst(g):
            out = torch.empty(4, dtype=dt)
            dist.reduce_scatter_tensor(out, inputs(dt, 4 * SIZE), group=g)
            return out
        both(rst, f"reduce_scatter_tensor {dt}"); checks += 1

        def rs(g):
            out = torch.empty(4, dtype=dt)
            dist.reduce_scatter(out, list(inputs(dt, 4 * SIZE).chunk(SIZE)), group=g)
            return out
        if dt not in (torch.bfloat16,):    # gloo's list reduce_scatter lacks bfloat16
            both(rs, f"reduce_scatter {dt}"); checks += 1

        def a2a(g):
            out = torch.empty(3 * SIZE, dtype=dt)
            dist.all_to_all_single(out, inputs(dt, 3 * SIZE), group=g)
            return out
        both(a2a, f"all_to_all_single {dt}"); checks += 1

        def a2a_uneven(g):  # rank r sends j+1 rows to rank j and so receives r+1 from each
            ins = inputs(dt, sum(j + 1 for j in range(SIZE)))
            out = torch.empty((RANK + 1) * SIZE, dtype=dt)
            dist.all_to_all_single(out, ins, [RANK + 1] * SIZE, [j + 1 for j in range(SIZE)], group=g)
            return out
        both(a2a_uneven, f"all_to_all_single uneven {dt}"); checks += 1

        def a2a_list(g):
            outs = [torch.empty(2, dtype=dt) for _ in range(SIZE)]
            dist.all_to_all(outs, list(inputs(dt, 2 * SIZE).chunk(SIZE)), group=g)
            return outs
        both(a2a_list, f"all_to_all {dt}"); checks += 1

        def red(g):
            t = inputs(dt)
            dist.reduce(t, 0, group=g)
            return t if RANK == 0 else inputs(dt)   # non-roots: unspecified by torch
        both(red, f"reduce {dt}"); checks += 1

        def ga(g):
            out = [torch.empty(10, dtype=dt) for _ in range(SIZE)] if RANK == 0 else None
            dist.gather(inputs(dt), out, dst=0, group=g)
            return out if RANK == 0 else [inputs(dt)]
        both(ga, f"gather {dt}"); checks += 1

        def sc(g):
            out = torch.empty(5, dtype=dt)
            dist.scatter(out, list(inputs(dt, 5 * SIZE).chunk(SIZE)) if RANK == 0 else None, src=0, group=g)
            return out
        both(sc, f"scatter {dt}"); checks += 1
    # data-moving ops take any dtype (as bytes)
    for dt in (torch.bool, torch.int8, torch.int16, torch.complex64):
        def ag_any(g, dt=dt):
            out = [torch.empty(6, dtype=dt) for _ in range(SIZE)]
            dist.all_gather(out, (torch.arange(6) + RANK).to(dt), group=g)
            return out
        a, b = ag_any(HP), [(torch.arange(6) + r).to(dt) for r in range(SIZE)]
        for x, y in zip(a, b):
            assert torch.equal(x, y), (dt, x, y)
        t = (torch.arange(6) + RANK).to(dt)
        dist.broadcast(t, 0, group=HP)
        assert torch.equal(t, torch.arange(6).to(dt)), (dt, t)
        checks += 2
    # coalesced, non-contiguous, async futures
    ts = [inputs(torch.float32, 5), inputs(torch.float32, 3)]
    refs = [t.clone() for t in ts]
    dist.all_reduce_coalesced(ts, group=HP)
    for t, r in zip(ts, refs):
        dist.all_reduce(r, group=GLOO)
        same(t, r, "all_reduce_coalesced")
    m = inputs(torch.float32, 12).view(3, 4).t()            # non-contiguous in place
    ref = m.clone()
    dist.all_reduce(m, group=HP)
    dist.all_reduce(ref, group=GLOO)
    same(m, ref, "all_reduce non-contiguous")
    t = inputs(torch.float32)
    fut = dist.all_reduce(t, group=HP, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2).wait()
    same(chained, sum(inputs(torch.float32, rank=r) for r in range(SIZE)) * 2, "future.then")
    dist.barrier(group=HP)
    objs = [None] * SIZE                                     # pickled objects: uint8 + int64 tensors
    dist.all_gather_object(objs, {"rank": RANK, "name": f"r{RANK}"}, group=HP)
    assert objs == [{"rank": r, "name": f"r{r}"} for r in range(SIZE)], objs
    box = [("from", RANK)]
    dist.broadcast_object_list(box, src=SIZE - 1, group=HP)
    assert box == [("from", SIZE - 1)], box
    checks += 6
    print(f"ops OK {checks} checks on {SIZE} ranks", flush=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def load_batch():
    """A data loader that never returns (the hang)."""
    time.sleep(3600)


def train(wrap, steps=4, skip=None):
    torch.manual_seed(0)
    model = wrap(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + RANK)        # different data per rank
    for step in range(steps):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        if skip is not None and step == 2 and RANK == skip[0]:
            print(f"FAULT {skip[1]} at {time.time():.3f}", flush=True)
            if skip[1] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            load_batch()                                  # stuck: the others wait in the step's allreduce
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def mode_ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hpcring.distributed import allreduce_hook
    ref = train(lambda m: DDP(m, process_group=GLOO))
    ours = train(lambda m: DDP(m, process_group=HP))

    def hooked(m):
        d = DDP(m, process_group=GLOO)
        d.register_comm_hook(None, allreduce_hook)
        return d
    hook = train(hooked)
    # bucket views as gradients + the unused-parameter map (an extra int allreduce per step)
    views = train(lambda m: DDP(m, process_group=HP, gradient_as_bucket_view=True, find_unused_parameters=True))
    diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    diff_hook = max((a - b).abs().max().item() for a, b in zip(hook, ref))
    diff_views = max((a - b).abs().max().item() for a, b in zip(views, ref))
    assert diff < 1e-5 and diff_hook < 1e-5 and diff_views < 1e-5, (diff, diff_hook, diff_views)
    print(f"ddp OK on {SIZE} ranks: max |hpcring - gloo| = {diff:.3g}, comm hook {diff_hook:.3g}; "
          f"hpcring collectives on {HP._comm_for('cpu').backend.name}; "
          f"registered before the script: {PRE_REGISTERED}", flush=True)


def mode_fsdp():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    def full(pg):
        def wrap(m):
            return FSDP(m, process_group=pg, sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"),
                        use_orig_params=True)
        return wrap

    ref = _fsdp_full_params(full(GLOO))
    ours = _fsdp_full_params(full(HP))
    diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    assert diff < 1e-5, diff
    print(f"fsdp OK on {SIZE} ranks: max |hpcring - gloo| = {diff:.3g}", flush=True)


def mode_fsdp2():
    """fully_shard (FSDP2: DTensor parameters, all_gather_into_tensor / reduce_scatter_tensor)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def run(group):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(RANK)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
            opt.step()
        return [p.full_tensor() for p in model.parameters()]
    ref, ours = run(GLOO), run(HP)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    assert diff < 1e-5, diff
    print(f"fsdp2 OK on {SIZE} ranks: max |hpcring - gloo| = {diff:.3g}", flush=True)


def _fsdp_full_params(wrap):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    model = wrap(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + RANK)
    for _ in range(4):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


def expect_usage(fn, *words):
    """hpcring's UsageError (it crosses torch's C++ layer unchanged) containing ``words``."""
    try:
        fn()
    except UsageError as e:
        text = str(e)
        assert all(w in text for w in words), (words, text)
        return
    raise AssertionError(f"no error for {words}")


def mode_bad():
    R = dist.ReduceOp
    expect_usage(lambda: dist.all_reduce(torch.ones(4), op=R.BAND, group=HP), "BAND", "needs an integer or bool")
    expect_usage(lambda: dist.all_reduce(torch.ones(4), op=R.BXOR, group=HP), "BXOR")
    expect_usage(lambda: dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0), group=HP)
                 if hasattr(dist, "_make_nccl_premul_sum") else (_ for _ in ()).throw(UsageError("PREMUL_SUM")),
                 "PREMUL_SUM")
    expect_usage(lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint16), group=HP), "cannot reduce", "uint16")
    expect_usage(lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool), op=R.AVG, group=HP), "AVG", "bool")
    expect_usage(lambda: dist.all_gather([torch.empty(4)] * (SIZE + 1), torch.ones(4), group=HP),
                 f"list of {SIZE} tensors")
    expect_usage(lambda: dist.all_gather([torch.empty(3)] * SIZE, torch.ones(4), group=HP), "tensor 0 of the list")
    expect_usage(lambda: dist.all_gather_into_tensor(torch.empty(4 * SIZE, dtype=torch.float64), torch.ones(4),
                                                     group=HP), "dtypes differ")
    expect_usage(lambda: dist.reduce_scatter_tensor(torch.empty(5), torch.ones(4 * SIZE), group=HP), "elements")
    expect_usage(lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), [1] * (SIZE + 1), group=HP),
                 "split_sizes")
    expect_usage(lambda: dist.all_reduce(torch.ones(4, device="meta"), group=HP), "meta")
    expect_usage(lambda: dist.all_reduce(torch.ones(4).to_sparse(), group=HP), "dense")
    if SIZE > 1:
        peer = (RANK + 1) % SIZE
        expect_usage(lambda: dist.send(torch.ones(2), peer, group=HP, tag=-1), "isend", "tag must be")
        expect_usage(lambda: dist.recv(torch.ones(2, device="meta"), peer, group=HP), "meta")
    t = torch.ones(4)
    dist.all_reduce(t, group=HP)               # the group still works
    assert torch.equal(t, torch.full((4,), float(SIZE))), t
    print("bad OK", flush=True)


def mode_hang(rank: int, how: str):
    from torch.nn.parallel import DistributedDataParallel as DDP
    train(lambda m: DDP(m, process_group=HP), steps=50, skip=(rank, how))
    print("hang: training finished (unexpected)", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    for m in mode.split(","):
        if m in ("skip", "kill"):
            mode_hang(int(sys.argv[2]), m)
        else:
            globals()[f"mode_{m}"]()
    dist.destroy_process_group()

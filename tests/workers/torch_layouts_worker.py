"""One rank of a torch.distributed job running real parallel layouts on the ``hpcring`` backend
(started by ``hpcring run`` or ``hpcring submit``); each layout runs twice, once on hpcring
groups and once on gloo groups over the same ranks, and the results are compared.

    python tests/workers/torch_layouts_worker.py MODE [MODE ...]

Modes (each prints 'rank R: MODE OK ...'; a failed check raises):
  fsdp1     FSDP1 HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on a 2-D mesh (replicate x shard)
  fsdp2     FSDP2 fully_shard HSDP on init_device_mesh("cpu", (R, S), ("replicate", "shard"))
  tp        DTensor tensor parallelism (ColwiseParallel + RowwiseParallel) on a 1-D mesh of all
            ranks, and FSDP2 x TP on a 2-D mesh ("dp", "tp")
  mesh3d    a 3-D DeviceMesh: every dimension's group, a collective on each, and a DTensor
            sharded over two dimensions
  monitored monitored_barrier: refused by torch on hpcring groups; on a gloo group it works and
            names the rank that never came (the last rank skips it)
  late      the last rank never reaches a barrier of its mesh "shard" group (hpcring's hang
            report names it)

The mesh shapes depend on the world size: 6 ranks (3, 2) / (3, 1, 2); 4 ranks (2, 2) / (2, 1, 2);
3 ranks (3, 1) and (1, 3) / (1, 3, 1); 2 ranks (1, 2) / (2, 1, 1). Results must be bit-identical to gloo when every group that
reduces has at most 2 ranks (a + b == b + a); a group of 3 or more sums in another order than
gloo's ring, so there the results may differ by rounding (checked: relative 1e-5).
"""
from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from hpcring.distributed import ProcessGroupHpcring, init_process_group

init_process_group("cpu:hpcring,cuda:hpcring")
RANK, SIZE = dist.get_rank(), dist.get_world_size()


def shape2d() -> tuple[int, int]:
    return (2, 2) if SIZE == 4 else (SIZE // 2, 2) if SIZE % 2 == 0 else (SIZE, 1)


def backend_of(group) -> str:
    return "hpcring" if isinstance(group, ProcessGroupHpcring) else group._get_backend_name()


def mesh(shape, names, backend: str):
    """A DeviceMesh whose groups are on hpcring (the default group's backend) or on gloo."""
    override = None if backend == "hpcring" else {n: "gloo" for n in names}
    m = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names), backend_override=override)
    for n in names:
        assert backend_of(m.get_group(n)) == backend, (n, m.get_group(n), backend)
    return m


def compare(ours, ref, what: str, exact: bool) -> float:
    """Largest |hpcring - gloo| over the tensors; raises unless bit-identical (``exact``) or
    within rounding."""
    assert len(ours) == len(ref) and ours, what
    diff = 0.0
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape)
        diff = max(diff, (a.double() - b.double()).abs().max().item())
        if exact:
            assert torch.equal(a, b), f"rank {RANK}: {what} tensor {i}: hpcring differs from gloo by {diff:.3g}"
        else:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), f"rank {RANK}: {what} tensor {i}: differs by {diff:.3g}"
    return diff


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def train(model, steps: int = 3, seed: int = RANK, lr: float = 0.1, x_shape=(8, 16)):
    """``steps`` SGD steps (momentum) on this rank's data; returns (losses, seconds per step
    after the first, which also creates communicators and FSDP's lazy state)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(100 + seed)
    losses = []
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(steps):
        if step == 1:
            t0 = time.perf_counter()
        x = torch.randn(*x_shape, generator=g)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses), (time.perf_counter() - t0) / max(1, steps - 1)


def exact_for(*group_sizes: int) -> bool:
    return max(group_sizes) <= 2


# ---- FSDP1 HYBRID_SHARD -------------------------------------------------------------------
def mode_fsdp1() -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy as S
    shape = shape2d()
    notes = []
    for strategy in (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2):
        res = {}
        for backend in ("gloo", "hpcring"):
            m = mesh(shape, ("replicate", "shard"), backend)
            model = FSDP(mlp(), device_mesh=m, sharding_strategy=strategy, use_orig_params=True,
                         device_id=torch.device("cpu"))
            # FSDP1 keeps its (intra, inter) groups: check they are the mesh's, on this backend
            assert model.process_group is m.get_group("shard"), model.process_group
            losses, dt = train(model)
            with FSDP.summon_full_params(model):
                params = [p.detach().clone() for p in model.parameters()]
            res[backend] = (losses, params, dt)
        exact = exact_for(*shape)
        d = compare([res["hpcring"][0], *res["hpcring"][1]], [res["gloo"][0], *res["gloo"][1]],
                    f"fsdp1 {strategy.name}", exact)
        notes.append(f"{strategy.name} max diff {d:.3g} ({'bit-identical' if exact else 'rounding'}), "
                     f"step {res['hpcring'][2] * 1e3:.1f} ms hpcring / {res['gloo'][2] * 1e3:.1f} ms gloo")
    return f"mesh {shape}: " + "; ".join(notes)


# ---- FSDP2 HSDP ---------------------------------------------------------------------------
def mode_fsdp2() -> str:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    shape = shape2d()
    notes = []
    # fp32, and bf16 parameters with fp32 gradient reduction (bf16 all-gathers)
    for label, mp in (("fp32", MixedPrecisionPolicy()),
                      ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
        res = {}
        for backend in ("gloo", "hpcring"):
            m = mesh(shape, ("replicate", "shard"), backend)
            model = mlp()
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=m, mp_policy=mp)
            fully_shard(model, mesh=m, mp_policy=mp)
            p0 = next(model.parameters())
            assert isinstance(p0, DTensor) and p0.placements == (Replicate(), Shard(0)), p0.placements
            losses, dt = train(model)
            res[backend] = (losses, [p.full_tensor() for p in model.parameters()], dt)
        exact = exact_for(*shape)
        d = compare([res["hpcring"][0], *res["hpcring"][1]], [res["gloo"][0], *res["gloo"][1]],
                    f"fsdp2 hsdp {label}", exact)
        notes.append(f"{label} max diff {d:.3g} ({'bit-identical' if exact else 'rounding'}), "
                     f"step {res['hpcring'][2] * 1e3:.1f} ms hpcring / {res['gloo'][2] * 1e3:.1f} ms gloo")
    return f"mesh {shape}: " + "; ".join(notes)


# ---- tensor parallelism -------------------------------------------------------------------
def _tp_model(tp_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    # 24 hidden units: divisible by 2, 3 and 4 ranks (torch's Colwise/RowwiseParallel assume even
    # local shards; 32 over 3 ranks fails in DTensor's sharding propagation on gloo too)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 16))
    return parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def mode_tp() -> str:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    notes = []
    # 1-D: all ranks are one tensor-parallel group; every rank feeds the same batch
    res = {}
    for backend in ("gloo", "hpcring"):
        m = mesh((SIZE,), ("tp",), backend)
        model = _tp_model(m)
        w = model[0].weight
        assert isinstance(w, DTensor) and w.placements == (Shard(0),) and model[2].weight.placements == (Shard(1),)
        losses, dt = train(model, seed=0)
        res[backend] = (losses, [p.full_tensor() for p in model.parameters()], dt)
    exact = exact_for(SIZE)
    d = compare([res["hpcring"][0], *res["hpcring"][1]], [res["gloo"][0], *res["gloo"][1]], "tp", exact)
    notes.append(f"tp {SIZE}: max diff {d:.3g} ({'bit-identical' if exact else 'rounding'}), "
                 f"step {res['hpcring'][2] * 1e3:.1f} ms hpcring / {res['gloo'][2] * 1e3:.1f} ms gloo")
    # 2-D: FSDP2 over "dp" x TP over "tp" (the usual 2-D recipe); a dp row feeds one batch
    shape = (SIZE // 2, 2) if SIZE % 2 == 0 else (1, SIZE)
    res = {}
    for backend in ("gloo", "hpcring"):
        m = mesh(shape, ("dp", "tp"), backend)
        model = _tp_model(m["tp"])
        for i in (0, 2):
            fully_shard(model[i], mesh=m["dp"])
        fully_shard(model, mesh=m["dp"])
        losses, dt = train(model, seed=m.get_local_rank("dp"))
        res[backend] = (losses, [p.full_tensor() for p in model.parameters()], dt)
    exact = exact_for(*shape)
    d = compare([res["hpcring"][0], *res["hpcring"][1]], [res["gloo"][0], *res["gloo"][1]], "fsdp x tp", exact)
    notes.append(f"fsdp x tp {shape}: max diff {d:.3g} ({'bit-identical' if exact else 'rounding'})")
    return "; ".join(notes)


# ---- 3-D mesh -----------------------------------------------------------------------------
def mode_mesh3d() -> str:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    shape = {6: (3, 1, 2), 4: (2, 1, 2), 3: (1, 3, 1), 2: (2, 1, 1)}[SIZE]
    names = ("pp", "dp", "tp")
    meshes = {b: mesh(shape, names, b) for b in ("gloo", "hpcring")}
    hp, gl = meshes["hpcring"], meshes["gloo"]
    assert torch.equal(hp.mesh, gl.mesh) and hp.mesh.shape == shape
    checked = 0
    for dim, name in enumerate(names):
        hg, gg = hp.get_group(name), gl.get_group(name)
        ranks = dist.get_process_group_ranks(hg)
        assert ranks == dist.get_process_group_ranks(gg) and len(ranks) == shape[dim], (name, ranks)
        assert hp[name].get_group() is hg or dist.get_process_group_ranks(hp[name].get_group()) == ranks
        n = len(ranks)
        x = torch.arange(6, dtype=torch.float32) * (RANK + 1) + 0.25 * dim
        out = []
        for g in (hg, gg):
            a = x.clone()
            dist.all_reduce(a, group=g)
            ag = torch.empty(6 * n)
            dist.all_gather_into_tensor(ag, x, group=g)
            rs = torch.empty(2)
            dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n) + RANK, group=g)
            b = x.clone()
            dist.broadcast(b, src=ranks[-1], group=g)
            dist.barrier(group=g)
            out.append([a, ag, rs, b])
        for p, q in zip(*out):
            assert torch.equal(p, q), (name, p, q)
            checked += 1
    # a sub-mesh of two dimensions and a DTensor sharded over them
    sub = hp["pp", "tp"]
    assert sub.mesh.numel() == shape[0] * shape[2]
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    dt = distribute_tensor(full, hp, [Shard(0), Replicate(), Shard(1)])
    assert torch.equal(dt.full_tensor(), full)
    s = dt.redistribute(hp, [Replicate(), Replicate(), Replicate()]).to_local()
    assert torch.equal(s, full)
    total = (dt * 2).sum().full_tensor()
    assert total.item() == full.sum().item() * 2, total
    return f"mesh {shape}: {checked} ops on {len(names)} dims equal to gloo, DTensor Shard/Replicate over it"


# ---- monitored_barrier --------------------------------------------------------------------
def mode_monitored() -> str:
    # torch checks the backend *name* before it reaches any process group: hpcring cannot serve it
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))
    except ValueError as e:
        assert "only implemented for GLOO" in str(e), e
    else:
        raise AssertionError("monitored_barrier on hpcring did not raise")
    # the workaround: a gloo group over the same ranks, next to the hpcring ones
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    dist.monitored_barrier(group=gloo, timeout=datetime.timedelta(seconds=30))
    late = SIZE - 1
    if RANK != late:
        try:
            dist.monitored_barrier(group=gloo, timeout=datetime.timedelta(seconds=3), wait_all_ranks=True)
        except RuntimeError as e:
            text = str(e)
            if RANK == 0:
                assert f"Ranks {late} failed to pass monitoredBarrier" in text, text
        else:
            raise AssertionError("monitored_barrier did not notice the missing rank")
    x = torch.ones(3)
    dist.all_reduce(x)                      # the hpcring group is untouched by gloo's failure
    assert x.tolist() == [SIZE] * 3, x
    return f"refused on hpcring (torch: gloo only); gloo group named rank {late}"


def mode_late() -> str:
    """hpcring's own answer to monitored_barrier: a member that never reaches a barrier of a mesh
    group is named (global rank, host) by the deadline's hang report. Never returns."""
    m = mesh(shape2d(), ("replicate", "shard"), "hpcring")
    g = m.get_group("shard")
    late = SIZE - 1
    dist.barrier(group=g)                    # every member's group communicator exists
    if RANK == late:
        print(f"FAULT skip at {time.time()}", flush=True)
    elif late in dist.get_process_group_ranks(g):
        dist.barrier(group=g)                # waits for the late rank
    time.sleep(120)                          # the late rank, and the other groups: elsewhere
    return "late finished"


if __name__ == "__main__":
    for mode in sys.argv[1:]:
        msg = globals()[f"mode_{mode}"]()
        dist.barrier()
        print(f"rank {RANK}: {mode} OK {msg}", flush=True)
    dist.destroy_process_group()

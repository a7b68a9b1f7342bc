"""Rank program for tests/integration/test_horovod_contract.py: Horovod's contract, one check after
another in one long process per rank (as horovodrun runs a test file), so an error in one check
must not poison the next. Each check prints ``OK <check> rank <r>`` or ``FAIL <check> rank <r>: ...``
and the process goes on; the expectations come from Horovod 0.28's documentation and source
(horovod/torch/mpi_ops.py, horovod/common/exceptions.py, process_sets.py, optimizer.py)."""
from __future__ import annotations

import math
import sys
import time
import traceback

import torch

import hpcring.torch as hvd


def expect_raises(cls, fn, *words):
    try:
        fn()
    except cls as e:
        for w in words:
            assert w in str(e), f"{w!r} not in {e}"
        return e
    except BaseException as e:  # noqa: BLE001
        raise AssertionError(f"expected {cls.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {cls.__name__}, nothing was raised")


def healthy(tag: str) -> None:
    """The engine still works: an allreduce and a broadcast."""
    n = hvd.size()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"healthy.{tag}").tolist() == [n, n]
    assert hvd.broadcast(torch.tensor([hvd.rank()]), 0, name=f"healthy.b.{tag}").item() == 0


# -- 1. exceptions and per-op failure ------------------------------------------------------------
def mismatch() -> None:
    """A collective that differs across ranks raises RuntimeError (HorovodInternalError) on every
    rank, names the ranks, and the next operation works."""
    r = hvd.rank()
    cases = [
        ("shape", lambda: hvd.allreduce(torch.ones(3 + (r == 0)), name="mm.shape"), "differs across ranks"),
        ("dtype", lambda: hvd.allreduce(torch.ones(3, dtype=torch.float64 if r else torch.float32), name="mm.dtype"),
         "float64"),
        ("op", lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if r else hvd.Max, name="mm.op"), "max"),
        ("root", lambda: hvd.broadcast(torch.ones(3), root_rank=min(r, 1), name="mm.root"), "differs"),
        ("gather", lambda: hvd.allgather(torch.ones(2, 2 + (r == 0)), name="mm.gather"), "allgather"),
    ]
    for what, fn, word in cases:
        e = expect_raises(RuntimeError, fn, word)
        assert isinstance(e, hvd.HorovodInternalError), type(e)
        assert "rank 0" in str(e), e
        healthy(f"mm.{what}")


def args() -> None:
    """Bad arguments raise ValueError (Horovod: ValueError), before anything is sent."""
    n = hvd.size()
    h = hvd.allreduce_async(torch.ones(2), name="dup")
    expect_raises(ValueError, lambda: hvd.allreduce_async(torch.ones(2), name="dup"), "already in flight")
    hvd.synchronize(h)
    expect_raises(ValueError, lambda: hvd.alltoall(torch.ones(n + 1), splits=[1] * n), "summing")
    expect_raises(ValueError, lambda: hvd.alltoall(torch.ones(n), splits=[1.0] * n), "integers")
    expect_raises(ValueError, lambda: hvd.alltoall(torch.ones(n), splits=torch.ones(n)), "integers")
    expect_raises(ValueError, lambda: hvd.broadcast(torch.ones(1), root_rank=n), "out of range")
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(opt, named_parameters=[("a", m.weight), ("a", m.bias)]),
                  "duplicate")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(opt, named_parameters=[("w", m.weight)]), "missing")
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(1), op=hvd.Adasum))
    expect_raises(NotImplementedError, lambda: hvd.reducescatter(torch.ones(n), op=hvd.Adasum), "Adasum")
    healthy("args")


def stall() -> None:
    """Names that never match fail on every rank after HPCRING_TIMEOUT (RuntimeError naming the
    tensors); the engine goes on."""
    r, n = hvd.rank(), hvd.size()
    extra = hvd.allgather_async(torch.ones(1)) if r == 0 else None      # unnamed, on rank 0 only
    obj_err = []
    if r == 0:                                                          # an unnamed object call too
        import threading
        th = threading.Thread(target=lambda: obj_err.append(expect_raises(hvd.StallError, lambda: hvd.allgather_object(r))))
        th.start()
    h = hvd.allreduce_async(torch.ones(1), name=f"stall.only.{r}")
    e = expect_raises(RuntimeError, lambda: hvd.synchronize(h), "do not match", f"'stall.only.{r}' submitted by rank {r}")
    assert isinstance(e, hvd.StallError)
    if extra is not None:
        expect_raises(hvd.StallError, lambda: hvd.synchronize(extra), "allgather.noname.0")
        th.join(timeout=60)
        assert obj_err and "allgather_object.noname.0.sizes" in str(obj_err[0]), obj_err
    _auto_names_agree()                       # the stalled unnamed call gave its name back
    assert hvd.allgather(torch.tensor([r])).tolist() == list(range(n))
    healthy("stall")


def join() -> None:
    """Horovod's join: the joined rank contributes zeros to Sum/Average allreduces; the others'
    allgather, broadcast, alltoall, reducescatter and Min/Max allreduces fail cleanly; join()
    returns the last rank to join on every rank."""
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        last = hvd.join()
    else:
        s = hvd.allreduce(torch.tensor([2.0]), op=hvd.Sum, name="join.sum")
        assert s.item() == 2.0 * (n - 1), s
        a = hvd.allreduce(torch.tensor([2.0, 4.0]), name="join.avg")      # Average divides by the set size
        assert torch.allclose(a, torch.tensor([2.0, 4.0]) * (n - 1) / n), a
        for what, fn in (("allgather", lambda: hvd.allgather(torch.ones(1), name="join.ag")),
                         ("broadcast", lambda: hvd.broadcast(torch.ones(1), 1, name="join.bc")),
                         ("alltoall", lambda: hvd.alltoall(torch.ones(n), name="join.a2a")),
                         ("reducescatter", lambda: hvd.reducescatter(torch.ones(n), name="join.rs")),
                         ("allreduce with op max", lambda: hvd.allreduce(torch.ones(1), op=hvd.Max, name="join.max"))):
            e = expect_raises(RuntimeError, fn, what, "joined")
            assert isinstance(e, hvd.JoinedRankError), type(e)
        time.sleep(0.2 * r)
        last = hvd.join()
    assert last == n - 1, last
    healthy("join")


# -- 2. dtypes and integer arithmetic ---------------------------------------------------------------
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]


def dtypes() -> None:
    r, n = hvd.rank(), hvd.size()
    for dt in DTYPES:
        tag = str(dt).split(".")[1]
        base = torch.arange(6).reshape(3, 2) % 2 if dt == torch.bool else torch.arange(6).reshape(3, 2) + r
        x = base.to(dt)
        g = hvd.allgather(x[: r + 1], name=f"dt.ag.{tag}")
        want = torch.cat([(torch.arange(6).reshape(3, 2) % 2 if dt == torch.bool else torch.arange(6).reshape(3, 2) + i)
                          .to(dt)[: i + 1] for i in range(n)])
        assert g.dtype == dt and torch.equal(g, want), (dt, g, want)
        b = hvd.broadcast(x, root_rank=n - 1, name=f"dt.bc.{tag}")
        assert b.dtype == dt and torch.equal(b, (base - r + n - 1 if dt != torch.bool else base).to(dt)), (dt, b)
        y = x.clone()
        hvd.broadcast_(y, root_rank=0, name=f"dt.bc_.{tag}")
        assert torch.equal(y, (base - r if dt != torch.bool else base).to(dt)), (dt, y)
        a = hvd.alltoall(torch.full((n, 2), r % 2 if dt == torch.bool else r).to(dt), name=f"dt.a2a.{tag}")
        assert a.dtype == dt and torch.equal(a, torch.tensor([[i % 2 if dt == torch.bool else i] * 2
                                                               for i in range(n)]).to(dt)), (dt, a)
        s = hvd.allreduce(torch.ones(4).to(dt), op=hvd.Sum, name=f"dt.ar.{tag}")
        assert s.dtype == dt and torch.equal(s, (torch.ones(4) * (1 if dt == torch.bool else n)).to(dt)), (dt, s)
        rs = hvd.reducescatter(torch.ones(n * 2, 3).to(dt), op=hvd.Sum, name=f"dt.rs.{tag}")
        assert rs.dtype == dt and rs.shape == (2, 3), (dt, rs)
    c = hvd.allreduce(torch.tensor([1 + 2j, 3 - 1j]), op=hvd.Sum, name="dt.complex")
    assert torch.equal(c, torch.tensor([1 + 2j, 3 - 1j]) * n), c
    w = hvd.allreduce(torch.tensor([100], dtype=torch.int8), op=hvd.Sum, name="dt.wrap")
    assert w.item() == torch.tensor([100 * n], dtype=torch.int64).to(torch.int8).item(), w     # wraps as int8


def _trunc(v: float) -> int:
    return int(math.trunc(v))


def int_arith() -> None:
    """Horovod's ScaleBuffer: integers scaled in double and truncated toward zero; Average is a
    postscale of 1/size; results in the input's dtype."""
    r, n = hvd.rank(), hvd.size()
    vals = [-7, -3, 3, 7, 50, -50]
    for dt in (torch.int32, torch.int64, torch.int16, torch.int8):
        tag = str(dt).split(".")[1]
        x = torch.tensor(vals, dtype=dt)
        out = hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.1915, name=f"ia.post.{tag}")
        wrapped = torch.tensor([n * v for v in vals]).to(dt).tolist()         # an int8 sum wraps
        assert out.dtype == dt and out.tolist() == [_trunc(s * 0.1915) for s in wrapped], (dt, out.tolist())
        out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.35, name=f"ia.pre.{tag}")
        assert out.dtype == dt and out.tolist() == [n * _trunc(v * 0.35) for v in vals], (dt, out.tolist())
    mine = torch.tensor([-75, 75, -1] if r == 0 else [0, 0, -1], dtype=torch.int32)
    avg = hvd.allreduce(mine, name="ia.avg")                   # sums: -75, 75, -n
    assert avg.dtype == torch.int32 and avg.tolist() == [_trunc(-75 / n), _trunc(75 / n), -1], avg.tolist()
    f = hvd.allreduce(torch.tensor(vals, dtype=torch.float32), op=hvd.Sum, postscale_factor=0.5, name="ia.float")
    assert f.tolist() == [n * v * 0.5 for v in vals], f
    rs = hvd.reducescatter(torch.tensor([vals] * n, dtype=torch.int32), op=hvd.Sum, prescale_factor=0.35,
                           name="ia.rs")
    assert rs.dtype == torch.int32 and rs.tolist() == [[n * _trunc(v * 0.35) for v in vals]], rs
    rs = hvd.reducescatter(torch.tensor([vals] * n, dtype=torch.int32), name="ia.rs.avg", postscale_factor=0.1915)
    assert rs.dtype == torch.int32 and rs.tolist() == [[_trunc(n * v * 0.1915 / n) for v in vals]], rs


# -- 3. process sets ------------------------------------------------------------------------------
STATIC: list = []


def static_sets(size: int) -> list:
    return [hvd.ProcessSet([0, size - 1] if size > 2 else [1])]


def process_sets() -> None:
    r, n = hvd.rank(), hvd.size()
    static = STATIC[0]
    assert static.process_set_id == 1 and static.size() == len(static.ranks), static
    dyn = hvd.add_process_set([0, 1] if n > 2 else [0])
    assert dyn.process_set_id == 2, dyn
    expect_raises(ValueError, lambda: hvd.add_process_set(list(dyn.ranks)), "exists already")
    for ps in (static, dyn):
        tag = f"ps{ps.process_set_id}"
        if not ps.included():
            assert ps.rank() == -1
            expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=ps), "not a member")
            continue
        k = len(ps.ranks)
        assert ps.rank() == ps.ranks.index(r)
        s = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name=f"{tag}.sum", process_set=ps)
        assert s.item() == sum(ps.ranks), s
        g = hvd.allgather(torch.tensor([r]), name=f"{tag}.ag", process_set=ps)
        assert g.tolist() == ps.ranks, g
        b = hvd.broadcast(torch.tensor([r]), root_rank=ps.ranks[-1], name=f"{tag}.bc", process_set=ps)
        assert b.item() == ps.ranks[-1], b                     # root_rank is a global rank (Horovod)
        expect_raises(ValueError, lambda: hvd.broadcast(torch.ones(1), root_rank=next(
            i for i in range(n) if i not in ps.ranks), process_set=ps), "not a member") if k < n else None
        rs = hvd.reducescatter(torch.ones(k * 2), op=hvd.Sum, name=f"{tag}.rs", process_set=ps)
        assert rs.tolist() == [k, k], rs
        a = hvd.alltoall(torch.full((k,), r), name=f"{tag}.a2a", process_set=ps)
        assert a.tolist() == ps.ranks, a
        hvd.barrier(process_set=ps)
        assert hvd.allgather_object(r, process_set=ps) == ps.ranks
        assert hvd.broadcast_object(r, root_rank=ps.ranks[0], process_set=ps) == ps.ranks[0]
        # DistributedOptimizer on the set == one process on the members' global batch
        torch.manual_seed(0)
        model, ref = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
        ref.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), process_set=ps)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        xs = torch.randn(2, 2 * k, 3, generator=torch.Generator().manual_seed(5))
        me = ps.rank()
        for x in xs:
            opt.zero_grad()
            model(x[2 * me: 2 * me + 2]).pow(2).mean().backward()
            opt.step()
            ref_opt.zero_grad()
            ref(x).pow(2).mean().backward()
            ref_opt.step()
        assert torch.allclose(model.weight, ref.weight, atol=1e-6), (model.weight, ref.weight)
    # a global op between set ops still works; then removal
    healthy("ps")
    assert hvd.remove_process_set(dyn) and dyn.process_set_id is None
    assert not hvd.remove_process_set(hvd.global_process_set)
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=dyn), "not registered")
    dyn2 = hvd.add_process_set(list(dyn.ranks))                # the same ranks again, after removal
    if dyn2.included():
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=dyn2).item() == len(dyn2.ranks)
    assert hvd.remove_process_set(dyn2)
    healthy("ps2")


# -- 4. grouped reducescatter, autograd, sparse -----------------------------------------------------
def grouped_rs() -> None:
    n = hvd.size()
    outs = hvd.grouped_reducescatter([torch.ones(n * 2, 2), torch.ones(n, dtype=torch.int32) * 3], op=hvd.Sum)
    assert outs[0].tolist() == [[n, n]] * 2 and outs[1].tolist() == [3 * n], outs
    h = hvd.grouped_reducescatter_async([torch.ones(n) * 4, torch.ones(2 * n + 1)], name="grs")
    a, b = hvd.synchronize(h)
    assert a.tolist() == [4.0] and b.shape[0] == 2 + (hvd.rank() < 1) and b.eq(1).all(), (a, b)


def autograd() -> None:
    r, n = hvd.rank(), hvd.size()
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x * (r + 1), op=hvd.Sum) * 2).sum().backward()
    assert x.grad.tolist() == [2.0 * n * (r + 1)] * 3, x.grad          # backward: allreduce Sum of 2s, * (r+1)
    x = torch.ones(r + 1, 2, requires_grad=True)                       # uneven first dims
    g = hvd.allgather(x)
    g.backward(torch.arange(g.shape[0], dtype=torch.float32).unsqueeze(1).expand(-1, 2) * (r + 1))
    off = sum(i + 1 for i in range(r))
    want = torch.arange(off, off + r + 1, dtype=torch.float32).unsqueeze(1).expand(-1, 2) * (n + 1) / 2
    assert torch.allclose(x.grad, want), (x.grad, want)                 # averaged over ranks, my rows
    x = torch.ones(2, requires_grad=True)
    hvd.broadcast(x, root_rank=n - 1).sum().backward()
    assert x.grad.tolist() == ([1.0, 1.0] if r == n - 1 else [0.0, 0.0]), x.grad
    x = torch.ones(n, 2, requires_grad=True)
    out = hvd.alltoall(x * (r + 1))
    out.backward(torch.ones_like(out) * (r + 1))
    assert x.grad.tolist() == [[float((i + 1) * (r + 1))] * 2 for i in range(n)], x.grad
    x = torch.ones(2 * n, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()
    assert x.grad.tolist() == [float(n)] * (2 * n), x.grad
    x = torch.ones(2 * n, requires_grad=True)
    hvd.reducescatter(x).sum().backward()
    assert x.grad.tolist() == [1.0] * (2 * n), x.grad
    # the grouped forms
    xs = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    outs = hvd.grouped_allreduce([x * (r + 1) for x in xs], op=hvd.Sum)
    sum(o.sum() * 2 for o in outs).backward()
    assert [x.grad.tolist() for x in xs] == [[2.0 * n * (r + 1)] * 2, [2.0 * n * (r + 1)] * 3], [x.grad for x in xs]
    xs = [torch.ones(r + 1, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
    a, b = hvd.grouped_allgather(xs)
    (a * torch.arange(a.shape[0])).sum().backward(retain_graph=True)
    b.sum().backward()
    off = sum(i + 1 for i in range(r))
    assert xs[0].grad.tolist() == [float(i) for i in range(off, off + r + 1)], xs[0].grad
    assert xs[1].grad.tolist() == [[1.0, 1.0]] * 2, xs[1].grad
    xs = [torch.ones(2 * n, requires_grad=True), torch.ones(n, 3, requires_grad=True)]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum)
    sum(o.sum() for o in outs).backward()
    assert xs[0].grad.tolist() == [float(n)] * (2 * n) and xs[1].grad.eq(n).all(), [x.grad for x in xs]


def _embeddings(rows: int, dim: int, make_opt, sparse_as_dense: bool):
    """A sparse Embedding under DistributedOptimizer, and an equal one under a plain optimizer
    (the reference: one process on the global batch)."""
    torch.manual_seed(0)
    emb, ref = torch.nn.Embedding(rows, dim, sparse=True), torch.nn.Embedding(rows, dim, sparse=True)
    ref.load_state_dict(emb.state_dict())
    opt = hvd.DistributedOptimizer(make_opt(emb.parameters()), named_parameters=emb.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    return emb, ref, opt, make_opt(ref.parameters())


def sparse() -> None:
    """An Embedding(sparse=True): sparse_allreduce_async, DistributedOptimizer with and without
    sparse_as_dense, each == one process on the global batch."""
    r, n = hvd.rank(), hvd.size()
    idx = torch.tensor([[0, 2, 2]]) if r == 0 else torch.tensor([[1, 2, 4]])
    sp = torch.sparse_coo_tensor(idx, torch.ones(3) * (r + 1), (5,))
    dense = hvd.synchronize(hvd.sparse_allreduce_async(sp, name="sp.direct", op=hvd.Sum)).to_dense()
    want = sum(torch.sparse_coo_tensor(torch.tensor([[0, 2, 2]]) if i == 0 else torch.tensor([[1, 2, 4]]),
                                       torch.ones(3) * (i + 1), (5,)).to_dense() for i in range(n))
    assert torch.equal(dense, want), (dense, want)
    for as_dense in (True, False):
        emb, ref, opt, ref_opt = _embeddings(6, 2, lambda ps: torch.optim.SGD(ps, lr=0.5), as_dense)
        data = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 1]])
        for step in range(2):
            batch = data[[(i + step) % 4 for i in range(n)]]
            opt.zero_grad()
            emb(batch[r]).pow(2).sum().backward()
            opt.step()
            ref_opt.zero_grad()
            (ref(batch).pow(2).sum() / n).backward()
            ref_opt.step()
        assert torch.allclose(emb.weight, ref.weight, atol=1e-6), (as_dense, emb.weight, ref.weight)


def optstate_nograd() -> None:
    """broadcast_optimizer_state before any step (parameters without gradients, empty state)."""
    r = hvd.rank()
    torch.manual_seed(r)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.01 * (r + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01, opt.param_groups[0]["lr"]
    dopt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1 * (r + 1), momentum=0.9),
                                    named_parameters=m.named_parameters())
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    assert dopt.param_groups[0]["lr"] == 0.1, dopt.param_groups[0]["lr"]
    assert all(p.grad is None or not p.grad.any() for p in m.parameters())
    # a model part without gradients (unused in the forward pass), SGD without momentum, after a step
    torch.manual_seed(r)
    two = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1 * (r + 1)), lambda ps: torch.optim.Adam(ps, lr=0.1 * (r + 1)),
                 lambda ps: torch.optim.SGD(ps, lr=0.1 * (r + 1), momentum=0.5)):
        o = make(two.parameters())
        two[0](torch.ones(1, 3)).sum().backward()
        o.step()
        hvd.broadcast_optimizer_state(o, root_rank=0)
        assert o.param_groups[0]["lr"] == 0.1, o.param_groups[0]["lr"]
        o.zero_grad()


# -- 6. the response cache ---------------------------------------------------------------------------
def cache() -> None:
    eng = hvd.state.engine()
    if eng.controller.cache is None:
        return
    for i in range(3):
        hvd.grouped_allreduce([torch.ones(2), torch.ones(3)], name="cache.g", op=hvd.Sum)
    full0, hits0 = eng.stats["full_negotiations"], eng.stats["cache_hits"]
    for i in range(5):
        outs = hvd.grouped_allreduce([torch.ones(2) * i, torch.ones(3)], name="cache.g", op=hvd.Sum)
        assert outs[0].tolist() == [i * hvd.size()] * 2
    assert eng.stats["full_negotiations"] == full0, "a steady loop negotiated in full"
    assert eng.stats["cache_hits"] >= hits0 + 10, eng.stats
    # the same name with a new shape on every rank: renegotiated, then cached again
    assert hvd.allreduce(torch.ones(4), name="cache.g.0", op=hvd.Sum).tolist() == [hvd.size()] * 4
    # ... and on one rank only: the mismatch is named, the engine goes on
    expect_raises(RuntimeError, lambda: hvd.allreduce(torch.ones(4 + (hvd.rank() == 0)), name="cache.g.0"),
                  "differs across ranks")
    healthy("cache")


def average_exact() -> None:
    """Horovod's test_horovod_join_allreduce on 3 ranks: with one rank joined, the others' Average
    equals ``t * (size - 1) / size`` exactly, for every float dtype (an Average divides by the
    size; Horovod multiplies by fl(1/size) and is an ulp off there)."""
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(1234)
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for i, first in enumerate(list(range(n)) * 3):
            a = torch.FloatTensor(5 + i).random_(-100, 100).to(dt)
            if r == first:
                hvd.join()
            else:
                avg = hvd.allreduce(a, name=f"avx.{dt}.{i}")
                hvd.join()
                assert torch.equal(avg, a * (n - 1) / n), (dt, avg, a * (n - 1) / n)
            assert torch.equal(hvd.allreduce(a, name=f"avy.{dt}.{i}"), a * n / n)
            rs = hvd.reducescatter(torch.cat([a.reshape(1, -1)] * n), name=f"avz.{dt}.{i}")
            assert torch.equal(rs, (a * n / n).reshape(1, -1)), (dt, rs)


# -- 7. what Horovod's own test file (test/parallel/test_torch.py) relies on ---------------------------
def _same_everywhere(what: str, value) -> None:
    got = hvd.allgather_object(value, name=f"same.{what}")
    assert all(v == got[0] for v in got), f"{what} differs across ranks: {got}"


def _counts(eng) -> dict:
    return {k: v for k, v in eng._auto.items() if v}


def _auto_names_agree() -> None:
    """The automatic-name counters agree: the global set's on every rank, each set's among its members."""
    _same_everywhere("auto", _counts(hvd.state.engine()))
    for ps in list(hvd.process_sets._registry.values()):
        if ps.process_set_id and ps._engine is not None:
            got = hvd.allgather_object(_counts(ps._engine), name=f"same.auto.{ps.process_set_id}", process_set=ps)
            assert all(v == got[0] for v in got), f"set {ps.process_set_id}'s automatic names differ: {got}"


def _set(ranks):
    """A process set of ``ranks`` (every rank calls): a registered one, else a new one (added=True)."""
    for ps in hvd.process_sets._registry.values():
        if ps.ranks == ranks:
            return ps, False
    return hvd.add_process_set(ranks), True


def names_after_refusal() -> None:
    """Horovod's test_horovod_join_allgather: each rank joins first in turn while the others'
    allgathers are refused (JoinedRankError), with an unnamed allgather_object after each round.
    Afterwards the automatic names agree on every rank and unnamed operations still match."""
    r, n = hvd.rank(), hvd.size()
    t = torch.ones(17, 17)
    for first in range(n):
        if r == first:
            ret = hvd.join()
        else:
            expect_raises(hvd.JoinedRankError, lambda: hvd.allgather(t), "joined")
            ret = hvd.join()
        assert ret != first or n == 1, (ret, first)
        assert hvd.allgather_object(ret) == [ret] * n
    # a rank-local refusal (bad arguments on one rank only) takes no automatic name
    if r == 0:
        expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(2), op=99))
        expect_raises(ValueError, lambda: hvd.alltoall(torch.ones(n + 1)))
        expect_raises(ValueError, lambda: hvd.grouped_allreduce_([torch.ones(1), torch.ones(4)[::2]]), "contiguous")
    _auto_names_agree()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n, n]
    assert hvd.allgather(torch.tensor([r])).tolist() == list(range(n))
    hvd.barrier()


def sparse_handle() -> None:
    """hvd.sparse_allreduce_async returns a handle that is called (``handle()``), as Horovod's
    function is; synchronize(handle) works too."""
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(100 + r)
    ts = [torch.where(torch.rand(d, 4) < 0.7, 0.0, torch.rand(d, 4)).to_sparse() for d in (5, 9, 3)]
    dense = [hvd.allreduce(t.to_dense(), name=f"sph.d{i}") for i, t in enumerate(ts)]
    handles = [hvd.sparse_allreduce_async(t, op=hvd.Average, name=f"sph.{i}") for i, t in enumerate(ts)]
    assert all(callable(h) for h in handles)
    got = [h() for h in handles]
    for d, g in zip(dense, got):
        assert g.is_sparse and torch.allclose(d, g.to_dense(), atol=1e-6), (d, g)
    h = hvd.sparse_allreduce_async(ts[0], op=hvd.Sum, name="sph.sync")
    assert torch.allclose(hvd.synchronize(h).to_dense(), dense[0] * n, atol=1e-6)


def sparse_as_dense() -> None:
    """DistributedOptimizer(sparse_as_dense=True) reduces a dense copy and hands the optimizer a
    sparse gradient again: SparseAdam (sparse gradients only) steps, == one process on the global
    batch."""
    r, n = hvd.rank(), hvd.size()
    emb, ref, opt, ref_opt = _embeddings(8, 3, lambda ps: torch.optim.SparseAdam(ps, lr=0.1), True)
    data = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 3]])
    for step in range(3):
        batch = data[[(i + step) % len(data) for i in range(n)]]
        opt.zero_grad()
        emb(batch[r]).pow(2).sum().backward()
        opt.synchronize()
        assert emb.weight.grad.is_sparse, "the reduced gradient is no longer sparse"
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        (ref(batch).pow(2).sum() / n).backward()
        ref_opt.step()
    assert torch.allclose(emb.weight, ref.weight, atol=1e-5), (emb.weight, ref.weight)


def optimizer_outside_set() -> None:
    """Horovod's test_optimizer_process_sets: a DistributedOptimizer on the even ranks' set is
    built on every rank; the odd ranks step on their own gradients; the sets can then be removed
    and added again."""
    r, n = hvd.rank(), hvd.size()
    (even, new_even), (odd, new_odd) = _set([k for k in range(n) if k % 2 == 0]), _set([k for k in range(n) if k % 2])
    mine = even if r % 2 == 0 else odd
    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(10, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    local = torch.nn.Sequential(torch.nn.Linear(10, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                   named_parameters=model.named_parameters(), process_set=even)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    local.load_state_dict(model.state_dict())
    local_opt = torch.optim.SGD(local.parameters(), lr=0.2, momentum=0.9)
    x, y = torch.randn(8, 10), torch.randn(8, 2)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        local_opt.zero_grad()
        torch.nn.functional.mse_loss(local(x), y).backward()
        local_opt.step()
    v = model[2].weight.detach().flatten()
    every = hvd.allgather(v.unsqueeze(0), process_set=mine)
    if mine is even:
        assert all(torch.allclose(v, row) for row in every), "the even ranks differ after a reduced step"
    else:                                                     # stepped alone: == a plain optimizer
        assert torch.allclose(model[2].weight, local[2].weight, atol=1e-6)
    for ps, new in ((odd, new_odd), (even, new_even)):
        if new:
            assert hvd.remove_process_set(ps)
            again = hvd.add_process_set(list(ps.ranks))
            assert hvd.remove_process_set(again)


def optstate_zero_grads() -> None:
    """After broadcast_optimizer_state of a new optimizer every trainable parameter's grad is a
    zero tensor (Horovod's zero step leaves them), so scripts can broadcast it; SparseAdam's are
    sparse."""
    torch.manual_seed(hvd.rank())
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    m[1].bias.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=m.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and not p.grad.any(), (name, p.grad)
            hvd.broadcast(p.grad, 0, name=f"zg.{name}")
        else:
            assert p.grad is None, name
    emb = torch.nn.Embedding(4, 2, sparse=True)
    hvd.broadcast_optimizer_state(torch.optim.SparseAdam(emb.parameters()), root_rank=0)
    assert emb.weight.grad.is_sparse and not emb.weight.grad.to_dense().any()


def parameter_names() -> None:
    """DistributedOptimizer._parameter_names: {parameter: name}, from named_parameters or
    Horovod's default names ``allreduce.noname.<group>.<index>``."""
    m = torch.nn.Linear(2, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    assert {n: opt._parameter_names[p] for n, p in m.named_parameters()} == {"weight": "weight", "bias": "bias"}
    m2 = torch.nn.Linear(2, 2)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD([{"params": [m2.weight]}, {"params": [m2.bias], "lr": 0.5}],
                                                    lr=0.1))
    assert opt2._parameter_names[m2.weight] == "allreduce.noname.0.0"
    assert opt2._parameter_names[m2.bias] == "allreduce.noname.1.0"
    m2(torch.ones(1, 2)).sum().backward()
    opt2.synchronize()                           # the default names match on every rank
    _same_everywhere("g", m2.weight.grad.tolist())


STEP_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(). This can cause training slowdown.")


def step_warning() -> None:
    """step() after synchronize() warns in Horovod's words; inside skip_synchronize() it does not."""
    import warnings
    m = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    for skip in (False, True):
        opt.zero_grad()
        m(torch.ones(1, 2)).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        texts = [str(w.message) for w in seen]
        assert any(t.startswith(STEP_WARNING) for t in texts) != skip, (skip, texts)


def long_mixed() -> None:
    """A long seeded sequence of mixed operations, the same on every rank: named and unnamed ops
    of every kind, joins with refused operations, mismatches, rank-local argument errors,
    process sets added and removed. Afterwards the automatic names and the engine agree on
    every rank."""
    import random
    r, n = hvd.rank(), hvd.size()
    rng = random.Random(7)
    sets = []

    def act(kind: str, i: int) -> None:
        if kind == "allreduce":
            assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [n] * 3
        elif kind == "named":
            assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"lm.{i}").tolist() == [n] * 2
        elif kind == "allgather":
            assert hvd.allgather(torch.tensor([[r]])).flatten().tolist() == list(range(n))
        elif kind == "broadcast":
            assert hvd.broadcast(torch.tensor([r]), n - 1).item() == n - 1
        elif kind == "alltoall":
            assert hvd.alltoall(torch.arange(n) + r * n).tolist() == [k * n + r for k in range(n)]
        elif kind == "reducescatter":
            assert hvd.reducescatter(torch.ones(n, 2), op=hvd.Sum).tolist() == [[n, n]]
        elif kind == "grouped":
            outs = hvd.grouped_allreduce([torch.ones(1), torch.ones(2)], op=hvd.Sum)
            assert [o.tolist() for o in outs] == [[n], [n, n]]
        elif kind == "objects":
            assert hvd.allgather_object(r) == list(range(n))
            assert hvd.broadcast_object({"i": i} if r == 0 else None) == {"i": i}
        elif kind == "barrier":
            hvd.barrier()
        elif kind == "join":
            joiner = i % n
            if r != joiner:
                assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n - 1     # joined: zeros
                assert [o.item() for o in hvd.grouped_allreduce([torch.ones(1)] * 2, op=hvd.Sum)] == [n - 1] * 2
                expect_raises(hvd.JoinedRankError, lambda: hvd.broadcast(torch.ones(1), 0))
            hvd.join()
        elif kind == "mismatch":
            expect_raises(hvd.TensorMismatchError, lambda: hvd.allreduce(torch.ones(2 + (r == 0))))
        elif kind == "local_error":
            if r == i % n:
                expect_raises(ValueError, lambda: hvd.reducescatter(torch.ones(2), op=hvd.Max + 10))
                expect_raises(ValueError, lambda: hvd.broadcast(torch.ones(1), n + 5))
        elif kind == "add_set":
            ranks = sorted(rng.sample(range(n), rng.randint(1, n)))
            if any(ps.ranks == ranks for ps in hvd.process_sets._registry.values()) or ranks == list(range(n)):
                return
            ps = hvd.add_process_set(ranks)
            sets.append(ps)
            if ps.included():
                assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps).item() == len(ranks)
                assert hvd.allgather_object(r, process_set=ps) == ranks
        elif kind == "remove_set" and sets:
            assert hvd.remove_process_set(sets.pop(rng.randrange(len(sets))))

    kinds = ["allreduce", "named", "allgather", "broadcast", "alltoall", "reducescatter", "grouped", "objects",
             "barrier", "join", "mismatch", "local_error", "add_set", "remove_set"]
    for i in range(120):
        act(rng.choice(kinds), i)
    while sets:
        assert hvd.remove_process_set(sets.pop())
    _auto_names_agree()
    _same_everywhere("sets", sorted(hvd.process_sets._registry))
    healthy("long_mixed")


CHECKS = {"mismatch": mismatch, "args": args, "stall": stall, "join": join, "dtypes": dtypes,
          "int_arith": int_arith, "process_sets": process_sets, "grouped_rs": grouped_rs, "autograd": autograd,
          "sparse": sparse, "optstate_nograd": optstate_nograd, "cache": cache,
          "names_after_refusal": names_after_refusal, "sparse_handle": sparse_handle,
          "sparse_as_dense": sparse_as_dense, "optimizer_outside_set": optimizer_outside_set,
          "optstate_zero_grads": optstate_zero_grads, "parameter_names": parameter_names,
          "step_warning": step_warning, "long_mixed": long_mixed, "average_exact": average_exact}


if __name__ == "__main__":
    size = int(sys.argv[1].split("=")[1])        # size=N: the static process sets need it before init
    STATIC.extend(static_sets(size))
    hvd.init(process_sets=STATIC)
    for mode in sys.argv[2:]:
        t0 = time.monotonic()
        try:
            CHECKS[mode]()
            print(f"OK {mode} rank {hvd.rank()} ({time.monotonic() - t0:.1f} s)", flush=True)
        except BaseException:  # noqa: BLE001 - report and go on with the next check
            print(f"FAIL {mode} rank {hvd.rank()}: " + traceback.format_exc().replace("\n", "\n    "), flush=True)
    hvd.shutdown()

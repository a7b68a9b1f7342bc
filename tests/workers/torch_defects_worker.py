"""One rank of the torch.distributed defects checks of the ``hpcring`` backend, started
by ``hpcring run``; gloo over the same ranks is the reference.

    python tests/workers/torch_defects_worker.py MODE[,MODE...]

Modes (each prints one 'MODE OK ...' line on success; a failed check raises):
  reduce     every dtype (bool, int8, int16, ...) x SUM/PRODUCT/MIN/MAX/BAND/BOR/BXOR (and AVG on
             integers, NCCL's sum-then-truncate) == gloo and an exact local fold; broadcast of
             0-dim tensors of every dtype == gloo
  empty      all_to_all_single where one rank has 0 rows, and empty tensors in every op, == gloo
  powersgd   DDP with the PowerSGD comm hook (collectives issued and waited on inside
             Future.then callbacks) on hpcring == on gloo, a few steps past compression start
  compile    torch.compile(DDP(model)) on hpcring == on gloo
  lightning BACKEND (alone): Trainer with validation and self.log(..., sync_dist=True) of a
             float and an int64 counter; prints the synced metrics (the test compares backends)
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import hpcring.distributed  # noqa: F401  (registers "hpcring")
from hpcring.errors import UsageError

R = dist.ReduceOp
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
          torch.int8, torch.int16, torch.bool)
BITWISE = (R.BAND, R.BOR, R.BXOR)
GLOO_REFUSED: set = set()


def setup(backend="cpu:hpcring"):
    global RANK, SIZE, HP, GLOO
    dist.init_process_group(backend)
    RANK, SIZE = dist.get_rank(), dist.get_world_size()
    HP = dist.group.WORLD
    GLOO = dist.new_group(backend="gloo")


def inputs(dtype, rank, n=12):
    """Values that overflow int8 sums and products, with negatives, zeros and odd sums."""
    base = torch.tensor([100, -3, 7, 0, 1, -128, 127, 5, 64, 33, -77, 2][:n], dtype=torch.int64)
    v = base * (rank + 1) + rank * 37
    if dtype == torch.bool:
        return ((v + rank) % 3 == 0)
    if dtype.is_floating_point:
        return (v.double() / 8).to(dtype)
    if dtype == torch.uint8:
        return (v % 256).to(dtype)
    return v.to(dtype)     # wraps into int8/int16


_FOLD = {R.SUM: lambda a, b: a + b, R.PRODUCT: lambda a, b: a * b, R.MIN: torch.minimum, R.MAX: torch.maximum,
         R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}


def reference(dtype, op):
    """The exact result, folded here in the tensor's type (integers wrap; bool + is or, * is and)."""
    acc = inputs(dtype, 0)
    for r in range(1, SIZE):
        acc = _FOLD[op](acc, inputs(dtype, r))
    return acc


def equal(a, b, what):
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"rank {RANK}: {what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
    if a.dtype.is_floating_point:
        tol = 2e-2 if a.dtype in (torch.bfloat16, torch.float16) else 1e-6
        ok = torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)
    else:
        ok = torch.equal(a, b)
    if not ok:
        raise AssertionError(f"rank {RANK}: {what}: hpcring {a} != reference {b}")


def gloo_or_none(fn):
    """fn(GLOO), or None where gloo itself refuses (its own limits: not ours to match)."""
    try:
        return fn(GLOO)
    except (RuntimeError, ValueError):
        GLOO_REFUSED.add(" ".join(map(str, getattr(fn, "__defaults__", None) or ())))
        return None


def mode_reduce():
    checks = 0
    for dt in DTYPES:
        for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, *BITWISE):
            def ar(g, op=op, dt=dt):
                t = inputs(dt, RANK)
                dist.all_reduce(t, op=op, group=g)
                return t
            what = f"all_reduce {dt} {op}"
            if dt.is_floating_point and op in BITWISE:       # refused, as gloo does, and nothing sent
                try:
                    ar(HP)
                except UsageError as e:
                    assert "needs an integer or bool tensor" in str(e), e
                else:
                    raise AssertionError(f"{what} was not refused")
                checks += 1
                continue
            got = ar(HP)
            if not (dt.is_floating_point and op == R.PRODUCT and dt in (torch.float16, torch.bfloat16)):
                equal(got, reference(dt, op), what + " vs exact")
            ref = gloo_or_none(ar)
            if ref is not None:
                equal(got, ref, what + " vs gloo")
            checks += 1
        # AVG: floats as before; integers as NCCL: the sum (wrapping in the type), truncated towards 0
        if dt != torch.bool:
            t = inputs(dt, RANK)
            dist.all_reduce(t, op=R.AVG, group=HP)
            s = reference(dt, R.SUM)
            want = (s.double() / SIZE).to(dt) if dt.is_floating_point else torch.div(s, SIZE, rounding_mode="trunc")
            equal(t, want, f"all_reduce {dt} AVG")
            def gloo_avg(g, dt=dt):           # what Lightning does on gloo: SUM, then copy_(t / size)
                u = inputs(dt, RANK)
                dist.all_reduce(u, group=g)
                return u.copy_(u / SIZE)
            ref = gloo_or_none(gloo_avg) if not dt.is_floating_point else None
            if ref is not None:
                equal(t, ref, f"all_reduce {dt} AVG vs gloo SUM then truncating division")
            checks += 1
        else:
            try:
                dist.all_reduce(inputs(dt, RANK), op=R.AVG, group=HP)
            except UsageError as e:
                assert "cannot average bool" in str(e), e
            else:
                raise AssertionError("AVG on bool was not refused")
            checks += 1
        # reduce, reduce_scatter, coalesced with the new dtypes/ops
        if dt in (torch.int8, torch.int16, torch.bool, torch.int64):
            op = R.BXOR if dt != torch.int16 else R.SUM

            def rst(g, op=op, dt=dt):
                out = torch.empty(4, dtype=dt)
                big = torch.cat([inputs(dt, RANK, 4) for _ in range(SIZE)])
                dist.reduce_scatter_tensor(out, big, op=op, group=g)
                return out
            equal(rst(HP), reference(dt, op)[:4], f"reduce_scatter_tensor {dt} {op}")

            def red(g, dt=dt):
                t = inputs(dt, RANK)
                dist.reduce(t, 1 % SIZE, op=R.MAX, group=g)
                return t
            equal(red(HP), reference(dt, R.MAX) if RANK == 1 % SIZE else inputs(dt, RANK), f"reduce {dt} MAX")
            ts = [inputs(dt, RANK, 5), inputs(dt, RANK, 12)]
            dist.all_reduce_coalesced(ts, op=R.MIN, group=HP)
            equal(ts[1], reference(dt, R.MIN), f"all_reduce_coalesced {dt} MIN")
            m = inputs(dt, RANK).view(3, 4).t()            # non-contiguous, in place
            dist.all_reduce(m, op=R.PRODUCT, group=HP)
            equal(m, reference(dt, R.PRODUCT).view(3, 4).t(), f"all_reduce non-contiguous {dt} PRODUCT")
            checks += 4
    # broadcast of 0-dim tensors, every dtype
    for dt in (*DTYPES, torch.complex64):
        def bc(g, dt=dt):
            t = torch.tensor(RANK + 3, dtype=dt) if dt != torch.bool else torch.tensor(RANK == 0)
            dist.broadcast(t, SIZE - 1, group=g)
            return t
        a = bc(HP)
        assert a.dim() == 0, a
        exact = torch.tensor(SIZE + 2, dtype=dt) if dt != torch.bool else torch.tensor(SIZE == 1)
        equal(a, exact, f"broadcast 0-dim {dt}")
        ref = gloo_or_none(bc)
        if ref is not None:
            equal(a, ref, f"broadcast 0-dim {dt} vs gloo")
        checks += 1
    t = torch.tensor(RANK, dtype=torch.int64)                # Lightning's counter: 0-dim int64 AVG
    dist.all_reduce(t, op=R.AVG, group=HP)
    equal(t, torch.tensor(sum(range(SIZE)) // SIZE), "0-dim int64 AVG")
    checks += 1
    print(f"reduce OK {checks} checks on {SIZE} ranks (gloo refused {len(GLOO_REFUSED)})", flush=True)
    if os.environ.get("TORCH_DEFECTS_VERBOSE"):
        print(sorted(GLOO_REFUSED), flush=True)


def mode_empty():
    checks = 0
    for dt in (torch.float32, torch.int64, torch.int16, torch.bool):
        # all_to_all_single, rank 0 has no rows (it sends nothing, as MoE dispatch may): rank r
        # sends r rows to every other rank but 0; rank 0 receives from nobody
        def a2a(g, dt=dt):
            send = [0] + [RANK] * (SIZE - 1) if RANK else [0] * SIZE
            recv = [0] * SIZE if RANK == 0 else [j for j in range(SIZE)]
            inp = (torch.arange(sum(send) * 3).view(-1, 3) + 100 * RANK).to(dt)
            out = torch.full((sum(recv), 3), 7).to(dt)
            dist.all_to_all_single(out, inp, recv, send, group=g)
            return out
        got = a2a(HP)
        exact = torch.empty(0, 3, dtype=torch.int64)          # from rank j >= 1: its block for RANK
        for j in range(1, SIZE if RANK else 1):
            rows = torch.arange(j * (SIZE - 1) * 3).view(-1, 3) + 100 * j
            exact = torch.cat([exact, rows[(RANK - 1) * j:RANK * j]])
        equal(got, exact.to(dt), f"all_to_all_single with 0 rows on rank 0 {dt}")
        ref = gloo_or_none(a2a)
        if ref is not None:
            equal(got, ref, f"all_to_all_single with 0 rows on rank 0 {dt} vs gloo")

        def a2a_none(g, dt=dt):                              # every rank sends nothing
            out = torch.empty(0, 2, dtype=dt)
            dist.all_to_all_single(out, torch.empty(0, 2, dtype=dt), [0] * SIZE, [0] * SIZE, group=g)
            return out
        ref = gloo_or_none(a2a_none) if dt != torch.int16 else None     # gloo has no int16
        equal(a2a_none(HP), torch.empty(0, 2, dtype=dt) if ref is None else ref, f"all_to_all_single all empty {dt}")

        def a2a_even_empty(g, dt=dt):
            out = torch.empty(0, 4, dtype=dt)
            dist.all_to_all_single(out, torch.empty(0, 4, dtype=dt), group=g)
            return out
        ref = gloo_or_none(a2a_even_empty) if dt != torch.int16 else None
        equal(a2a_even_empty(HP), torch.empty(0, 4, dtype=dt) if ref is None else ref,
              f"all_to_all_single 0 rows, no splits {dt}")
        checks += 3
        empty = torch.empty(0, dtype=dt)
        for name, fn in (
                ("all_reduce", lambda g, e=empty: dist.all_reduce(e.clone(), group=g)),
                ("broadcast", lambda g, e=empty: dist.broadcast(e.clone(), 0, group=g)),
                ("all_gather", lambda g, e=empty: dist.all_gather([e.clone() for _ in range(SIZE)], e, group=g)),
                ("all_gather_into_tensor", lambda g, e=empty: dist.all_gather_into_tensor(e.clone(), e, group=g)),
                ("reduce_scatter_tensor", lambda g, e=empty: dist.reduce_scatter_tensor(e.clone(), e, group=g)),
                ("all_to_all", lambda g, e=empty: dist.all_to_all([e.clone() for _ in range(SIZE)],
                                                                  [e.clone() for _ in range(SIZE)], group=g)),
                ("reduce", lambda g, e=empty: dist.reduce(e.clone(), 0, group=g)),
                ("all_reduce BXOR", lambda g, e=empty: dist.all_reduce(e.clone(), op=R.BXOR, group=g)
                 if dt != torch.float32 else None)):
            fn(HP)
            checks += 1
    t = torch.arange(4.0) + RANK                             # the group still works afterwards
    dist.all_reduce(t, group=HP)
    equal(t, torch.arange(4.0) * SIZE + sum(range(SIZE)), "all_reduce after the empty ones")
    print(f"empty OK {checks} checks on {SIZE} ranks", flush=True)


def _train(model, steps, seed_base=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * RANK + step + seed_base)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = (model(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def mode_powersgd():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP
    results = []
    for group in (HP, GLOO):
        model = DDP(_tiny(), process_group=group)       # one bucket: the hook's collectives in one order
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                   min_compression_rate=0.5, random_seed=0)
        model.register_comm_hook(state, psgd.powerSGD_hook)
        results.append(_train(model, 6))
        assert state.iter >= 6, state.iter
    equal(results[0], results[1], "PowerSGD DDP hpcring vs gloo")
    plain = _train(DDP(_tiny(), process_group=GLOO), 6)   # compression did change the result
    assert not torch.allclose(plain, results[1]), "PowerSGD did not compress"
    # a collective waited on inside a then() callback of an hpcring future, directly
    t = torch.ones(3)
    fut = dist.all_reduce(t, group=HP, async_op=True).get_future()

    def again(f):
        u = f.value()[0] * 2
        dist.all_reduce(u, group=HP)                        # issued and waited on in the callback
        return u
    equal(fut.then(again).wait(), torch.full((3,), 2.0 * SIZE * SIZE), "all_reduce inside then()")
    print(f"powersgd OK on {SIZE} ranks: max |hpcring - gloo| = {float((results[0] - results[1]).abs().max()):.3g}",
          flush=True)


def mode_compile():
    from torch.nn.parallel import DistributedDataParallel as DDP
    results = []
    for group in (HP, GLOO):
        torch._dynamo.reset()
        model = DDP(_tiny(), process_group=group)
        results.append(_train(torch.compile(model), 3))
    equal(results[0], results[1], "torch.compile(DDP) hpcring vs gloo")
    print(f"compile OK on {SIZE} ranks", flush=True)


def mode_lightning(backend):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    dist.init_process_group(backend)        # Lightning keeps a group it finds initialized

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _tiny()

        def training_step(self, batch, _idx):
            x, y = batch
            loss = (self.net(x) - y).square().mean()
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, _idx):
            x, y = batch
            self.log("val_loss", (self.net(x) - y).square().mean(), sync_dist=True)   # AVG of an int64 count
            self.log("val_rows", torch.tensor(x.shape[0] + dist.get_rank()), sync_dist=True, reduce_fx="sum")
            self.log("val_rank_mean", torch.tensor(dist.get_rank() * 3 + 1), sync_dist=True)   # int64 AVG

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    data = torch.utils.data.TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 4, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer = L.Trainer(strategy=DDPStrategy(process_group_backend=backend.split(":")[-1]), accelerator="cpu",
                        devices=size, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                        use_distributed_sampler=False)
    trainer.fit(Tiny(), loader, loader)
    m = {k: round(float(v), 5) for k, v in sorted(trainer.callback_metrics.items())}
    print(f"lightning OK rank={rank} metrics={m}", flush=True)


def main():
    modes = sys.argv[1].split(",")
    if modes[0] == "lightning":
        mode_lightning(sys.argv[2])
        return
    setup()
    for m in modes:
        globals()[f"mode_{m}"]()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

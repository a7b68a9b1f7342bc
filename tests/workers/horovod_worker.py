"""Rank program for tests/integration/test_horovod_local.py (run under `hpcring run`).

Each mode checks one behaviour of hpcring.torch and prints ``OK <mode> rank <r>`` on success; a
failed check raises (non-zero exit)."""
from __future__ import annotations

import sys

import torch

import hpcring.torch as hvd
from hpcring.errors import CollectiveError


def model_and_data(steps: int, per_rank: int, size: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(per_rank * size, 6, generator=g) for _ in range(steps)]
    ys = [torch.randn(per_rank * size, 3, generator=g) for _ in range(steps)]
    return model, xs, ys


def train(compression: str, passes: int) -> None:
    r, n, steps, per = hvd.rank(), hvd.size(), 4, 4
    ref, xs, ys = model_and_data(steps, per, n)
    dist, _, _ = model_and_data(steps, per, n)
    if r == 0:                        # other ranks start different: broadcast_parameters fixes it
        pass
    else:
        with torch.no_grad():
            for p in dist.parameters():
                p.add_(1.0)
    hvd.broadcast_parameters(dist.state_dict(), root_rank=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(dist.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=dist.named_parameters(),
                                   compression=getattr(hvd.Compression, compression),
                                   backward_passes_per_step=passes)
    for x, y in zip(xs, ys):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()     # the global batch, one process
        ref_opt.step()
        opt.zero_grad()
        mine_x, mine_y = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        for mx, my in zip(mine_x.chunk(passes), mine_y.chunk(passes)):
            (torch.nn.functional.mse_loss(dist(mx), my) / passes).backward()
        opt.step()
    tol = 2e-3 if compression == "fp16" else 1e-5
    for (name, a), b in zip(dist.named_parameters(), ref.parameters()):
        if not torch.allclose(a, b, atol=tol, rtol=tol):
            raise AssertionError(f"{name}: max diff {(a - b).abs().max().item()} > {tol}")
    moved = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model_and_data(1, 1, 1)[0].parameters()))
    assert moved > 1e-3, "training did not change the parameters"


def optimizer_state() -> None:
    r = hvd.rank()
    for make in (lambda ps: torch.optim.Adam(ps, lr=0.01 * (r + 1)),
                 lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
        torch.manual_seed(r)                   # rank-dependent model, data and state
        m = torch.nn.Linear(4, 2)
        opt = make(m.parameters())
        for _ in range(r + 1):
            opt.zero_grad()
            m(torch.randn(3, 4)).sum().backward()
            opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        sds = hvd.allgather_object({k: v for k, v in opt.state_dict().items()})
        for other in sds[1:]:
            assert other["param_groups"] == sds[0]["param_groups"], (other["param_groups"], sds[0]["param_groups"])
            for pid, st in sds[0]["state"].items():
                for k, v in st.items():
                    assert torch.equal(torch.as_tensor(other["state"][pid][k]), torch.as_tensor(v)), (pid, k)
        assert sds[0]["state"], "root had optimizer state"


def collectives() -> None:
    r, n = hvd.rank(), hvd.size()
    g = hvd.allgather(torch.full((r + 1, 2), float(r)))           # first dimension differs by rank
    assert g.shape == (n * (n + 1) // 2, 2), g.shape
    assert g[:, 0].tolist() == [float(i) for i in range(n) for _ in range(i + 1)], g
    a, b = hvd.grouped_allgather([torch.tensor([r]), torch.ones(r + 2, dtype=torch.float64)])
    assert a.tolist() == list(range(n)) and b.numel() == sum(i + 2 for i in range(n))
    x = torch.tensor([1.0 + r, 2.0])
    assert torch.allclose(hvd.allreduce(x), torch.tensor([1 + (n - 1) / 2, 2.0]))       # Average default
    assert hvd.allreduce(x, op=hvd.Sum)[0].item() == sum(1 + i for i in range(n))
    assert hvd.allreduce(x, op=hvd.Max)[0].item() == n and hvd.allreduce(x, op=hvd.Min)[0].item() == 1
    assert hvd.allreduce(torch.tensor([2.0]), op=hvd.Product).item() == 2.0 ** n
    assert hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)[1].item() == 2.0 * n
    y = torch.tensor([float(r)])
    hvd.allreduce_(y, op=hvd.Sum, name="inplace")
    assert y.item() == sum(range(n))
    outs = hvd.grouped_allreduce([torch.ones(3), torch.ones(2, dtype=torch.float64) * r], op=hvd.Sum)
    assert outs[0].tolist() == [n] * 3 and outs[1].tolist() == [sum(range(n))] * 2
    h = hvd.allreduce_async(torch.ones(5), name="async", op=hvd.Sum)
    assert hvd.synchronize(h).tolist() == [n] * 5 and hvd.poll(h)
    assert hvd.allreduce(torch.ones(4), compression=hvd.Compression.fp16).dtype == torch.float32
    z = torch.full((3,), float(r))
    hvd.broadcast_(z, root_rank=n - 1)
    assert z.tolist() == [n - 1.0] * 3
    assert hvd.broadcast(torch.tensor([r]), root_rank=0).item() == 0
    out = hvd.alltoall(torch.arange(n * 2) + 100 * r)               # equal splits
    assert out.tolist() == [100 * i + 2 * r + k for i in range(n) for k in range(2)], out
    splits = torch.tensor([j + 1 for j in range(n)])                # rank r sends j+1 rows to j
    rows, got = hvd.alltoall(torch.full((int(splits.sum()), 2), float(r)), splits=splits)
    assert got.tolist() == [r + 1] * n and rows[:, 0].tolist() == [float(i) for i in range(n) for _ in range(r + 1)]
    rs = hvd.reducescatter(torch.ones(2 * n + 1, 2), op=hvd.Sum)
    assert rs.shape == (2 + (r < 1), 2) and rs.eq(n).all(), rs
    assert hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(("x", r)) == [("x", i) for i in range(n)]
    hvd.barrier()
    if r == 0:                      # join: rank 0 stops early, the others keep reducing
        last = hvd.join()
    else:
        s = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after-join")
        assert s.item() == n - 1, s
        last = hvd.join()
    assert 0 <= last < n


def syncbn() -> None:
    """SyncBatchNorm on per-rank shards == BatchNorm on the global batch: outputs, input
    gradients, summed weight gradients and running statistics."""
    r, n, per = hvd.rank(), hvd.size(), 3
    x = torch.randn(per * n, 4, 5, generator=torch.Generator().manual_seed(7)) * 2 + 1
    w = torch.randn(per * n, 4, 5, generator=torch.Generator().manual_seed(8))
    ref, sbn = torch.nn.BatchNorm1d(4), hvd.SyncBatchNorm(4)
    xr = x.clone().requires_grad_()
    ro = ref(xr)
    (ro * w).sum().backward()
    xs = x[r * per:(r + 1) * per].clone().requires_grad_()
    out = sbn(xs)
    (out * w[r * per:(r + 1) * per]).sum().backward()
    assert torch.allclose(out, ro[r * per:(r + 1) * per].detach(), atol=1e-5), "forward"
    assert torch.allclose(xs.grad, xr.grad[r * per:(r + 1) * per], atol=1e-5), "input gradient"
    gw = hvd.allreduce(sbn.weight.grad, op=hvd.Sum)
    assert torch.allclose(gw, ref.weight.grad, atol=1e-4), (gw, ref.weight.grad)
    assert torch.allclose(sbn.running_var, ref.running_var, atol=1e-4), "running_var"


def mismatch() -> None:
    try:
        hvd.allreduce(torch.ones(3), name=f"grad.layer{hvd.rank()}")
    except CollectiveError as e:
        print(f"DIAG rank {hvd.rank()}: {e}", flush=True)
        sys.exit(3)


def missing() -> None:
    if hvd.rank() == 1:
        import time
        time.sleep(30)               # never submits: rank 0's negotiation must fail by the deadline
        return
    try:
        hvd.allreduce(torch.ones(3), name="grad.fc")
    except CollectiveError as e:
        print(f"DIAG rank {hvd.rank()}: {e}", flush=True)
        import os
        os._exit(3)


def timeline() -> None:
    model, xs, ys = model_and_data(3, 2, hvd.size())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for x, y in zip(xs, ys):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def cycles() -> None:
    """What starts a fusion cycle. A 30 ms pause in the middle of each backward pass (a hook on
    the hidden activation) separates the last layer's gradients from the first layer's: time-based
    cycles would negotiate on both sides of it."""
    import time
    eng = hvd.state.engine()
    model, xs, ys = model_and_data(3, 2, hvd.size())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())

    def steps():
        c0, t0 = eng.stats["cycles"], time.monotonic()
        for x, y in zip(xs, ys):
            opt.zero_grad()
            h = model[1](model[0](x))
            h.register_hook(lambda g: time.sleep(0.03))
            torch.nn.functional.mse_loss(model[2](h), y).backward()
            opt.step()
        return eng.stats["cycles"] - c0, time.monotonic() - t0

    saved = eng.threshold, eng.cycle_s
    try:
        n, _ = steps()             # auto: host gradients wait for the step's whole set
        assert n == len(xs), f"auto cycle: {n} negotiations for {len(xs)} steps"
        # ... but other work does not wait with them (the hold's backstop is 1 s): a metric
        # allreduced from inside the backward pass, with the last layer's gradients queued
        took = []

        def metric(g):
            t = time.monotonic()
            hvd.allreduce(torch.ones(1), name="metric.in.backward")
            took.append(time.monotonic() - t)
        opt.zero_grad()
        h = model[1](model[0](xs[0]))
        h.register_hook(metric)
        torch.nn.functional.mse_loss(model[2](h), ys[0]).backward()
        opt.step()
        assert took[0] < 0.5, f"an allreduce next to held gradients took {took[0]:.2f} s"
        # a set that never completes (here: a name nobody submits) is released by the backstop
        eng.expect(opt, opt._expected + ["never.submitted"])
        t = time.monotonic()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
        opt.step()                 # synchronize() expects the real set again
        assert 0.5 < time.monotonic() - t < 10, f"backstop: the step took {time.monotonic() - t:.2f} s"
        eng.cycle_s = 60.0         # the last expected gradient ends even a 60 s cycle
        n, dt = steps()
        assert n == len(xs) and dt < 20, f"60 s cycle: {n} negotiations, {dt:.1f} s for {len(xs)} steps"
        eng.threshold = 64         # every gradient fills the buffer: it starts a cycle at once
        n, dt = steps()
        assert n >= 2 * len(xs) and dt < 20, f"full buffer: {n} negotiations, {dt:.1f} s for {len(xs)} steps"
    finally:
        eng.threshold, eng.cycle_s = saved


if __name__ == "__main__":
    hvd.init()
    checks = {"syncbn": syncbn, "optstate": optimizer_state, "collectives": collectives, "mismatch": mismatch, "missing": missing,
              "timeline": timeline, "cycles": cycles}
    for mode in sys.argv[1:]:          # several checks per job: ranks import torch once
        if mode.startswith("train:"):  # train:<compression>:<backward passes>
            _, comp, passes = mode.split(":")
            train(comp, int(passes))
        else:
            checks[mode]()
        print(f"OK {mode} rank {hvd.rank()}", flush=True)
    hvd.shutdown()

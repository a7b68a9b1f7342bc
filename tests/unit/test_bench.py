"""hpcring.bench: busbw factors, the nccl-tests table, deterministic data and #wrong counting.

Collectives run on a thread-simulated world (ThreadComm: every rank is a thread, results computed
directly with numpy from all ranks' real inputs), so the expected-value side of the benchmark is
checked against an independent implementation, and deliberate corruption must be counted exactly.
"""
import threading

import numpy as np
import pytest

from hpcring.bench import cases as BC, data as BD, options as BO, run as BR, table as BT
from hpcring.errors import UsageError


# ---------------------------------------------------------------------------------------------
# busbw factors, sizes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,ar,ag", [(1, 0.0, 0.0), (2, 1.0, 0.5), (3, 4 / 3, 2 / 3), (4, 1.5, 0.75), (8, 1.75, 0.875)])
def test_busbw_factors(n, ar, ag):
    assert BC.busbw_factor("allreduce", n) == pytest.approx(ar)
    for c in ("allgather", "reduce_scatter", "alltoall"):
        assert BC.busbw_factor(c, n) == pytest.approx(ag)
    assert BC.busbw_factor("broadcast", n) == 1.0
    with pytest.raises(UsageError):
        BC.busbw_factor("reduce", n)


def test_make_row_bandwidths():
    r = BT.make_row("allreduce", "float32", "sum", 0, 4, 1 << 20, 1 << 18, 1e-3, 0)
    assert r.algbw == pytest.approx((1 << 20) / 1e-3 / 1e9)
    assert r.busbw == pytest.approx(r.algbw * 1.5)
    assert (r.type, r.redop, r.root, r.time_us) == ("float", "sum", -1, pytest.approx(1000.0))
    b = BT.make_row("broadcast", "bfloat16", "sum", 2, 4, 100, 50, 1e-6, 3)
    assert (b.type, b.redop, b.root, b.wrong, b.busbw) == ("bfloat16", "none", 2, 3, pytest.approx(b.algbw))


@pytest.mark.parametrize("text,want", [("8", 8), ("4K", 4096), ("1M", 1 << 20), ("64MiB", 64 << 20),
                                       ("1.5K", 1536), ("2G", 2 << 30), (16, 16)])
def test_parse_size(text, want):
    assert BO.parse_size(text) == want


def test_parse_size_rejects_garbage():
    with pytest.raises(UsageError):
        BO.parse_size("lots")


def test_size_list_like_nccl_tests():
    assert BO.size_list(8, 128, 2) == [8, 16, 32, 64, 128]
    assert BO.size_list(8, 100, 4) == [8, 32]
    assert BO.size_list(4096, 4096, 2) == [4096]
    with pytest.raises(UsageError):
        BO.size_list(64, 8, 2)


def test_counts_round_to_a_multiple_of_ranks():
    assert BC.counts_for("allreduce", 1000, 4, 3) == (250, 250, 1000)
    assert BC.counts_for("allgather", 1000, 4, 3) == (249, 83, 996)
    assert BC.counts_for("reduce_scatter", 1000, 4, 3) == (249, 83, 996)
    assert BC.counts_for("alltoall", 40, 2, 4) == (20, 5, 40)


# ---------------------------------------------------------------------------------------------
# the table: nccl-tests' exact columns
# ---------------------------------------------------------------------------------------------
def test_row_matches_nccl_tests_line():
    # a line copied from nccl-tests' all_reduce_perf output (out-of-place columns)
    want = "           8             2     float     sum      -1    18.47    0.00    0.00      0"
    row = BT.Row(size=8, count=2, type="float", redop="sum", root=-1, time_us=18.47, algbw=0.0, busbw=0.0, wrong=0)
    assert BT.format_row(row) == want


@pytest.mark.parametrize("us,text", [(18.474, "  18.47"), (123.45, "  123.5"), (9999.94, " 9999.9"),
                                     (12345.6, "  12346"), (1234567.0, "1234567")])
def test_time_formatting(us, text):
    row = BT.Row(1, 1, "float", "sum", -1, us, 1.0, 1.0, 0)
    assert BT.format_row(row)[54:61] == text


def test_header_columns_line_up_with_rows():
    head, units = BT.format_header().splitlines()
    row = BT.format_row(BT.Row(67108864, 16777216, "bfloat16", "prod", 3, 96926.1, 0.69, 1.38, 12))
    assert len(head) == len(row)
    # every header word ends in the same column as the value below it
    names = ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"]
    values = row.split()
    for name, value in zip(names, values):
        end_h = head.index(name) + len(name)
        end_v = row.index(value, end_h - len(value) - 20 if end_h > 30 else 0) + len(value)
        assert end_h == end_v, (name, head, row)
    assert head.startswith("#") and units.startswith("#")


def test_footer_reports_wrong_and_average():
    rows = [BT.Row(8, 2, "float", "sum", -1, 1.0, 0.1, 0.2, 0), BT.Row(16, 4, "float", "sum", -1, 1.0, 0.3, 0.4, 5)]
    text = BT.format_footer(rows)
    assert "Out of bounds values : 5 FAILED" in text
    assert "Avg bus bandwidth    : 0.3 " in text
    assert "0 OK" in BT.format_footer(rows[:1])


# ---------------------------------------------------------------------------------------------
# data patterns and expected values
# ---------------------------------------------------------------------------------------------
def test_bf16_conversion_round_trip_and_rounding():
    x = np.array([1.0, -2.5, 3.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 256.0], np.float32)
    bits = BD.f32_to_bf16_bits(x)
    back = BD.bf16_bits_to_f32(bits)
    np.testing.assert_array_equal(back, [1.0, -2.5, 3.0, 1.0, 1 + 2 ** -6, 256.0])   # nearest even


def test_patterns_are_deterministic_and_differ_between_ranks():
    a, b = BD.rank_pattern(0, "float32"), BD.rank_pattern(0, "float32")
    np.testing.assert_array_equal(a, b)
    assert len(a) == BD.PERIOD and not np.array_equal(a, BD.rank_pattern(1, "float32"))
    assert set(np.unique(BD.rank_pattern(3, "int32", "prod"))) <= {-1, 1, 2}


def test_tile_is_a_window_of_the_periodic_repetition():
    p = np.arange(7)
    np.testing.assert_array_equal(BD.tile(p, 5, 6), [5, 6, 0, 1, 2, 3])
    np.testing.assert_array_equal(BD.tile(p, 12, 3), [5, 6, 0])
    assert BD.tile(p, 0, 0).size == 0


def test_count_wrong_counts_each_bad_element():
    want = BD.tile(BD.rank_pattern(0, "float32"), 0, 5000)
    got = want.copy()
    assert BD.count_wrong(got, want, "float32") == 0
    got[[3, 999, 4999]] += 1
    assert BD.count_wrong(got, want, "float32") == 3
    got[10] = np.nan
    assert BD.count_wrong(got, want, "float32") == 4
    bits = BD.rank_pattern(1, "bfloat16")
    bad = bits.copy()
    bad[0] ^= 1                                     # one ulp off in bfloat16
    assert BD.count_wrong(bad, bits, "bfloat16") == 1
    # avg: one rounding of slack, not more
    w = np.array([1.0, 2.0], np.float16)
    assert BD.count_wrong(np.array([1.0, 2.0 + 2 ** -9], np.float16), w, "float16", "avg") == 0
    assert BD.count_wrong(np.array([1.0, 2.5], np.float16), w, "float16", "avg") == 1


def test_integer_sum_and_prod_wrap_like_the_dtype():
    p = [np.array([200, 3], np.uint8), np.array([100, 255], np.uint8)]
    np.testing.assert_array_equal(BD.reduce_patterns(p, "sum", "uint8"), [44, 2])
    np.testing.assert_array_equal(BD.reduce_patterns(p, "prod", "uint8"), [(200 * 100) % 256, (3 * 255) % 256])


# ---------------------------------------------------------------------------------------------
# end to end on a thread-simulated world
# ---------------------------------------------------------------------------------------------
class World:
    def __init__(self, n):
        self.n, self.bar, self.slots = n, threading.Barrier(n, timeout=30), [None] * n


class ThreadComm:
    """An independent reference implementation of the collectives (numpy on all ranks' inputs)."""

    backend_name, device = "reference", "cpu"

    def __init__(self, world, rank, corrupt=0):
        self.world, self.rank, self.size, self.corrupt = world, rank, world.n, corrupt

    def synchronize(self):
        pass

    def _all(self, x):
        w = self.world
        w.slots[self.rank] = np.array(x, copy=True).reshape(-1)
        w.bar.wait()
        got = list(w.slots)
        w.bar.wait()
        return got

    def _spoil(self, out):
        if self.corrupt and self.rank == 1 and out.size:
            bump = 0x100 if out.dtype == np.uint16 else 1          # bfloat16 bits: x4, else +1
            out.reshape(-1)[: self.corrupt] = out.reshape(-1)[: self.corrupt] + bump
        return out

    @staticmethod
    def _reduce(arrs, op, dtype):
        if dtype == "bfloat16":
            vals = np.stack([BD.bf16_bits_to_f32(a).astype(np.float64) for a in arrs])
        elif arrs[0].dtype.kind == "f":
            vals = np.stack(arrs).astype(np.float64)
        else:
            st = np.stack(arrs)
            f = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
            return f.reduce(st, axis=0, dtype=st.dtype)
        r = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max, "avg": np.mean}[op](vals, axis=0)
        return BD.f32_to_bf16_bits(r) if dtype == "bfloat16" else r.astype(arrs[0].dtype)

    def allreduce(self, x, op="sum", out=None, dtype=None):
        r = self._reduce(self._all(x), op, dtype)
        if out is None:
            return r
        out.reshape(-1)[:] = r
        return self._spoil(out)

    def reduce_scatter(self, x, op="sum", out=None, dtype=None):
        r = self._reduce(self._all(x), op, dtype)
        per = r.size // self.size
        out.reshape(-1)[:] = r[self.rank * per:(self.rank + 1) * per]
        return self._spoil(out)

    def allgather(self, x, out=None, dtype=None):
        out.reshape(-1)[:] = np.concatenate(self._all(x))
        return self._spoil(out)

    def alltoall(self, x, out=None, dtype=None):
        xs = self._all(x)
        per = xs[0].size // self.size
        out.reshape(-1)[:] = np.concatenate([xq[self.rank * per:(self.rank + 1) * per] for xq in xs])
        return self._spoil(out)

    def broadcast(self, x, root=0, dtype=None):
        x.reshape(-1)[:] = self._all(x)[root]
        return self._spoil(x)

    def barrier(self):
        self._all(np.zeros(1))


def run_world(n, fn, corrupt=0):
    world, results, errors = World(n), [None] * n, []

    def body(r):
        try:
            results[r] = fn(ThreadComm(world, r, corrupt))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            world.bar.abort()

    ts = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errors:
        raise errors[0]
    return results


CASES = [(c, d, o) for c in BC.COLLECTIVES for d in ("float32", "float16", "bfloat16", "int32", "uint8")
         for o in (("sum", "prod", "min", "max") + (("avg",) if d in ("float32", "float16", "bfloat16") else ())
                   if c in BC.REDUCING else ("sum",))]


@pytest.mark.parametrize("collective,dtype,op", CASES)
def test_checks_pass_on_a_correct_world_and_count_corruption(collective, dtype, op):
    n, total = 3, 3 * 1100 + 3          # not a multiple of the pattern period

    def one(comm):
        case = BC.make_case(comm, collective, dtype, op, 1, total)
        case.run()
        return case.check()

    assert run_world(n, one) == [0, 0, 0]
    assert run_world(n, one, corrupt=5) == [0, 5, 0]


def test_broadcast_check_does_not_trust_stale_buffers():
    """A backend that never moves data must be caught: non-root buffers start from the sentinel."""
    class Lazy(ThreadComm):
        def broadcast(self, x, root=0, dtype=None):
            self._all(x)
            return x

    world = World(2)
    out = [None, None]

    def body(r):
        case = BC.make_case(Lazy(world, r), "broadcast", "float32", "sum", 0, 100)
        case.run()
        out[r] = case.check()

    ts = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    assert out == [0, 100]


def test_run_bench_rows_and_summed_wrong():
    opts = BO.BenchOptions(collective="allreduce", minbytes=64, maxbytes=1024, factor=4, iters=2, warmup=1)
    emitted = []
    rows = run_world(2, lambda c: BR.run_bench(c, opts, emitted.append if c.rank == 0 else None), corrupt=2)
    assert [r.size for r in rows[0]] == [64, 256, 1024]
    assert [r.count for r in rows[0]] == [16, 64, 256]
    assert all(r.wrong == 2 for r in rows[0])            # summed over ranks (rank 1 corrupts 2 elements)
    assert rows[0] == rows[1]                            # every rank returns the same table
    assert emitted == [BT.format_row(r) for r in rows[0]]
    assert all(r.busbw == pytest.approx(r.algbw) for r in rows[0])   # 2(n-1)/n = 1 for n = 2


def test_options_validation():
    with pytest.raises(UsageError):
        BO.BenchOptions(collective="reduce").check()
    with pytest.raises(UsageError):
        BO.BenchOptions(dtype="complex64").check()
    with pytest.raises(UsageError):
        BO.BenchOptions(dtype="int32", op="avg").check()
    assert BO.BenchOptions(dtype="bf16").check().dtype == "bfloat16"


def test_plot_without_matplotlib_is_a_clear_usage_error(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(UsageError, match="--plot needs matplotlib"):
        BO.BenchOptions(plot="x.png").check()


def test_cli_parses_into_options(cli, monkeypatch):
    import typer

    from hpcring.cli.bench_cmd import register
    seen = {}
    monkeypatch.setattr(BR, "bench_main", lambda o, r, n: seen.update(opts=o, ranks=r, nodes=n) or 0)
    app = typer.Typer()
    register(app)
    res = cli("-c", "alltoall", "-b", "1K", "-e", "16M", "-f", "4", "-d", "float16", "-n", "4", "--iters", "3",
              "--json", "out.json", app=app)
    assert res.exit_code == 0, res.output
    o = seen["opts"]
    assert (o.collective, o.minbytes, o.maxbytes, o.factor, o.dtype, o.iters, o.json) == \
        ("alltoall", 1024, 16 << 20, 4.0, "float16", 3, "out.json")
    assert seen["ranks"] == 4
    # and the spawned ranks get the same options back
    argv = BR.to_argv(o)
    assert argv[argv.index("-e") + 1] == str(16 << 20) and argv[argv.index("--collective") + 1] == "alltoall"


def test_in_rank_detection():
    assert BR.in_rank({"HPCRING_SESSION": "{}"})
    assert not BR.in_rank({"PATH": "/usr/bin"})


def test_gpu_backend_times_device_buffers_by_default_and_labels_host_staging(monkeypatch):
    """nccl-tests times device memory: on a cuda backend the buffers are CuPy arrays (here the fake
    CuPy/NCCL of helpers.fake_cuda, one rank), every row is checked, and host buffers only on request."""
    import sys
    import helpers.fake_cuda as F

    from hpcring.collectives import nccl as N
    from hpcring.collectives.api import Communicator
    cp = F.make_cupy(ngpus=1)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    nc = F.FakeNcclComm(cp, 1, 0, 0)
    comm = Communicator(N.NcclBackend(nc, 0, 1, 0, hosts=("gpu0",), cupy=cp, nccl=F.make_nccl_module([nc]),
                                      version=22000), timeout=5.0)
    for coll in ("allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall"):
        opts = BO.BenchOptions(collective=coll, minbytes=64, maxbytes=4096, factor=8, iters=2, warmup=1)
        rows = BR.run_bench(comm, opts)
        assert [r.wrong for r in rows] == [0, 0, 0], coll
        case = BC.make_case(comm, coll, "float32", "sum", 0, 1024, xp=BC.device_module(comm, "auto"))
        cp.host_copies_allowed = False          # the timed call moves no byte through the host
        case.run()
        comm.synchronize()
        cp.host_copies_allowed = True
        assert case.check() == 0
    assert BC.memory_label(comm, "auto").startswith("device (CuPy arrays on GPU 0)")
    assert "staged through the GPU" in BC.memory_label(comm, "host")
    assert BC.device_module(comm, "host") is None
    with pytest.raises(UsageError, match="--memory device needs a GPU backend"):
        BC.device_module(ThreadComm(World(1), 0), "device")
    with pytest.raises(UsageError, match="--memory"):
        BO.BenchOptions(memory="pinned").check()
    comm.close()

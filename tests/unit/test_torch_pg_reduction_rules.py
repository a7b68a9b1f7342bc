"""hpcring.distributed without a job: the reduction plans (AVG on integers as NCCL,
bool/int8/int16, BAND/BOR/BXOR) on a simulated allreduce, 0-dim byte views, and completions that
never run on a communicator's worker thread (a collective waited on inside Future.then)."""
import threading

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from hpcring.collectives.engine import Worker  # noqa: E402
from hpcring.distributed import work  # noqa: E402
from hpcring.distributed.process_group import _bytes, _reduction  # noqa: E402

R = dist.ReduceOp
_HPCRING = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}


def simulate(op, tensors):
    """Every rank's tensor after all_reduce(op), as the process group does it, with hpcring's
    allreduce simulated in its wide dtype (integer sums and products wrap, as the ring's)."""
    red = _reduction(op, "all_reduce", tensors[0].dtype, len(tensors))
    bufs = [t.clone() for t in tensors]
    if red.fold is not None:
        acc = bufs[0]
        for b in bufs[1:]:
            acc = red.fold(acc, b)
        return [acc.clone() for _ in bufs]
    wides = [red.encode(b) for b in bufs]
    acc = wides[0].clone()
    for w in wides[1:]:
        acc = _HPCRING[red.op](acc, w)
    for w, b in zip(wides, bufs):
        w.copy_(acc)
        red.decode(w, b)
    return bufs


def t(values, dtype):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("dtype,values,want", [
    (torch.int64, [[-7, 5, 9], [2, 0, 0]], [-2, 2, 4]),                # truncated, not floored (-5/2)
    (torch.int32, [[1], [2], [2]], [1]),
    (torch.uint8, [[200], [100]], [22]),                               # sum wraps in uint8: 44 / 2
    (torch.int8, [[100], [100], [-3]], [-19]),                         # 197 wraps to -59; -59 / 3
    (torch.int16, [[30000], [30000]], [-2768]),                        # 60000 wraps to -5536; / 2
])
def test_avg_on_integers_is_the_wrapped_sum_truncated_as_nccl(dtype, values, want):
    got = simulate(R.AVG, [t(v, dtype) for v in values])
    for g in got:
        assert g.dtype == dtype and g.tolist() == want


def test_int8_and_int16_wrap_in_their_type_as_gloo():
    a, b = t([100, -128, 7], torch.int8), t([100, -1, -9], torch.int8)
    assert simulate(R.SUM, [a, b])[0].tolist() == (a + b).tolist() == [-56, 127, -2]
    assert simulate(R.PRODUCT, [a, b])[0].tolist() == (a * b).tolist()
    assert simulate(R.MIN, [a, b])[0].tolist() == [100, -128, -9]
    c, d = t([300, -32768], torch.int16), t([300, 32767], torch.int16)
    assert simulate(R.PRODUCT, [c, d])[0].tolist() == (c * d).tolist()


@pytest.mark.parametrize("op,want", [
    (R.SUM, [True, True, False]), (R.MAX, [True, True, False]), (R.BOR, [True, True, False]),
    (R.PRODUCT, [True, False, False]), (R.MIN, [True, False, False]), (R.BAND, [True, False, False]),
    (R.BXOR, [True, True, False]),                                     # parity of each column
])
def test_bool_reductions_as_nccl_and_gloo(op, want):
    ranks = [t([True, True, False], torch.bool), t([True, False, False], torch.bool), t([True, False, False], torch.bool)]
    got = simulate(op, ranks)
    assert got[0].dtype == torch.bool and got[0].tolist() == want


def test_bool_min_max_reduce_in_place_through_a_uint8_view():
    red = _reduction(R.MAX, "all_reduce", torch.bool, 2)
    buf = t([False, True], torch.bool)
    wide = red.encode(buf)
    assert wide.dtype == torch.uint8 and wide.data_ptr() == buf.data_ptr()


@pytest.mark.parametrize("op,fn", [(R.BAND, torch.bitwise_and), (R.BOR, torch.bitwise_or),
                                   (R.BXOR, torch.bitwise_xor)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_bitwise_ops_on_integers_fold_in_rank_order(op, fn, dtype):
    ranks = [t([0b1100, -1, 5], dtype) if dtype != torch.uint8 else t([12, 255, 5], dtype),
             t([0b1010, 6, 3], dtype), t([0b0110, 3, 1], dtype)]
    want = fn(fn(ranks[0], ranks[1]), ranks[2])
    assert simulate(op, ranks)[1].tolist() == want.tolist()


def test_floats_keep_hpcring_own_ops():
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert all(_reduction(op, "x", dt, 3).native for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG))
    assert _reduction(R.SUM, "x", torch.int64, 3).native and not _reduction(R.AVG, "x", torch.int64, 3).native


def test_a_0_dim_tensor_moves_as_its_bytes_in_place():
    x = torch.tensor(-2, dtype=torch.int16)
    b = _bytes(x)
    assert b.dtype == torch.uint8 and b.numel() == 2 and b.data_ptr() == x.data_ptr()
    b.copy_(_bytes(torch.tensor(513, dtype=torch.int16)))
    assert int(x) == 513
    assert _bytes(torch.tensor(True)).tolist() == [1]


def test_a_collective_waited_on_inside_then_does_not_wait_on_its_own_thread():
    """PowerSGD's hook: the callback of one op's future issues another op on the same
    communicator and waits for it. The first op's completion must not run on the worker thread
    that the second op needs (before: a silent hang, past every deadline)."""
    w = Worker("hpcring-test-worker")
    names = []

    def op(v):
        return lambda: v

    first = work.chain([w.submit("op#1", op(1))], lambda: names.append(threading.current_thread().name) or ["first"])

    def callback(fut):
        assert fut.value() == ["first"]
        inner = work.chain([w.submit("op#2", op(2))], lambda: ["inner"])
        return inner.get_future().wait()[0]
    out = []
    waiter = threading.Thread(target=lambda: out.append(first.get_future().then(callback).wait()), daemon=True)
    waiter.start()
    waiter.join(20)
    assert out == ["inner"], "the callback's collective never completed (it waited on its own thread)"
    assert names and names[0] != "hpcring-test-worker"
    w.stop()


def test_nested_waits_get_threads_and_keep_order():
    """Completions whose callbacks block on later completions, three deep, all finish."""
    c = work.Completer()
    done = [threading.Event() for _ in range(4)]
    order = []

    def level(i):
        def fn():
            order.append(i)
            if i < 3:
                c.submit(level(i + 1))
                assert done[i + 1].wait(10)
            done[i].set()
        return fn
    c.submit(level(0))
    assert done[0].wait(20)
    assert order == [0, 1, 2, 3]

"""hpcring.distributed without a job: the creator's checks and the op/dtype refusals (real torch)."""
import datetime
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import hpcring.session  # noqa: E402
from hpcring.distributed import _create, _seconds  # noqa: E402
from hpcring.distributed.process_group import _reduction  # noqa: E402
from hpcring.errors import UsageError  # noqa: E402

R = dist.ReduceOp


@pytest.fixture
def session(monkeypatch):
    s = SimpleNamespace(rank=1, size=4, host="nodeB")
    monkeypatch.setattr(hpcring.session, "_SESSION", s)
    return s


def opts(rank, size, members=None, timeout=None):
    from torch.distributed.constants import default_pg_timeout
    return SimpleNamespace(group_rank=rank, group_size=size, global_ranks_in_group=members,
                           timeout=timeout or default_pg_timeout)


def test_registered_for_cpu_and_cuda():
    assert "hpcring" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["hpcring"] == ["cpu", "cuda"]


def test_whole_job_group_is_created_with_the_session(session):
    pg = _create(opts(1, 4, [0, 1, 2, 3]))
    assert (pg.rank(), pg.size(), pg.getBackendName()) == (1, 4, "hpcring")


def test_rank_disagreeing_with_the_session_is_refused(session):
    with pytest.raises(UsageError, match="torch says rank 2 of 4, but the hpcring session on nodeB is rank 1 of 4"):
        _create(opts(2, 4))


def test_default_torch_timeout_leaves_hpcring_deadline_explicit_one_is_used():
    from torch.distributed.constants import default_pg_timeout
    assert _seconds(default_pg_timeout) is None
    assert _seconds(datetime.timedelta(seconds=42)) == 42.0


@pytest.mark.parametrize("op,dtype,words", [
    (R.BAND, torch.float32, "ReduceOp.BAND needs an integer or bool tensor"),
    (R.BOR, torch.bfloat16, "ReduceOp.BOR"),
    (R.BXOR, torch.float64, "ReduceOp.BXOR"),
    (R.SUM, torch.uint16, "cannot reduce torch.uint16"),
    (R.SUM, torch.complex64, "cannot reduce torch.complex64"),
    (R.AVG, torch.bool, "AVG cannot average bool"),
])
def test_unsupported_reductions_are_refused(op, dtype, words):
    with pytest.raises(UsageError, match=words):
        _reduction(op, "all_reduce", dtype, 2)


def test_premul_sum_is_refused():
    op = dist._make_nccl_premul_sum(2.0)
    with pytest.raises(UsageError, match="PREMUL_SUM is not supported"):
        _reduction(op, "all_reduce", torch.float32, 2)


def test_supported_reductions_map_to_hpcring_ops():
    got = [_reduction(op, "x", torch.float32, 2).op for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG)]
    assert got == ["sum", "prod", "min", "max", "avg"]


# ---------------------------------------------------------------------------------------------
# Work completion: host (from a completion thread) vs stream-ordered (device collectives)
# ---------------------------------------------------------------------------------------------
from hpcring.collectives.engine import Handle  # noqa: E402
from hpcring.distributed.work import chain, cuda_devices, last  # noqa: E402
from hpcring.errors import CollectiveError  # noqa: E402


def _settled(w, timeout=10.0):
    """``w`` once its future is done: host completions run on a completion thread of their own."""
    import time
    end = time.monotonic() + timeout
    while not w.get_future().done() and time.monotonic() < end:
        time.sleep(0.001)
    return w


def _handles(n, stream=False):
    hs = [Handle(f"allreduce#{i}") for i in range(n)]
    for h in hs:
        h.cuda_event = object() if stream else None
    return hs


def test_host_work_finishes_when_the_last_handle_completes():
    hs, calls = _handles(2), []
    w = chain(hs, lambda: calls.append("finish") or ["out"])
    assert not w.is_completed() and calls == []
    hs[0]._set(1)
    assert not w.is_completed()
    hs[1]._set(2)
    assert _settled(w).is_completed() and w.is_success() and calls == ["finish"]
    assert w.get_future().value() == ["out"]


def test_host_work_carries_the_first_error():
    hs = _handles(2)
    w = chain(hs, lambda: ["out"])
    hs[0]._set(error=CollectiveError("allreduce#0 timed out"))
    hs[1]._set(2)
    assert _settled(w).is_completed() and not w.is_success()
    assert "allreduce#0" in str(w.exception())
    with pytest.raises(CollectiveError):
        w.wait()


def test_stream_ordered_work_enqueues_its_copies_at_once_and_never_blocks():
    hs, calls = _handles(2, stream=True), []
    w = chain(hs, lambda: calls.append("finish") or ["out"])
    # the copy-outs went on the stream right behind the collectives; the future is complete
    assert calls == ["finish"] and w.get_future().done() and w.get_future().value() == ["out"]
    assert w.wait() is True                       # returns with the GPU work still pending
    assert not w.is_completed()                   # ... which the handles still say
    hs[0]._set(1)
    hs[1]._set(error=CollectiveError("allreduce#1: NCCL async error on gpu0"))
    assert w.is_completed() and not w.is_success()
    assert "allreduce#1" in str(w.exception())


def test_a_failed_enqueue_is_not_stream_ordered():
    hs = _handles(1, stream=True)
    hs[0].cuda_event = None                        # the enqueue failed: a finished, failed handle
    hs[0]._set(error=CollectiveError("allreduce#0 failed to start"))
    w = chain(hs, lambda: ["out"])
    with pytest.raises(CollectiveError, match="failed to start"):
        w.wait()


def test_coalesced_stream_ordered_works_stay_stream_ordered():
    a, b = _handles(1, stream=True), _handles(1, stream=True)
    w = last([chain(a, lambda: ["a"]), chain(b, lambda: ["b"])], ["a", "b"])
    w.wait()
    assert w.get_future().value() == ["a", "b"] and not w.is_completed()
    a[0]._set(1)
    b[0]._set(1)
    assert w.is_completed() and w.is_success()


def test_cuda_devices_of_a_result_on_the_cpu_is_empty():
    assert cuda_devices([[torch.zeros(2)], torch.ones(1)]) == []

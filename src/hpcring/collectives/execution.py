"""How a Communicator's calls run: on its worker thread or in the caller's (host backends), or
enqueued on the caller's stream (stream-ordered backends); the failure path and the precheck."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from hpcring.collectives.arrays import CudaContext, active_on, kind_of
from hpcring.collectives.engine import Handle
from hpcring.collectives.precheck import precheck_message, signature_code
from hpcring.collectives.recorder import FlightRecorder, Record
from hpcring.errors import CollectiveError
from hpcring.ranks import globalize
from hpcring.config import envvars


class Execution:
    """Mixed into :class:`~hpcring.collectives.api.Communicator`: a call's execution."""

    def _deadline(self, timeout: float | None) -> float:
        if timeout is None:             # the hot path: no import, no check
            return self.timeout
        return envvars.collective_timeout(timeout, "timeout")

    def _record(self, op: str, dtype: str | None, count: int, root: int | None, timeout: float) -> Record:
        return self.recorder.queue(op, dtype, count, root, timeout)

    def _run(self, rec: Record, fn: Callable[[], Any], is_async: bool, dev: "CudaContext | None" = None):
        if self._ordered is not None:
            return self._run_ordered(rec, fn, is_async, dev)

        def execute():
            FlightRecorder.start(rec)
            try:
                if self.precheck and self.size > 1:
                    self._precheck(rec)
                result = fn()
            except BaseException as e:
                raise self._failed(rec, e) from None
            FlightRecorder.finish(rec)
            return result
        name = f"{rec.op}#{rec.seq}"
        if is_async:
            return self._worker.submit(name, execute)
        if self._worker.pending:
            return self._worker.submit(name, execute).wait()
        return execute()

    def _failed(self, rec: Record, e: BaseException) -> BaseException:
        """Record a failed collective; a CollectiveError goes through the watchdog (which may end
        the process) and comes back with the job-wide report."""
        if self.members is not None and type(e) is CollectiveError:
            e = CollectiveError(globalize(e.message, self.members), hint=e.hint)
        FlightRecorder.finish(rec, e)
        if isinstance(e, CollectiveError) and self.watchdog is not None:
            return self.watchdog.on_failure(self, rec, e)
        return e

    def _run_ordered(self, rec: Record, fn, is_async: bool, dev):
        """A stream-ordered (device) backend: enqueue in the caller's thread -- the order of
        enqueues is the order of the collectives, the same on every rank -- and return without
        waiting for the GPU. The completion event is recorded after everything ``fn`` put on the
        caller's stream (unpacking included); :class:`_Completions` completes record and handle."""
        FlightRecorder.start(rec)
        try:
            if self.precheck and self.size > 1:
                self._precheck(rec)
            with active_on(dev):
                result = fn()
        except BaseException as e:
            err = self._failed(rec, e)
            if not is_async:
                raise err from None
            h = Handle(f"{rec.op}#{rec.seq}")
            h._set(error=err)
            return h
        pending = self.backend.take_pending()
        h = Handle(f"{rec.op}#{rec.seq}") if is_async else None
        if pending is None:             # staged or blocking: already complete
            FlightRecorder.finish(rec)
            if h is not None:
                h._set(result)
            return h if is_async else result
        if dev is not None:
            pending.event.record(dev.stream)
        if h is not None:
            h.cuda_event = pending.event
        self._ordered.add(rec, pending, h, result)
        return h if is_async else result

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every collective issued so far has completed (device collectives run
        asynchronously on their streams; host ones are waited for by their handles). Raises the
        first failure."""
        if self._ordered is not None:
            self._ordered.drain(timeout)
        elif self._worker.pending:
            self._worker.submit("synchronize", lambda: None).wait(timeout)
        if self.backend.error is not None:
            raise CollectiveError(self.error)

    def _precheck(self, rec: Record) -> None:
        """HPCRING_CHECK_COLLECTIVES=1: every rank's (op, dtype, count, root) through a 40-byte
        allgather before the collective itself; a difference fails at once on every rank."""
        mine = np.array(signature_code(rec), dtype=np.int64)
        table = np.empty(self.size * mine.size, dtype=np.int64)
        self.backend.allgather(mine, table, "int64", rec.timeout)
        rows = [tuple(int(v) for v in row) for row in table.reshape(self.size, mine.size)]
        if len(set(rows)) > 1:
            raise CollectiveError(precheck_message(rec.seq, rows),
                                  hint="every rank must call the same collectives in the same order with "
                                       "the same sizes, dtypes and roots")

    def _cuda(self, *arrays) -> CudaContext | None:
        """For a ``device == "cuda"`` backend: its GPU and the caller's stream for this call
        (torch's current stream when any of ``arrays`` is a CUDA torch tensor, else CuPy's);
        None for a host backend (device arrays are then staged through host memory)."""
        be = self.backend
        if getattr(be, "device", "cpu") != "cuda":
            return None
        cp = getattr(be, "array_module", None)
        if cp is None:
            import cupy as cp
        torch_stream = any(kind_of(x) == "torch" and x.device.type == "cuda" for x in arrays)
        return CudaContext.capture(cp, int(getattr(be, "device_id", 0)), torch_stream=torch_stream)

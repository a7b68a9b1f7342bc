"""``HpcringWork``: what the hpcring process group's ops return, on the host or stream-ordered.

Two completions, chosen per op from what the communicator did:

* **host**: the collectives run on the communicator's worker thread (ring, MPI, staged buffers);
  the op's future completes after them, on a completion thread (below), and ``wait()``
  blocks the host until then;
* **stream-ordered**: every collective of the op was enqueued on torch's current CUDA stream
  (the NCCL backend; each handle carries a ``cuda_event``). The op's copy-outs are enqueued on
  that stream right after them and the Work is complete at once, as torch's own NCCL works are:
  its future is CUDA-aware (``Future(devices=...)`` records an event on the current stream), so
  ``wait()`` and ``get_future().wait()`` only order the consumer's stream after the op and the
  host never blocks. A failure found later by the poller (deadline, NCCL async error) goes
  through the watchdog, which ends the job with a report, as an NCCL async error does in torch;
  ``is_completed()`` and ``exception()`` read the handles.

Host completions (``finish()`` and ``set_result``, which runs torch's ``then()`` callbacks
inline) never run on a communicator's worker thread: a callback may issue a collective and
wait for it (PowerSGD's DDP hook does), and that collective runs on the worker thread. They
run on :data:`COMPLETER`'s threads instead (see :class:`Completer`).
"""
from __future__ import annotations

import collections
import datetime
import threading
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future


class HpcringWork(dist.Work):
    """A pending torch op: ``get_future()`` completes (result: the op's output tensors) when the
    last hpcring collective of the op finished (stream-ordered: at once, see the module note);
    ``wait()`` waits for that and raises its error."""

    def __init__(self, future: Future, handles: Sequence = ()) -> None:
        super().__init__()
        self._future = future
        self._handles = tuple(handles)     # stream-ordered ops only: the collectives behind it
        self._drive: Callable[[], None] | None = None   # point-to-point: see chain()
        self._driving = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        # The collectives carry hpcring's own deadline; torch's per-wait timeout is not needed
        # to end a hang (the communicator fails, or the watchdog ends the job, first). A
        # CUDA-aware future's wait() makes the current stream wait; it does not block the host.
        if self._drive is not None and not self._future.done():
            self._driving = True
            self._drive()
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        if self._handles:
            return all(h.done() for h in self._handles)
        return self._future.done()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        for h in self._handles:
            if h.done() and h.exception() is not None:
                return h.exception()
        try:
            self._future.value() if self._future.done() else None
        except Exception as e:  # noqa: BLE001 - the error is the answer
            return e
        return None

    def get_future(self) -> Future:
        return self._future

    def _source_rank(self) -> int:
        """A receive from any rank (``recv_anysource``): the sender's group rank, once done."""
        h = getattr(self, "source", None)
        if h is None:
            raise RuntimeError("hpcring backend: source_rank() is only defined for a receive from any rank")
        self._future.wait()
        return int(h.result())

    source_rank = _source_rank


class HeldWork(HpcringWork):
    """A point-to-point op held for an NCCL group (ProcessGroupHpcring._hold): the first question
    asked of it starts the group (``flush``), then it answers as the real Work."""

    def __init__(self, flush: Callable[[], None]) -> None:
        super().__init__(Future())
        self._flush = flush
        self._real: HpcringWork | None = None
        self.source = None

    def resolve(self, real: HpcringWork, source=None) -> None:
        self._real, self.source = real, source

    def _get(self) -> HpcringWork:
        if self._real is None:
            self._flush()
        return self._real

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return self._get().wait(timeout)

    def is_completed(self) -> bool:
        return self._get().is_completed()

    def exception(self):
        return self._get().exception()

    def get_future(self) -> Future:
        return self._get().get_future()

    def _source_rank(self) -> int:
        self._get().wait()
        if self.source is None:
            raise RuntimeError("hpcring backend: source_rank() is only defined for a receive")
        return int(self.source.result())

    source_rank = _source_rank


class MessageWork(HpcringWork):
    """One point-to-point message of the Communicator's short path (a ShortMessage, see
    hpcring.collectives.mailbox): ``wait()`` waits on it in the calling thread and raises its
    error; the future is made only when asked for (``get_future``), then completed from the
    message's callback on a completion thread, so a failure reaches it at the deadline even if
    nobody waits. ``result``: the future's value (the op's tensors)."""

    def __init__(self, msg, result) -> None:
        dist.Work.__init__(self)
        self._msg, self._value = msg, result
        self._future = None
        self._handles = ()
        self._drive = None
        self._driving = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._msg.wait()            # the message's own deadline bounds it (see HpcringWork.wait)
        return True

    def is_completed(self) -> bool:
        return self._msg.done()

    def exception(self):
        return self._msg.exception()

    def get_future(self) -> Future:
        f = self._future
        if f is not None:
            return f
        with _FUTURE_LOCK:          # two threads asking at once get one future
            if self._future is not None:
                return self._future
            f = self._future = Future()
        msg, value = self._msg, self._value

        def settle(_m=None) -> None:
            err = msg.exception()
            if err is None:
                f.set_result(value)
            else:
                f.set_exception(err)
        if msg.done():
            settle()
        else:
            msg.add_done_callback(lambda m: COMPLETER.submit(settle))
        return f

    def _source_rank(self) -> int:
        return int(self._msg.wait())

    source_rank = _source_rank


_FUTURE_LOCK = threading.Lock()


class Completer:
    """Threads that run completions off the communicators' worker threads.

    A completion that finds no idle thread starts one, so a completion whose callback blocks
    on a later completion (a collective issued and waited on inside ``Future.then``) never waits
    for itself: the later one runs on another thread, and every wait stays bounded by the
    collectives' own deadlines. Completions start in submission order; idle threads exit after
    ``IDLE_S`` (in steady state one or two threads serve them all)."""

    IDLE_S = 10.0

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._idle = 0

    def submit(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._queue.append(fn)
            if self._idle >= len(self._queue):
                self._cv.notify()
                return
        try:
            threading.Thread(target=self._run, name="hpcring-torch-completion", daemon=True).start()
        except RuntimeError:            # interpreter shutdown: no new threads; complete here
            self._drain()

    def _drain(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    return
                fn = self._queue.popleft()
            _call(fn)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._idle += 1
                    woke = self._cv.wait(self.IDLE_S)
                    self._idle -= 1
                    if not woke and not self._queue:
                        return
                fn = self._queue.popleft()
            _call(fn)


def _call(fn) -> None:
    try:
        fn()
    except BaseException:  # noqa: BLE001 - a completion's bug must not end a completion thread
        import logging
        logging.getLogger("hpcring.distributed").exception("completion raised")


COMPLETER = Completer()


def done_work(result) -> HpcringWork:
    f = Future()
    f.set_result(result)
    return HpcringWork(f)


def stream_ordered(handles: Sequence) -> bool:
    """True when every handle is a device collective enqueued on the caller's stream."""
    return bool(handles) and all(getattr(h, "cuda_event", None) is not None for h in handles)


def chain(handles: list, finish: Callable[[], object]) -> HpcringWork:
    """A Work completed after ``handles`` (queued in this order on one communicator, so the last
    finishes last). ``finish()`` (copies out of staging buffers) gives the future's result.

    Stream-ordered handles (see :func:`stream_ordered`): ``finish()`` runs now, its copies
    enqueued on the same stream after the collectives, and the future, CUDA-aware on the
    result's devices, completes at once. Otherwise ``finish()`` runs when the
    last handle completes, and the first error of any handle fails the future instead."""
    if stream_ordered(handles):
        result = finish()
        devices = cuda_devices(result)
        fut = Future(devices=devices) if devices else Future()
        fut.set_result(result)
        return HpcringWork(fut, handles)
    fut = Future()
    once = threading.Lock()
    ran: list[bool] = []

    def on_done(_last) -> None:
        with once:                 # the completer and a driving waiter may both get here
            if ran:
                return
            ran.append(True)
        try:
            for h in handles:
                h.wait(0)          # done already: raises the op's error, if any
            fut.set_result(finish())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(e)
    if all(h.done() for h in handles):
        on_done(handles[-1])           # done already (a small send written inline): no thread hop
        return HpcringWork(fut)
    w = HpcringWork(fut)
    if all(hasattr(h, "drive") for h in handles):
        # point-to-point: wait() waits on the messages in its own thread and completes the
        # future there: no completer thread between the message and the waiter
        def drive() -> None:
            for h in handles:
                try:
                    h.wait()
                except Exception:  # noqa: BLE001 - on_done hands the error to the future
                    pass
            on_done(handles[-1])
        w._drive = drive

    def on_last(last_) -> None:
        if not w._driving:         # else the waiting thread completes the future itself
            COMPLETER.submit(lambda: on_done(last_))
    handles[-1].add_done_callback(on_last)
    return w


def last(works: list[HpcringWork], result) -> HpcringWork:
    """One Work for several queued on one communicator: the last completes last."""
    handles = [h for w in works for h in w._handles]
    if handles and all(w._handles for w in works):        # all stream-ordered: complete already
        return HpcringWork(works[-1].get_future().then(lambda _f: result), handles)

    def done(f):
        f.value()                       # raises the last op's error
        for w in works[:-1]:
            w.wait()                    # finished already; raises an earlier op's error
        return result
    return HpcringWork(works[-1].get_future().then(done))


def cuda_devices(result) -> list[torch.device]:
    """The distinct CUDA devices of the tensors in ``result`` (a tensor or nested lists of them),
    for a CUDA-aware future; [] when there are none."""
    found: dict[torch.device, None] = {}

    def visit(x) -> None:
        if isinstance(x, torch.Tensor):
            if x.device.type == "cuda":
                found[x.device] = None
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
    visit(result)
    return list(found)

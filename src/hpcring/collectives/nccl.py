"""NCCL backend: CuPy's ``cupy.cuda.nccl.NcclCommunicator`` (NCCL from nvidia-nccl-cu12).

* Creation (collective): rank 0 calls ``nccl.get_unique_id()`` (128 C chars) and publishes it
  through the rendezvous store as 128 raw bytes under ``nccl/<gen>/uid`` (never pickled); every
  rank reads it, selects ``cupy.cuda.Device(local_rank % ngpus)`` and calls
  ``NcclCommunicator(size, uid, rank)``.
* Buffers: CuPy arrays on this backend's GPU (the Communicator hands CuPy arrays and CUDA torch
  tensors over as CuPy views, without a copy; anything else with ``__cuda_array_interface__`` /
  CUDA DLPack is converted with ``cupy.from_dlpack`` without a copy). numpy buffers (what the
  Communicator hands over for host inputs) are staged through device memory.
* Device: every op makes ``cupy.cuda.Device(device_id)`` current for its duration (it may run on a
  thread whose current device is another GPU, e.g. the Communicator's worker), so staging and
  scratch buffers are allocated on the communicator's GPU.
* Streams: every op is enqueued on the *current* CuPy stream of that device
  (``cupy.cuda.get_current_stream()``; the Communicator makes the caller's stream current, torch's
  for torch tensors), so it is ordered after the caller's kernels, and returns a :class:`Pending`
  (the CUDA event recorded after it) without waiting for the GPU: results are valid in stream
  order, as with torch's NCCL process group. :meth:`NcclBackend.poll` checks the event,
  ``NcclCommunicator.check_async_error()`` and the deadline; the Communicator's poller thread
  calls it for every op in flight. Ops on host (numpy) buffers stage through the device and wait
  (they must hand back host memory), and so does ``barrier``.
* Unique id: CuPy >= 14 hands it out and takes it as ``bytes``, CuPy <= 13 as a tuple of 128
  signed chars; both travel through the store as 128 raw bytes (:func:`~hpcring.collectives.nccl_lib.uid_from_bytes`).
* One GPU per rank: before ``ncclCommInitRank`` every rank compares its GPU's PCI bus id with
  the other ranks of its host and refuses a shared GPU, naming the ranks.
* Deadline: NCCL has no timeout. On expiry (or an async error) the communicator is aborted
  (``abort()``, ncclCommAbort, which also unblocks the kernels of this rank) and a
  :class:`~hpcring.errors.CollectiveError` names the op, sequence number, count, dtype and the
  deadline. The backend stays failed (sticky error).
* dtypes: float16, bfloat16 (NCCL >= 2.10.3: ncclBfloat16; older NCCL: refused with a
  CollectiveError), float32, float64, int32, int64, uint8. ops: sum, prod, min, max; avg is
  ncclAvg (NCCL >= 2.10) else sum followed by a division on the device.
* reduce_scatter with a length not divisible by the size (uneven chunks, as the ring defines
  them) is done as an allreduce into a scratch buffer plus a copy of this rank's chunk.
* alltoall: grouped ncclSend/ncclRecv (NCCL >= 2.7).

Without cupy, or without a visible GPU, :meth:`NcclBackend.create` raises a CollectiveError
saying which is missing.
"""
from __future__ import annotations

import functools
import logging
import time

import numpy as np

from hpcring.collectives import nccl_raw
from hpcring.collectives.arrays import active_dev
from hpcring.collectives.backends import ITEMSIZE, LibraryBackend, chunk_counts
from hpcring.collectives.nccl_lib import (NCCL_DTYPE, NCCL_OP, SENDRECV_MIN_VERSION, _check_one_gpu_per_rank,
                                          _import_cupy, _init_rank, format_version, gpu_count, nccl_dtype, nccl_op,
                                          uid_takes_bytes, uid_to_bytes, wait_for)
from hpcring.errors import CollectiveError, UsageError
from hpcring.config import envvars

log = logging.getLogger("hpcring.collectives.nccl")
_U8 = NCCL_DTYPE["uint8"]          # byte-wise ops (allgather, broadcast) move bytes of any dtype

def _on_own_device(fn):
    """Run a collective with the backend's GPU current: the calling thread may have another
    device current, and staging/scratch buffers and the current stream must be this GPU's."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        dev = active_dev()
        if dev is not None and dev.device_id == self.device_id:   # the Communicator made it current
            return fn(self, *args, **kwargs)
        with self._cp.cuda.Device(self.device_id):
            return fn(self, *args, **kwargs)
    return wrapper


class Pending:
    """A device collective enqueued on a stream and not yet known to be complete: the CUDA event
    recorded after it, what it was (for messages) and its deadline."""

    __slots__ = ("event", "name", "seq", "desc", "t0", "timeout", "stream")

    def __init__(self, event, name: str, seq: int, desc: str, t0: float, timeout: float,
                 stream: int | None = None) -> None:
        self.event, self.name, self.seq, self.desc, self.t0, self.timeout = event, name, seq, desc, t0, timeout
        self.stream = stream            # the stream's pointer: ops on one stream complete in order

    @property
    def deadline(self) -> float:
        return self.t0 + self.timeout


class NcclBackend(LibraryBackend):
    """Collectives on one GPU per rank through an NCCL communicator.

    Stream-ordered: an op on device buffers is enqueued on the current stream and returns a
    :class:`Pending` (its completion event) without waiting for the GPU; :meth:`poll` tells
    whether it completed, checks NCCL's async error and enforces the deadline (aborting the
    communicator on expiry). Ops that stage host (numpy) buffers, and ``barrier``, wait for
    completion themselves (under the same deadline) and return None."""

    name = "nccl"
    label = "NCCL"
    device = "cuda"
    stream_ordered = True

    def __init__(self, comm, rank: int, size: int, device_id: int, *, hosts=None, cupy=None,
                 nccl=None, version: int | None = None) -> None:
        self._comm = comm
        self._init_state(rank, size, hosts)
        self.device_id = device_id
        self._cp, self._nccl = cupy, nccl
        self.version = int(version if version is not None else nccl.get_version())
        self._pending: Pending | None = None
        self._codes: dict = {}          # (dtype, op) -> (ncclDataType_t, ncclRedOp_t, divide after)
        self._spare_events: list = []   # completed events nobody holds, recorded again by later ops

    SPARE_EVENTS = 256

    def _event(self):
        """A completion event: a spare one when there is (creating one is a CUDA call and a
        Python object per op; recording a completed event again is what CUDA events are for)."""
        try:
            return self._spare_events.pop()
        except IndexError:
            return self._cp.cuda.Event(block=False, disable_timing=True)

    def recycle(self, p: Pending) -> None:
        """Take back the event of ``p``, complete and seen by nobody else (no handle exposes it)."""
        if len(self._spare_events) < self.SPARE_EVENTS:
            self._spare_events.append(p.event)

    def take_pending(self) -> Pending | None:
        """The newest op left in flight since the last call (the Communicator tracks it);
        None when every op since then completed before returning (staged, barrier)."""
        p, self._pending = self._pending, None
        return p

    # -- creation -------------------------------------------------------------------------
    @classmethod
    def create(cls, topology, store, secret=None, timeout: float | None = None, *,
               prefix: str = "nccl") -> "NcclBackend":
        """One NCCL communicator over ``topology``: rank 0's unique id through ``store`` under
        ``prefix`` (a group's own keys: hpcring.collectives.groups)."""
        cupy, nccl = _import_cupy()
        ngpus = gpu_count()
        if ngpus == 0:
            raise CollectiveError(f"the 'nccl' backend needs an NVIDIA GPU; none is visible on "
                                  f"{topology.host} (cupy.cuda.runtime.getDeviceCount() == 0 or no driver)",
                                  hint="run on GPU nodes (--gpus-per-node), check CUDA_VISIBLE_DEVICES, or use backend='mpi'/'ring'")
        t = envvars.collective_timeout(timeout)
        device_id = topology.local_rank % ngpus
        cupy.cuda.Device(device_id).use()
        gen = store.add(f"{prefix}/gen/{topology.rank}", 1)
        if prefix != "nccl":          # a group: its own keys (the GPU check reads nccl/<gen>/gpu/*)
            gen = f"{prefix.removeprefix('nccl/')}/{gen}"
        _check_one_gpu_per_rank(topology, store, gen, cupy, device_id, t)
        key = f"nccl/{gen}/uid"
        if topology.rank == 0:
            store.set(key, uid_to_bytes(nccl.get_unique_id()))
        try:
            raw = store.get(key, timeout=t)
        except Exception as e:  # noqa: BLE001 - store timeout / connection errors
            raise CollectiveError(f"NCCL communicator {gen}: rank {topology.rank} ({topology.host}) did not get "
                                  f"the unique id from rank 0 within {t:g} s: {e}") from None
        comm = _init_rank(nccl, topology, raw, uid_takes_bytes(cupy), device_id)
        return cls(comm, topology.rank, topology.size, device_id, hosts=topology.hosts, cupy=cupy, nccl=nccl)

    @classmethod
    def shrink(cls, parent: "NcclBackend", exclude, topology, timeout: float | None = None) -> "NcclBackend":
        """The communicator of ``parent``'s ranks not in ``exclude`` (``ncclCommShrink`` with
        NCCL_SHRINK_ABORT, no new unique id), as rank ``topology.rank`` of ``topology.size``:
        NCCL renumbers the survivors in their old order, which ``topology`` must follow
        (hpcring.elastic.nccl_round checks). Collective over the survivors; ``parent`` is
        aborted afterwards (its lost ranks cannot take part in a destroy)."""
        t = envvars.collective_timeout(timeout)
        lib = nccl_raw.load()
        if parent._freed or parent._comm is None:
            raise CollectiveError("the previous NCCL communicator was aborted (freed): nothing to shrink")
        parent._cp.cuda.Device(parent.device_id).use()
        raw = nccl_raw.shrink(lib, parent._comm, exclude, timeout=t, on_timeout=parent._free_now)
        size, rank = raw.size(), raw.rank_id()
        if (rank, size) != (topology.rank, topology.size):
            raw.abort()
            raise CollectiveError(f"ncclCommShrink made this rank {rank} of {size}, the elastic round says "
                                  f"{topology.rank} of {topology.size}: the survivors' order differs")
        parent._closed = True
        try:
            parent._free_now()
        except Exception as e:  # noqa: BLE001 - the new communicator is what matters now
            log.warning("ncclCommAbort of the shrunk parent failed: %s", e)
        return cls(raw, rank, size, parent.device_id, hosts=topology.hosts, cupy=parent._cp, nccl=parent._nccl,
                   version=parent.version)

    # -- Backend properties ---------------------------------------------------------------
    @property
    def array_module(self):
        """The CuPy module this backend's buffers belong to (the Communicator allocates device
        results and views CUDA tensors with it)."""
        return self._cp

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._comm is None or self._freed:
            return
        try:
            if self._error is None:
                self._freed = True
                self._comm.destroy()
            else:               # revoked (kept for a shrink that did not come): free it
                self._free_now()
        except Exception:  # noqa: BLE001
            pass

    # -- machinery ------------------------------------------------------------------------
    def _where(self) -> str:
        return f"rank {self._rank} ({self._host()}, GPU {self.device_id})"

    # elastic rounds set this: a failure revokes the communicator (ncclCommRevoke: its operations
    # end, it stays valid for ncclCommShrink) instead of aborting it (which frees it)
    keep_for_shrink = False
    _freed = False

    def _fail(self, msg: str, *, abort: bool) -> CollectiveError:
        if self._error is None:
            self._error = msg
            if abort and self._comm is not None:
                self._stop_comm()
        return CollectiveError(msg, hint="NCCL cannot recover a communicator after a timeout: it was aborted; "
                                         "find the missing rank (hpcring stacks) and restart")

    def _stop_comm(self) -> None:
        """End the operations in flight: revoke when the communicator is kept for a shrink and
        this NCCL can, else ncclCommAbort (the communicator is then gone)."""
        if self.keep_for_shrink:
            lib = nccl_raw.load()
            if nccl_raw.has_revoke(lib):
                try:
                    nccl_raw.revoke(lib, self._comm)
                    return
                except Exception as e:  # noqa: BLE001 - abort below
                    log.warning("ncclCommRevoke failed, aborting instead: %s", e)
        try:
            self._free_now()
        except Exception as e:  # noqa: BLE001
            log.warning("ncclCommAbort failed: %s", e)

    def _free_now(self) -> None:
        """ncclCommAbort: operations end and the communicator is freed (never twice)."""
        if self._freed or self._comm is None:
            return
        self._freed = True
        self._comm.abort()

    def abort(self, message: str) -> None:
        """Fail this communicator from any thread (an elastic round is lost): later calls raise
        ``message``; operations in flight end (revoke or abort, see :meth:`_stop_comm`)."""
        self._fail(message, abort=True)

    def _stream(self):
        return self._cp.cuda.get_current_stream()

    def _check_async(self, p: Pending) -> None:
        try:
            self._comm.check_async_error()
        except Exception as e:  # noqa: BLE001 - NcclError
            raise self._fail(f"{p.name}#{p.seq}{p.desc} failed on {self._where()}: NCCL async error: {e}",
                             abort=True) from None

    def _expired(self, p: Pending, waited: float) -> CollectiveError:
        return self._fail(f"{p.name}#{p.seq}{p.desc} did not complete within the {p.timeout:g} s deadline on "
                          f"{self._where()} (waited {waited:.2f} s): at least one rank has not entered it "
                          f"or is stuck; the NCCL communicator was aborted", abort=True)

    def poll(self, p: Pending, now: float | None = None) -> bool:
        """True once ``p`` completed on the GPU. Raises CollectiveError (the communicator is then
        aborted, the error sticky) on an NCCL async error or when ``p``'s deadline has passed."""
        if self._error is not None:
            raise CollectiveError(self._error)
        if p.event.done:
            return True
        self._check_async(p)
        now = time.monotonic() if now is None else now
        if now >= p.deadline:
            raise self._expired(p, now - p.t0)
        return False

    def wait(self, p: Pending) -> None:
        """Block (polling, 50 us doubling to 1 ms) until ``p`` completed or failed."""
        expired = wait_for(lambda: p.event.done, lambda: self._check_async(p), timeout=p.timeout, t0=p.t0)
        if expired is not None:
            raise self._expired(p, expired)

    def _launch(self, name, seq, desc, timeout, t0, stream, fn, host=None) -> Pending | None:
        """Enqueue ``fn`` (the NCCL call) on ``stream`` and record its completion event. With
        ``host`` (a (device, numpy) pair of a staged result) wait and copy back: None."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - NcclError at launch
            raise self._fail(f"{name}#{seq}{desc} failed to start on {self._where()}: {e}", abort=True) from None
        event = self._event()
        event.record(stream)
        p = Pending(event, name, seq, desc, t0, timeout, stream.ptr)
        if host is None or host[1] is None:
            self._pending = p
            return p
        self.wait(p)
        self.recycle(p)
        dev, out = host
        out[...] = self._cp.asnumpy(dev).reshape(out.shape)
        return None

    # -- buffers --------------------------------------------------------------------------
    def _device(self, buf, dtype: str):
        """(device array, host array to copy back into or None) for a 1-D buffer."""
        cp = self._cp
        if isinstance(buf, np.ndarray):
            return cp.asarray(buf), buf
        if isinstance(buf, cp.ndarray):
            return buf, None
        if hasattr(buf, "__cuda_array_interface__") or hasattr(buf, "__dlpack__"):
            return cp.from_dlpack(buf) if hasattr(buf, "__dlpack__") else cp.asarray(buf), None
        raise UsageError(f"the nccl backend takes CuPy arrays, CUDA DLPack tensors or numpy arrays, "
                         f"got {type(buf).__name__}")

    @staticmethod
    def _ptr(arr) -> int:
        return int(arr.data.ptr)

    # -- collectives ----------------------------------------------------------------------
    @_on_own_device
    def allreduce(self, sendbuf, recvbuf, dtype: str, op: str, timeout: float) -> Pending | None:
        codes = self._codes.get((dtype, op))
        if codes is None:           # checked once per (dtype, op): errors before a sequence number
            codes = self._codes[dtype, op] = (nccl_dtype(dtype, self.version, self._nccl),
                                              *nccl_op(op, dtype, self.version, self._nccl))
        ndt, nop, divide = codes
        seq = self._begin("allreduce")
        t0 = time.monotonic()
        desc = self._lazy_desc(recvbuf.size, dtype, op)
        s, shost = self._device(sendbuf, dtype)
        r, rhost = (s, shost) if sendbuf is recvbuf else self._device(recvbuf, dtype)
        stream = self._stream()

        def go():
            ps = self._ptr(s)
            self._comm.allReduce(ps, ps if r is s else self._ptr(r), r.size, ndt, nop, stream.ptr)
            if divide:
                self._divide(r, dtype)
        return self._launch("allreduce", seq, desc, timeout, t0, stream, go, (r, rhost))

    def enqueue(self, kind: str, s, r, dtype: str, op: str | None, root: int | None, timeout: float,
                stream) -> Pending:
        """The short path's collectives: ``kind`` is allreduce, allgather, broadcast (in place,
        ``r is s``) or reduce_scatter with equal chunks; ``s``/``r`` are C-contiguous CuPy arrays
        on this GPU, which is current, and ``stream`` is its current stream (the caller checked
        all of it, and ``root``'s range). Enqueues and returns the op's :class:`Pending`, with
        the same checks, sequence number and errors as the general methods, without their
        wrappers and closures."""
        divide = False
        if op is not None:
            codes = self._codes.get((dtype, op))
            if codes is None:       # checked once per (dtype, op): errors before a sequence number
                codes = self._codes[dtype, op] = (nccl_dtype(dtype, self.version, self._nccl),
                                                  *nccl_op(op, dtype, self.version, self._nccl))
            ndt, nop, divide = codes
        seq = self._begin(kind)
        t0 = time.monotonic()
        sp = s.data.ptr
        try:
            if kind == "allreduce":
                self._comm.allReduce(sp, sp if r is s else r.data.ptr, r.size, ndt, nop, stream.ptr)
            elif kind == "allgather":
                self._comm.allGather(sp, r.data.ptr, s.size * ITEMSIZE[dtype], _U8, stream.ptr)
            elif kind == "broadcast":
                self._comm.broadcast(sp, sp, s.size * ITEMSIZE[dtype], _U8, root, stream.ptr)
            else:
                self._comm.reduceScatter(sp, r.data.ptr, r.size, ndt, nop, stream.ptr)
            if divide:                  # avg before NCCL 2.10: a division kernel after it
                self._divide(r, dtype)
        except Exception as e:  # noqa: BLE001 - NcclError at launch
            raise self._fail(f"{kind}#{seq}{self._lazy_desc(s.size, dtype, op, root)} failed to start on "
                             f"{self._where()}: {e}", abort=True) from None
        event = self._event()
        event.record(stream)
        return Pending(event, kind, seq, self._lazy_desc(s.size, dtype, op, root), t0, timeout, stream.ptr)

    def _divide(self, arr, dtype: str) -> None:
        if dtype == "bfloat16":        # uint16 storage: divide in float32, round to nearest even
            bits = arr.view(self._cp.uint16).astype(self._cp.uint32) << 16
            f = bits.view(self._cp.float32) / self._size
            b = f.view(self._cp.uint32)
            arr.view(self._cp.uint16)[...] = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(self._cp.uint16)
        else:
            arr /= self._size

    @_on_own_device
    def allgather(self, sendbuf, recvbuf, dtype: str, timeout: float) -> Pending | None:
        seq = self._begin("allgather")
        t0 = time.monotonic()
        desc = self._lazy_desc(sendbuf.size, dtype)
        s, _ = self._device(sendbuf, dtype)
        r, rhost = self._device(recvbuf, dtype)
        n = s.size * ITEMSIZE[dtype]
        u8 = NCCL_DTYPE["uint8"]
        stream = self._stream()
        return self._launch("allgather", seq, desc, timeout, t0, stream,
                            lambda: self._comm.allGather(self._ptr(s), self._ptr(r), n, u8, stream.ptr), (r, rhost))

    @_on_own_device
    def reduce_scatter(self, sendbuf, recvbuf, dtype: str, op: str, timeout: float) -> Pending | None:
        ndt = nccl_dtype(dtype, self.version, self._nccl)
        nop, divide = nccl_op(op, dtype, self.version, self._nccl)
        seq = self._begin("reduce_scatter")
        t0 = time.monotonic()
        n = sendbuf.size
        counts = chunk_counts(n, self._size)
        desc = self._lazy_desc(n, dtype, op)
        s, _ = self._device(sendbuf, dtype)
        r, rhost = self._device(recvbuf, dtype)
        stream = self._stream()

        def even():
            self._comm.reduceScatter(self._ptr(s), self._ptr(r), counts[self._rank], ndt, nop, stream.ptr)
            if divide:
                self._divide(r, dtype)

        def uneven():                   # uneven chunks: allreduce + take this rank's chunk
            full = self._cp.empty_like(s)
            self._comm.allReduce(self._ptr(s), self._ptr(full), n, ndt, nop, stream.ptr)
            if divide:
                self._divide(full, dtype)
            off = sum(counts[:self._rank])
            r[...] = full[off:off + counts[self._rank]]
        with stream:
            return self._launch("reduce_scatter", seq, desc, timeout, t0, stream,
                                even if n % self._size == 0 else uneven, (r, rhost))

    @_on_own_device
    def broadcast(self, buf, root: int, dtype: str, timeout: float) -> Pending | None:
        if not (0 <= root < self._size):
            raise UsageError(f"broadcast: root {root} out of range for {self._size} ranks")
        seq = self._begin("broadcast")
        t0 = time.monotonic()
        desc = self._lazy_desc(buf.size, dtype, root=root)
        b, host = self._device(buf, dtype)
        n = b.size * ITEMSIZE[dtype]
        u8 = NCCL_DTYPE["uint8"]
        stream = self._stream()
        return self._launch("broadcast", seq, desc, timeout, t0, stream,
                            lambda: self._comm.broadcast(self._ptr(b), self._ptr(b), n, u8, root, stream.ptr),
                            (b, host))

    @_on_own_device
    def alltoall(self, sendbuf, recvbuf, dtype: str, timeout: float) -> Pending | None:
        if sendbuf.size % self._size:
            raise UsageError(f"alltoall: {sendbuf.size} elements cannot be split into {self._size} equal blocks")
        if self.version < SENDRECV_MIN_VERSION:
            raise CollectiveError(f"alltoall needs NCCL >= 2.7 (send/recv), this is {format_version(self.version)}")
        seq = self._begin("alltoall")
        t0 = time.monotonic()
        desc = self._lazy_desc(sendbuf.size, dtype)
        s, _ = self._device(sendbuf, dtype)
        r, rhost = self._device(recvbuf, dtype)
        stream = self._stream()
        if sendbuf is recvbuf or (s.data.ptr == r.data.ptr):
            with stream:                # ordered after the producer of s on the caller's stream
                s = s.copy()
        block = (s.size // self._size) * ITEMSIZE[dtype]
        u8 = NCCL_DTYPE["uint8"]
        sp, rp = self._ptr(s), self._ptr(r)

        def go():
            self._nccl.groupStart()
            try:
                for peer in range(self._size):
                    self._comm.send(sp + peer * block, block, u8, peer, stream.ptr)
                    self._comm.recv(rp + peer * block, block, u8, peer, stream.ptr)
            finally:
                self._nccl.groupEnd()
        return self._launch("alltoall", seq, desc, timeout, t0, stream, go, (r, rhost))

    # -- point-to-point -----------------------------------------------------------------------
    @_on_own_device
    def p2p_batch(self, ops, timeout: float, name: str = "p2p", seq: int = 0) -> Pending | None:
        """``ops``: ``[(kind, buf, peer)]`` ("send"/"recv", a 1-D byte buffer, the peer rank) as
        one NCCL group (ncclGroupStart, ncclSend/ncclRecv..., ncclGroupEnd) on the current stream,
        so their order does not matter; returns the :class:`Pending` of the group. NCCL has no
        tags and no receive from any rank: peers match in issue order per pair. Host (numpy)
        buffers are staged and waited for (None)."""
        if self.version < SENDRECV_MIN_VERSION:
            raise CollectiveError(f"send/recv need NCCL >= 2.7, this is {format_version(self.version)}")
        for kind, _, peer in ops:
            if peer is None:
                raise UsageError("the nccl backend cannot receive from any rank (NCCL has no wildcard receive)",
                                 hint="name the source rank, or receive CPU tensors (the ring backend can)")
        t0 = time.monotonic()
        stream = self._stream()
        bufs = [(kind, *self._device(buf, "uint8"), peer) for kind, buf, peer in ops]
        u8 = NCCL_DTYPE["uint8"]
        desc = " (" + ", ".join(f"{k} {'to' if k == 'send' else 'from'} rank {p} {d.nbytes} B" for k, d, _, p in bufs) + ")"

        def go():
            self._nccl.groupStart()
            try:
                for kind, d, _, peer in bufs:      # bytes: any dtype moves
                    (self._comm.send if kind == "send" else self._comm.recv)(self._ptr(d), d.nbytes, u8, peer,
                                                                             stream.ptr)
            finally:
                self._nccl.groupEnd()
        staged = [(d, h) for kind, d, h, _ in bufs if h is not None]
        p = self._launch(name, seq, desc, timeout, t0, stream, go)
        if not staged:
            return p
        self._pending = None
        self.wait(p)
        for (kind, d, h, _) in bufs:
            if kind == "recv" and h is not None:
                h[...] = self._cp.asnumpy(d).reshape(h.shape)
        return None

    @_on_own_device
    def barrier(self, timeout: float) -> None:
        """Blocks the host (a barrier orders processes, not streams) until every rank entered."""
        seq = self._begin("barrier")
        t0 = time.monotonic()
        stream = self._stream()
        with stream:
            one = self._cp.ones(1, dtype=self._cp.float32)
        f32 = NCCL_DTYPE["float32"]
        p = self._launch("barrier", seq, "", timeout, t0, stream, lambda: self._comm.allReduce(
            self._ptr(one), self._ptr(one), 1, f32, NCCL_OP["sum"], stream.ptr))
        self._pending = None
        self.wait(p)


__all__ = ["NcclBackend", "Pending"]

"""``ProcessGroupHpcring``: torch.distributed collectives on an hpcring Communicator.

Every op validates its tensors in the calling thread (a clear ``UsageError`` before anything is
sent, so a bad call never hangs), then queues one or more ``Communicator.*_async`` calls and
returns a :class:`~hpcring.distributed.work.HpcringWork`: its future completes once the
communicator's worker thread is done (``Handle.add_done_callback``, on a completion thread),
or, for CUDA tensors on NCCL, is stream-ordered like torch's NCCL works (see work.py). The caller never blocks, and every
collective carries hpcring's deadline, flight record, watchdog and hang report. Ops with no hpcring collective behind them
are composed of ones that exist (reduce = allreduce, gather = allgather, scatter = broadcast,
uneven all_to_all = padded alltoall; reductions hpcring has no kernel for: int8/int16 on an int32
copy, bool as uint8, AVG on integers as NCCL's sum-then-truncate, BAND/BOR/BXOR on integers as an
allgather and a fold, see :func:`_reduction`); send/recv are the communicator's point-to-point
(hpcring.collectives.mailbox on the ring, MPI_Isend/Irecv on MPI).
The ops run eagerly under torch.compile (a graph break, see the note at the end of the class).

Which communicator: CUDA tensors go to the session's default communicator (``backend="auto"``:
NCCL when a GPU is visible, see :func:`hpcring.collectives.choice.auto_backend`), CPU tensors to a host
communicator (the same one when the default is ring or MPI; else a ring communicator, created
on the first CPU op, collectively like every op).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from hpcring.collectives.dtypes import torch_dtypes
from hpcring.distributed import work
from hpcring.errors import UsageError

_K = ReduceOp.RedOpType
# torch reduce op -> hpcring op (hpcring's kernels); PREMUL_SUM has none and is refused.
_OPS = {_K.SUM: "sum", _K.PRODUCT: "prod", _K.MIN: "min", _K.MAX: "max", _K.AVG: "avg"}
# BAND/BOR/BXOR on integers: an allgather and a fold here (hpcring has no bitwise kernels)
_FOLDS = {_K.BAND: torch.bitwise_and, _K.BOR: torch.bitwise_or, _K.BXOR: torch.bitwise_xor}
# dtypes hpcring's kernels reduce; the others move as raw bytes in ops that do not reduce.
_REDUCE_DTYPES = torch_dtypes(torch)
# dtypes the process group reduces: hpcring's, and int8/int16 (on an int32 copy) and bool (as uint8)
_TORCH_REDUCE_DTYPES = (*_REDUCE_DTYPES, torch.int8, torch.int16, torch.bool)
_DEVICES = ("cpu", "cuda")
BACKEND_NAME = "hpcring"


class _Reduction:
    """How one torch reduction runs on hpcring: ``op`` (an hpcring op) on ``encode(t)``, then
    ``decode`` writes the result back in ``t``'s dtype; or, with ``fold``, an allgather and a
    local fold in rank order (BAND/BOR/BXOR on integers).

    ``wide``: the dtype hpcring reduces in (None: the tensor's own; int32 for int8/int16, whose
    results wrap back into their type; uint8 for bool, a view when ``view``); ``avg``: divide
    the sum by this many ranks, truncating towards zero, in the tensor's type (AVG on integers,
    as NCCL's ncclAvg does); ``bit``: keep the lowest bit (BXOR on bool as a uint8 sum)."""

    def __init__(self, op: str | None, wide: torch.dtype | None = None, *, view: bool = False, avg: int = 0,
                 bit: bool = False, fold=None) -> None:
        self.op, self.wide, self.view, self.avg, self.bit, self.fold = op, wide, view, avg, bit, fold

    @property
    def native(self) -> bool:
        """hpcring's own op on the tensor itself: no conversion, no post-processing."""
        return self.wide is None and not (self.avg or self.bit or self.fold)

    def encode(self, buf: torch.Tensor) -> torch.Tensor:
        if self.wide is None:
            return buf
        return buf.view(self.wide) if self.view else buf.to(self.wide)

    def decode(self, wide: torch.Tensor, buf: torch.Tensor) -> None:
        r = wide
        if self.bit:
            r = r & 1
        if self.avg:
            r = torch.div(r.to(buf.dtype), self.avg, rounding_mode="trunc")
        if r is not wide or not (self.wide is None or self.view):
            buf.copy_(r)


def _reduction(opts_op, what: str, dtype: torch.dtype, size: int) -> _Reduction:
    """The plan for ``opts_op`` on ``dtype`` over ``size`` ranks, or a UsageError (sent nothing).

    Integers: SUM/PRODUCT wrap around in the tensor's type; AVG is the SUM divided by the world
    size, truncated towards zero (NCCL's ncclAvg); BAND/BOR/BXOR as gloo. bool: SUM and MAX are
    a logical or, PRODUCT and MIN a logical and (as NCCL and gloo), BXOR a parity; AVG on bool
    is refused (as NCCL). Bitwise ops on floating-point tensors are refused (as gloo)."""
    kind = getattr(opts_op, "op", opts_op)
    name = getattr(kind, "name", str(kind))
    if kind not in _OPS and kind not in _FOLDS:
        raise UsageError(f"hpcring backend: {what} with ReduceOp.{name} is not supported",
                         hint="supported: SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR; "
                              "for PREMUL_SUM scale the tensor first and use SUM")
    if dtype not in _TORCH_REDUCE_DTYPES:
        raise UsageError(f"hpcring backend: {what} cannot reduce {dtype}",
                         hint="supported: " + ", ".join(str(d).replace("torch.", "") for d in _TORCH_REDUCE_DTYPES)
                              + "; convert first (t.float(), torch.view_as_real(t))")
    if dtype.is_floating_point:
        if kind in _FOLDS:
            raise UsageError(f"hpcring backend: {what} with ReduceOp.{name} needs an integer or bool tensor, "
                             f"got {dtype}")
        return _Reduction(_OPS[kind])
    if dtype == torch.bool:
        if kind == _K.AVG:
            raise UsageError(f"hpcring backend: {what} with ReduceOp.AVG cannot average bool tensors",
                             hint="as NCCL: use MAX (any) or MIN (all), or convert to an integer or float")
        if kind == _K.BXOR:
            return _Reduction("sum", torch.uint8, bit=True)
        return _Reduction("max" if kind in (_K.SUM, _K.MAX, _K.BOR) else "min", torch.uint8, view=True)
    if kind in _FOLDS:
        return _Reduction(None, fold=_FOLDS[kind])
    wide = torch.int32 if dtype in (torch.int8, torch.int16) else None
    if kind == _K.AVG:
        return _Reduction("sum", wide, avg=size)
    return _Reduction(_OPS[kind], wide)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when hpcring has its dtype, else its bytes (bool, int8, int16, complex, ...;
    a 0-dim tensor as one element): ops that only move data need no dtype."""
    if t.dtype in _REDUCE_DTYPES:
        return t
    return (t if t.dim() else t.reshape(1)).view(torch.uint8)


class ProcessGroupHpcring(dist.ProcessGroup):
    """torch.distributed process group whose collectives run on an hpcring session.

    ``session``: an :class:`hpcring.session.Session` (its topology gives rank and size);
    ``timeout``: deadline in seconds of every collective (None: the communicator's default,
    HPCRING_TIMEOUT or 300 s)."""

    def __init__(self, session, rank: int, size: int, timeout: float | None = None) -> None:
        super().__init__(rank, size)
        self._session = session
        self._timeout = timeout
        self._comms: dict[str, object] = {}
        self._name = ""
        self._held: list = []          # NCCL point-to-point messages not started yet (_hold)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    # torch reads a group's name from its C++ backends, which a Python group has none of; keep
    # the name torch assigns here (DeviceMesh, FSDP2 and functional collectives look groups up by it).
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<ProcessGroupHpcring rank {self.rank()}/{self.size()} comms {sorted(self._comms)}>"

    # -- communicators --------------------------------------------------------------------
    def _comm(self, tensors, what: str, *, flush: bool = True):
        """The communicator for tensors all on one device type (cpu or cuda). Held NCCL messages
        start first (``flush``): every op after them runs after them."""
        if flush and self._held:
            self._flush()
        kinds = {t.device.type for t in tensors}
        if len(kinds) != 1 or not kinds <= set(_DEVICES):
            raise UsageError(f"hpcring backend: {what} got tensors on {', '.join(sorted(str(t.device) for t in tensors))}",
                             hint="every tensor of one call must be on the CPU, or every one on CUDA")
        for t in tensors:
            if t.is_sparse or t.layout != torch.strided:
                raise UsageError(f"hpcring backend: {what} needs dense (strided) tensors, got layout {t.layout}")
        return self._comm_for(kinds.pop())

    def _comm_for(self, device_type: str):
        comm = self._comms.get(device_type)
        if comm is None:
            default = self._session.communicator(timeout=self._timeout)
            if device_type == "cpu" and default.device != "cpu":
                comm = self._session.communicator("ring", timeout=self._timeout)
            else:
                comm = default
            self._comms[device_type] = comm
        return comm

    def _t(self):
        return {"timeout": self._timeout}

    def _reduce_async(self, comm, buf: torch.Tensor, red: _Reduction):
        """Queue the reduction of ``buf`` (contiguous) over the ranks: (handle, fin); once the
        handle is done, ``fin()`` leaves the result in ``buf``."""
        if red.fold is not None:
            flat = torch.empty((self.size(), buf.numel()), dtype=buf.dtype, device=buf.device)
            h = comm.allgather_async(_bytes(buf), out=_bytes(flat), **self._t())

            def fold():
                acc = flat[0]
                for r in range(1, self.size()):
                    acc = red.fold(acc, flat[r])
                buf.copy_(acc.view(buf.shape))
            return h, fold
        wide = red.encode(buf)
        h = comm.allreduce_async(wide, red.op, out=wide, **self._t())
        return h, lambda: red.decode(wide, buf)

    def _reduce_scatter_via_allreduce(self, comm, flat: torch.Tensor, out: torch.Tensor, red: _Reduction):
        """reduce_scatter for a reduction hpcring has no kernel for: reduce all of ``flat`` (a
        scratch copy, contiguous), keep this rank's block."""
        n = out.numel()
        h, fin = self._reduce_async(comm, flat, red)

        def finish():
            fin()
            out.copy_(flat[self.rank() * n:(self.rank() + 1) * n].view(out.shape))
            return [out]
        return work.chain([h], finish)

    # -- allreduce ------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        t = _one(tensors, "all_reduce")
        red = _reduction(_opt(opts, "reduceOp", ReduceOp.SUM), "all_reduce", t.dtype, self.size())
        comm = self._comm([t], "all_reduce")
        buf = t if t.is_contiguous() else t.contiguous()
        h, fin = self._reduce_async(comm, buf, red)
        return work.chain([h], lambda: fin() or _copy_back(t, buf) or [t])

    def allreduce_coalesced(self, tensors, opts=None):
        tensors = list(tensors)
        if not tensors:
            return work.done_work([])
        op = _opt(opts, "reduceOp", ReduceOp.SUM)
        reds = [_reduction(op, "all_reduce_coalesced", t.dtype, self.size()) for t in tensors]
        comm = self._comm(tensors, "all_reduce_coalesced")
        bufs = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        if not all(r.native for r in reds):           # one reduction per tensor, queued in order
            started = [self._reduce_async(comm, b, r) for b, r in zip(bufs, reds)]
            return work.chain([h for h, _ in started], lambda: [fin() or _copy_back(t, b) or t
                                                               for (_, fin), t, b in zip(started, tensors, bufs)])
        h = comm.allreduce_grouped_async(bufs, reds[0].op, inplace=True, **self._t())
        return work.chain([h], lambda: [_copy_back(t, b) or t for t, b in zip(tensors, bufs)])

    # -- allgather ------------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        inp = _one(input_tensors, "all_gather")
        outs = _one(output_tensors, "all_gather output")
        _same_list(outs, inp, self.size(), "all_gather")
        comm = self._comm([inp, *outs], "all_gather")
        flat = torch.empty((self.size(), inp.numel()), dtype=inp.dtype, device=inp.device)
        h = comm.allgather_async(_bytes(inp.contiguous()), out=_bytes(flat), **self._t())

        def finish():
            for r, o in enumerate(outs):
                o.copy_(flat[r].view(o.shape))
            return [outs]
        return work.chain([h], finish)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002 - torch's names
        _check_pair(output, input, self.size(), "all_gather_into_tensor")
        comm = self._comm([output, input], "all_gather_into_tensor")
        buf = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        h = comm.allgather_async(_bytes(input.contiguous()), out=_bytes(buf), **self._t())
        return work.chain([h], lambda: _copy_back(output, buf) or [output])

    all_gather_single = _allgather_base          # torch >= 2.13's name for the same op

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        works = [self.allgather([outs], [inp]) for outs, inp in _zip(output_lists, input_list, "all_gather_coalesced")]
        return work.last(works, [list(o) for o in output_lists])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i) for o, i in _zip(outputs, inputs, "all_gather_into_tensor_coalesced")]
        return work.last(works, list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # -- broadcast ------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        t = _one(tensors, "broadcast")
        root = _opt(opts, "rootRank", 0)
        comm = self._comm([t], "broadcast")
        buf = t if t.is_contiguous() else t.contiguous()
        h = comm.broadcast_async(_bytes(buf), root, **self._t())
        return work.chain([h], lambda: _copy_back(t, buf) or [t])

    # -- reduce_scatter -------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        ins = _one(input_tensors, "reduce_scatter input")
        _same_list(ins, out, self.size(), "reduce_scatter")
        red = _reduction(_opt(opts, "reduceOp", ReduceOp.SUM), "reduce_scatter", out.dtype, self.size())
        comm = self._comm([out, *ins], "reduce_scatter")
        flat = torch.cat([i.reshape(-1) for i in ins])
        if not red.native:
            return self._reduce_scatter_via_allreduce(comm, flat, out, red)
        op = red.op
        buf = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        h = comm.reduce_scatter_async(flat, op, out=buf, **self._t())
        return work.chain([h], lambda: _copy_back(out, buf) or [out])

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        _check_pair(input, output, self.size(), "reduce_scatter_tensor")
        red = _reduction(_opt(opts, "reduceOp", ReduceOp.SUM), "reduce_scatter_tensor", output.dtype, self.size())
        comm = self._comm([output, input], "reduce_scatter_tensor")
        if not red.native:
            return self._reduce_scatter_via_allreduce(comm, input.reshape(-1).clone(), output, red)
        op = red.op
        buf = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        h = comm.reduce_scatter_async(input.contiguous().reshape(-1), op, out=buf, **self._t())
        return work.chain([h], lambda: _copy_back(output, buf) or [output])

    reduce_scatter_single = _reduce_scatter_base   # torch >= 2.13's name

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_base(o, i, opts) for o, i in _zip(outputs, inputs, "reduce_scatter_tensor_coalesced")]
        return work.last(works, list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- alltoall -------------------------------------------------------------------------
    def alltoall(self, output_tensors, input_tensors, opts=None):
        outs, ins = list(output_tensors), list(input_tensors)
        n = self.size()
        if len(outs) != n or len(ins) != n:
            raise UsageError(f"hpcring backend: all_to_all needs {n} input and {n} output tensors "
                             f"(one per rank), got {len(ins)} and {len(outs)}")
        _same_dtype([*outs, *ins], "all_to_all")
        comm = self._comm([*outs, *ins], "all_to_all")

        def finish(flat):
            for o, piece in zip(outs, torch.split(flat, [o.numel() for o in outs])):
                o.copy_(piece.view(o.shape))
            return outs
        return self._alltoall_flat(comm, torch.cat([i.reshape(-1) for i in ins]),
                                   [i.numel() for i in ins], [o.numel() for o in outs], finish, agree=True)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        n = self.size()
        _same_dtype([output, input], "all_to_all_single")
        comm = self._comm([output, input], "all_to_all_single")
        row = math.prod(input.shape[1:]) if input.dim() else 1   # splits count rows (dim 0); 0 rows too
        in_splits = _splits(input_split_sizes, input, n, "input")
        out_splits = _splits(output_split_sizes, output, n, "output")

        def finish(flat):
            if flat is not output:
                output.copy_(flat.view(output.shape))
            return [output]
        # without split sizes every rank sends equal blocks: no need to agree first
        return self._alltoall_flat(comm, input.contiguous().reshape(-1), [s * row for s in in_splits],
                                   [s * row for s in out_splits], finish,
                                   out=output if output.is_contiguous() else None,
                                   agree=bool(input_split_sizes or output_split_sizes))

    all_to_all_single = alltoall_base             # torch >= 2.13's name

    def _alltoall_flat(self, comm, flat, send_counts, recv_counts, finish, *, out=None, agree: bool):
        """Blocks of ``send_counts`` elements to each rank, ``recv_counts`` from each; ``finish(flat
        result)`` gives the op's result. Equal blocks everywhere: one alltoall; otherwise every
        block is padded to the job-wide largest. ``agree``: sizes may differ between ranks, so
        first agree on the block size and path (an allreduce(max) of two integers, waited for)."""
        import numpy as np
        n = self.size()
        block = max([*send_counts, *recv_counts], default=0)
        padded = len(set(send_counts) | set(recv_counts)) > 1
        if agree:          # every rank must take the same path with the same block size
            both = comm.allreduce(np.array([block, int(padded)], dtype=np.int64), "max", **self._t())
            block, padded = int(both[0]), bool(both[1])
        if not padded:
            res = out if out is not None else torch.empty_like(flat)
            h = comm.alltoall_async(_bytes(flat), out=_bytes(res), **self._t())
            return work.chain([h], lambda: finish(res))
        send = torch.zeros(n * block, dtype=flat.dtype, device=flat.device)
        pos = 0
        for j, c in enumerate(send_counts):
            send[j * block:j * block + c] = flat[pos:pos + c]
            pos += c
        recv = torch.empty_like(send)
        h = comm.alltoall_async(_bytes(send), out=_bytes(recv), **self._t())
        return work.chain([h], lambda: finish(torch.cat([recv[j * block:j * block + c]
                                                     for j, c in enumerate(recv_counts)])))

    # -- composed ops ---------------------------------------------------------------------
    def barrier(self, opts=None):
        comm = self._session.communicator(timeout=self._timeout)      # the default: no tensors to place
        return work.chain([comm.barrier_async(**self._t())], lambda: [])

    def reduce(self, tensors, opts=None):
        """All ranks reduce (one allreduce into a scratch copy); only the root's tensor changes."""
        t = _one(tensors, "reduce")
        red = _reduction(_opt(opts, "reduceOp", ReduceOp.SUM), "reduce", t.dtype, self.size())
        root = _opt(opts, "rootRank", 0)
        comm = self._comm([t], "reduce")
        scratch = t.contiguous().clone()
        h, fin = self._reduce_async(comm, scratch, red)

        def finish():
            fin()
            if self.rank() == root:
                t.copy_(scratch)
            return [t]
        return work.chain([h], finish)

    def gather(self, output_tensors, input_tensors, opts=None):
        """An allgather into scratch; the root copies out."""
        inp = _one(input_tensors, "gather")
        root = _opt(opts, "rootRank", 0)
        outs = list(output_tensors[0]) if (self.rank() == root and output_tensors) else []
        if self.rank() == root:
            _same_list(outs, inp, self.size(), "gather")
        comm = self._comm([inp, *outs], "gather")
        flat = torch.empty((self.size(), inp.numel()), dtype=inp.dtype, device=inp.device)
        h = comm.allgather_async(_bytes(inp.contiguous()), out=_bytes(flat), **self._t())

        def finish():
            for r, o in enumerate(outs):
                o.copy_(flat[r].view(o.shape))
            return [outs] if outs else []
        return work.chain([h], finish)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """The root's tensors broadcast as one buffer; each rank keeps its piece."""
        out = _one(output_tensors, "scatter")
        root = _opt(opts, "rootRank", 0)
        comm = self._comm([out], "scatter")
        flat = torch.empty((self.size(), out.numel()), dtype=out.dtype, device=out.device)
        if self.rank() == root:
            ins = list(input_tensors[0]) if input_tensors else []
            _same_list(ins, out, self.size(), "scatter")
            for r, i in enumerate(ins):
                flat[r].copy_(i.reshape(-1))
        h = comm.broadcast_async(_bytes(flat), root, **self._t())

        def finish():
            out.copy_(flat[self.rank()].view(out.shape))
            return [out]
        return work.chain([h], finish)

    # -- point-to-point ---------------------------------------------------------------------
    # Posted at once, never queued behind a collective (torch's contract: a batch of isend/irecv
    # cannot deadlock whatever its order); each with hpcring's deadline and a report naming the
    # pair, tag and size (hpcring.collectives.mailbox). Tensors move as raw bytes: any dtype.
    # On NCCL (stream-ordered) a lone ncclSend waits for its receiver on the stream, so messages
    # are held and started together as one NCCL group when any of them is waited for or another
    # op comes (torch's batch_isend_irecv gives a Python backend no coalescing hook).
    def send(self, tensors, dst, tag=0):
        t = _one(tensors, "send")
        comm = self._comm([t], "send", flush=False)
        buf = _bytes(t.contiguous())                      # kept alive by the closure until sent
        if _grouped(comm):
            return self._hold(comm, "send", t, buf, dst, tag, lambda: [t])
        h = comm.isend(buf, dst, tag, **self._t())
        if getattr(h, "short", False):                  # the Communicator's short path
            return work.MessageWork(h, [t])
        return work.chain([h], lambda: (buf, [t])[1])

    def recv(self, tensors, src, tag=0):
        return self._recv(tensors, src, tag, "recv")

    def recv_anysource(self, tensors, tag=0):
        return self._recv(tensors, None, tag, "recv (any source)")

    def _recv(self, tensors, src, tag, what: str):
        t = _one(tensors, what)
        comm = self._comm([t], what, flush=False)
        buf = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        if _grouped(comm):
            if src is None:
                raise UsageError("hpcring backend: recv from any source is not possible on NCCL (no wildcard "
                                 "receive)", hint="name the source rank, or receive a CPU tensor")
            return self._hold(comm, "recv", t, _bytes(buf), src, tag, lambda: _copy_back(t, buf) or [t])
        h = comm.irecv(_bytes(buf), src, tag, **self._t())
        if getattr(h, "short", False) and buf is t:     # the short path, received in place
            w = work.MessageWork(h, [t])
            w.source = h
            return w
        w = work.chain([h], lambda: _copy_back(t, buf) or [t])
        w.source = h
        return w

    def _hold(self, comm, kind: str, t, buf, peer, tag, finish):
        """Hold a message for the next NCCL group (see above)."""
        w = work.HeldWork(self._flush)
        self._held.append((comm, kind, buf, peer, tag, finish, w))
        return w

    def _flush(self) -> None:
        """Start the held messages as one group (one per communicator) on the current stream."""
        held, self._held = self._held, []
        by_comm: dict[int, list] = {}
        for item in held:
            by_comm.setdefault(id(item[0]), []).append(item)
        for items in by_comm.values():
            comm = items[0][0]
            handles = comm.batch_isend_irecv([(kind, buf, peer, tag) for _, kind, buf, peer, tag, _, _ in items])
            for (_, kind, _, _, _, finish, w), h in zip(items, handles):
                w.resolve(work.chain([h], finish), h if kind == "recv" else None)


# torch.compile: dynamo would trace into these Python methods (DDP's forward broadcasts buffers)
# and fail on the process group, an opaque object to it; run them eagerly, as gloo's C++ ops run.
for _name in ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "all_gather_single",
              "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single_coalesced",
              "broadcast", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
              "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "alltoall", "alltoall_base",
              "all_to_all_single", "barrier", "reduce", "gather", "scatter", "send", "recv", "recv_anysource"):
    setattr(ProcessGroupHpcring, _name, torch.compiler.disable(getattr(ProcessGroupHpcring, _name)))
del _name


# ---------------------------------------------------------------------------------------------
# argument checks: all raise UsageError in the calling thread, before anything is sent
# ---------------------------------------------------------------------------------------------
def _grouped(comm) -> bool:
    """Point-to-point on this communicator is held for a group (a stream-ordered backend: NCCL)."""
    return comm.stream_ordered


def _opt(opts, name: str, default):
    return default if opts is None else getattr(opts, name, default)


def _one(tensors, what: str):
    items = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    if len(items) != 1:
        raise UsageError(f"hpcring backend: {what} takes one tensor (or one list) per call, got {len(items)}",
                         hint="one process per device; call once per tensor")
    return items[0]


def _same_dtype(tensors, what: str) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise UsageError(f"hpcring backend: {what} got mixed dtypes {sorted(str(d) for d in dtypes)}")


def _same_list(tensors, like: torch.Tensor, size: int, what: str) -> None:
    """``tensors`` is one tensor per rank, each with ``like``'s dtype and element count."""
    if len(tensors) != size:
        raise UsageError(f"hpcring backend: {what} needs a list of {size} tensors (one per rank), got {len(tensors)}")
    for r, t in enumerate(tensors):
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise UsageError(f"hpcring backend: {what}: tensor {r} of the list is {t.dtype} {tuple(t.shape)}, "
                             f"but the single tensor is {like.dtype} {tuple(like.shape)}",
                             hint="every tensor of the list needs the single tensor's dtype and size")


def _check_pair(big: torch.Tensor, small: torch.Tensor, size: int, what: str) -> None:
    """``big`` holds ``size`` times ``small``'s elements, same dtype."""
    if big.dtype != small.dtype:
        raise UsageError(f"hpcring backend: {what}: dtypes differ ({big.dtype} vs {small.dtype})")
    if big.numel() != size * small.numel():
        raise UsageError(f"hpcring backend: {what}: the large tensor has {big.numel()} elements, "
                         f"need world size {size} x {small.numel()}")


def _splits(sizes, t: torch.Tensor, n: int, what: str) -> list[int]:
    rows = t.shape[0] if t.dim() else 1
    if not sizes:
        if rows % n:
            raise UsageError(f"hpcring backend: all_to_all_single: {what} has {rows} rows, not divisible by {n} ranks",
                             hint=f"pass {what}_split_sizes")
        return [rows // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or sum(sizes) != rows or min(sizes) < 0:
        raise UsageError(f"hpcring backend: all_to_all_single: {what}_split_sizes {sizes} must be {n} "
                         f"non-negative sizes summing to the {rows} rows of the {what}")
    return sizes


def _zip(a, b, what: str):
    a, b = list(a), list(b)
    if len(a) != len(b):
        raise UsageError(f"hpcring backend: {what}: {len(a)} outputs but {len(b)} inputs")
    if not a:
        raise UsageError(f"hpcring backend: {what} got no tensors")
    return zip(a, b)


def _copy_back(dst: torch.Tensor, buf: torch.Tensor) -> None:
    """Copy a contiguous staging buffer into a non-contiguous destination (no-op when they are one)."""
    if buf is not dst:
        dst.copy_(buf.view(dst.shape))

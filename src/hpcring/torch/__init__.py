"""``import hpcring.torch as hvd``: Horovod's PyTorch API on hpcring's collectives.

Launch with ``hpcring run`` / ``hpcring submit`` instead of ``horovodrun``; the rest of a Horovod
script stays as it is. Differences from Horovod are listed in docs/from-horovod.md.
"""
from __future__ import annotations

import atexit
import collections
import os

from hpcring.torch import state, elastic, process_sets as psets
from hpcring.torch.autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                                    grouped_reducescatter, reducescatter)
from hpcring.torch.compression import Compression
from hpcring.torch.exceptions import (HorovodInternalError, HostsUpdatedInterrupt, InvalidArgumentError,
                                      JoinedRankError, StallError, TensorMismatchError)
from hpcring.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                     broadcast_parameters)
from hpcring.torch.ops import (Adasum, Average, Max, Min, Product, Sum, allgather_async, allreduce_,
                               allreduce_async, allreduce_async_, alltoall_async, barrier, broadcast_,
                               broadcast_async, broadcast_async_, grouped_allgather_async, grouped_allreduce_,
                               grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter_async,
                               join, poll, reducescatter_async, sparse_allreduce_async, synchronize)
from hpcring.torch.optimizer import DistributedOptimizer
from hpcring.torch.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from hpcring.torch.sync_batch_norm import SyncBatchNorm
import hpcring
from hpcring.bootstrap.launchers import detect
from hpcring.collectives import nccl_lib
from hpcring.config import envvars
from hpcring.diagnostics.timeline import Timeline, measure_offset
from hpcring.jobdir import job_folder
from hpcring.torch.autotune import Autotuner
from hpcring.torch.elastic import _runtime
from hpcring.torch.engine import Engine


def init(comm=None, process_sets=None) -> None:
    """Bootstrap this rank (:func:`hpcring.init`), create the communicator and start the engine.
    ``process_sets``: a list of :class:`ProcessSet` registered now (every rank passes the same
    list), or ``"dynamic"`` (accepted; :func:`add_process_set` works without it). Idempotent.
    ``HPCRING_TIMELINE``, ``HPCRING_AUTOTUNE``, ``HPCRING_FUSION_THRESHOLD``, ``HPCRING_CYCLE_TIME``
    and ``HPCRING_CACHE_CAPACITY`` are read here."""
    if state._engine is not None:
        return
    if comm is not None:
        raise InvalidArgumentError("hpcring.torch.init() takes no MPI communicator",
                                   hint="hpcring.torch uses the whole job; use process_sets= for subsets")
    if process_sets is not None and process_sets != "dynamic" and (
            isinstance(process_sets, str) or not all(isinstance(p, ProcessSet) for p in process_sets)):
        raise InvalidArgumentError("init(process_sets=...) takes a list of hvd.ProcessSet or 'dynamic'")
    if _runtime.enabled():         # the elastic driver started us: join the next round
        session = _runtime.join()
    else:
        _single_process_secret()
        session = hpcring.init()
    c = session.communicator()
    timeline = None
    path = (envvars.get("HPCRING_TIMELINE") or "").strip()
    if path == "job":              # hpcring submit --timeline: <job folder>/timeline.json
        path = str(job_folder() / "timeline.json")
    if path:
        timeline = Timeline(path, c.rank, c.size, measure_offset(c))
    eng = Engine(c, timeline=timeline)
    if envvars.get("HPCRING_AUTOTUNE"):
        eng.autotuner = Autotuner(eng, envvars.get("HPCRING_AUTOTUNE_LOG") or None)
    state.set_state(session, eng)
    psets.setup_global(c.size, eng)
    if process_sets not in (None, "dynamic"):
        for ps in process_sets:
            psets.add_process_set(ps)
    atexit.register(shutdown)


def _single_process_secret() -> None:
    """``python train.py`` without a launcher runs as one rank, as with Horovod: hpcring's
    bootstrap wants a per-job secret even then, so a one-rank process gets a random one (its
    store serves only itself)."""
    if os.environ.get("HPCRING_SECRET_FILE") or os.environ.get("HPCRING_SECRET") or \
            os.environ.get("HPCRING_SESSION"):
        return
    topo = detect()
    if topo.launcher == "single" and topo.size == 1:
        import secrets
        os.environ["HPCRING_SECRET"] = secrets.token_hex(32)


def shutdown() -> None:
    """Stop the engine (pending operations fail) and flush the timeline. The bootstrap session
    stays (it ends with the process); in elastic mode the round's communicator is closed (the
    next ``init()`` joins the next round)."""
    eng = state._engine
    if eng is not None:
        session = state._session
        psets.shutdown_all()
        state.set_state(None, None)
        eng.shutdown()
        if getattr(session, "elastic_round", None) is not None:
            _runtime.leave(session)


def is_initialized() -> bool:
    return state._engine is not None


def _topo():
    return state.session().topology


def size() -> int:
    return _topo().size


def rank() -> int:
    return _topo().rank


def local_size() -> int:
    return _topo().local_size


def local_rank() -> int:
    return _topo().local_rank


def cross_size() -> int:
    """Number of nodes."""
    return _topo().num_nodes


def cross_rank() -> int:
    """This node's index."""
    return _topo().node_rank


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    return len(set(collections.Counter(_topo().hosts).values())) == 1


def _backend() -> str:
    return state.engine().comm.backend_name


def mpi_built() -> bool:
    import importlib.util
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    return _backend() == "mpi"


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    return int(nccl_lib.gpu_available())


def mpi_threads_supported() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    import torch
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return False


def start_timeline(file_path, mark_cycles=False) -> None:
    raise InvalidArgumentError("hpcring.torch records the timeline from process start only",
                     hint="set HPCRING_TIMELINE=PATH (or hpcring submit --timeline) and merge with `hpcring timeline`")


stop_timeline = start_timeline

__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "atexit", "collections", "os")]

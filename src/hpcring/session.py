"""``hpcring.init()``: one call inside any allocation gives the topology and, on demand, collectives.

The first call bootstraps (launcher env -> verified interface -> authenticated rendezvous); later
calls in the same process return the same session, so a script run under ``hpcring submit`` (where
the rank entry already bootstrapped to set MASTER_ADDR & co.) does not meet twice.
"""
from __future__ import annotations

import atexit
import os
import threading

from hpcring.bootstrap.topology import Topology
from hpcring.collectives.choice import BACKENDS, auto_backend
from hpcring.config import envvars
from hpcring.errors import UsageError
from hpcring.bootstrap.auth import load_secret
from hpcring.bootstrap.init import init_bootstrap
from hpcring.bootstrap.store_client import StoreClient
from hpcring.collectives.api import Communicator
from hpcring.collectives.groups import group_session
from hpcring.diagnostics.metrics import start_for as export_metrics
from hpcring.diagnostics.stacks import install_signal_dump
from hpcring.diagnostics.straggler_watch import start_for
from hpcring.diagnostics.watchdog import Watchdog, install_dump_signal

_LOCK = threading.Lock()
_SESSION: "Session | None" = None


class Session:
    """The bootstrapped job as this rank sees it: topology fields, the store, and a communicator."""

    def __init__(self, topology: Topology, store, secret: bytes) -> None:
        self.topology = topology
        self.store = store
        self._secret = secret
        self._comms: dict[str, object] = {}
        self.watchdog = None
        self.stragglers: dict[str, object] = {}   # backend -> its StragglerWatch (or None: off)
        self.default_backend: str | None = None   # init(backend=...): what "auto" means here

    @property
    def secret(self) -> bytes:
        """The job secret, as read once at bootstrap (never read from its file again)."""
        return self._secret

    def start_watchdog(self):
        """Start the hang watchdog (:mod:`hpcring.diagnostics.watchdog`) and the signal dumps
        (SIGRTMIN+7 from the main thread: flight records; SIGRTMIN+6: stacks) unless HPCRING_WATCHDOG=0.
        SIGUSR1 and SIGUSR2 stay free for Lightning's requeue handler and submitit/Slurm."""
        if self.watchdog is None and envvars.get("HPCRING_WATCHDOG"):
            self.watchdog = Watchdog(self.topology, (self.store.host, self.store.port), self._secret,
                                     store=self.store).start()
            install_dump_signal(self.watchdog)           # SIGRTMIN+7: flight records + stacks, keep running
            install_signal_dump(None, self.topology.rank)  # SIGRTMIN+6: stacks (hpcring stacks JOB)
        return self.watchdog

    def __getattr__(self, name: str):
        # rank, size, local_rank, hosts, master_addr, interface, ... straight from the topology;
        # collectives (allreduce, ...) from the default communicator.
        if name.startswith("_"):
            raise AttributeError(name)
        topo = self.__dict__.get("topology")
        if topo is not None and hasattr(topo, name):
            return getattr(topo, name)
        return getattr(self.communicator(), name)

    def communicator(self, backend: str = "auto", *, timeout: float | None = None):
        """The communicator for ``backend`` (created once, collectively: every rank must ask)."""
        if backend not in BACKENDS:
            raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if backend == "auto":
            backend = self.default_backend or auto_backend(self.topology)
        if backend not in self._comms:
            options = {"abort_on_timeout": False} if backend == "mpi" and self.watchdog else {}
            self._comms[backend] = Communicator.create(self.topology, self.store, self._secret,
                                                       timeout=timeout, backend=backend,
                                                       watchdog=self.watchdog, **options)
            self.stragglers[backend] = start_for(self, self._comms[backend], backend)
            export_metrics(self, self._comms[backend], backend, self.stragglers[backend])
        return self._comms[backend]

    def group(self, ranks):
        """A group of ``ranks`` (global ranks; see :mod:`hpcring.collectives.groups`): a
        GroupSession whose ``communicator(backend, timeout=)`` runs collectives among the members
        only, or None on a rank that is not a member. Every member must create the same groups in
        the same order; the other ranks may call too (they get None and take no part)."""
        g = group_session(self, ranks)
        if g is not None:
            g.on_communicator = _watch_group
        return g

    def use(self, backend: str, *, timeout: float | None = None):
        """Create ``backend``'s communicator (collectively) and make it the default: what
        ``"auto"`` and the session's own collectives (``session.allreduce``) mean from now on."""
        if backend not in BACKENDS:
            raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        comm = self.communicator(backend, timeout=timeout)
        if backend != "auto":
            self.default_backend = backend
        return comm

    def __repr__(self) -> str:
        t = self.topology
        return (f"<hpcring session rank {t.rank}/{t.size} local {t.local_rank}/{t.local_size} on {t.host} "
                f"via {t.launcher}, iface {t.interface} {t.address}, master {t.master_addr}:{t.master_port}>")


def _watch_group(group, backend: str, comm):
    """A group's communicator gets its straggler watcher, as the job-wide ones do (HSDP, tensor and
    pipeline groups carry most of such a job's collectives)."""
    tag = f"group{group.key.rsplit('/', 1)[-1]}-{backend}"
    return start_for(group.parent, comm, f"{group.key}/{backend}", group.members, group.name, tag)


def init(backend: str | None = None, *, timeout: float | None = None, interface: str | None = None,
         verify: str | None = None, watchdog: bool = True) -> Session:
    """Bootstrap this rank (once per process) and return the session.

    ``backend`` ("auto", "ring", "mpi", "nccl") also creates that communicator now and becomes the
    session's default (``session.allreduce(...)`` runs on it); without it the communicator is
    created on the first collective. ``timeout`` bounds the bootstrap only (default
    HPCRING_INIT_TIMEOUT or 60 s): ranks start seconds to minutes apart, while a collective's
    deadline (HPCRING_TIMEOUT, which ``hpcring submit/run --timeout`` sets, or
    ``session.communicator(backend, timeout=)``) is about one step of the job, so they are two
    facts. ``interface`` overrides the site's interface spec (NCCL syntax).
    ``watchdog=False`` skips the hang watchdog (for a parent that only hands the session on).
    """
    global _SESSION
    with _LOCK:
        if _SESSION is None and os.environ.get(HANDOFF_VAR):
            _SESSION = _from_handoff(os.environ[HANDOFF_VAR])
            _SESSION.start_watchdog()
        if _SESSION is None:
            envvars.check_environ()   # every bad HPCRING_* value at once, before meeting anyone
            t = envvars.get("HPCRING_INIT_TIMEOUT") if timeout is None else envvars.check_number(
                "init() timeout", timeout, lo=0, lo_open=True, hi=envvars.MAX_TIMEOUT)
            topo, store = init_bootstrap(timeout=t, interface=interface,
                                         verify=verify or envvars.get("HPCRING_VERIFY"))
            _SESSION = Session(topo, store, store.secret)   # read once, at bootstrap
            atexit.register(_release, _SESSION)
            if watchdog:
                _SESSION.start_watchdog()
        session = _SESSION
    if backend is not None:
        session.use(backend)          # the collective deadline, not the bootstrap's ``timeout``
    return session


HANDOFF_VAR = "HPCRING_SESSION"


def handoff_env(session: Session) -> dict[str, str]:
    """Variables that let a child process (``hpcring run``'s CMD) join this session without meeting again."""
    import dataclasses
    import json
    t = session.topology
    data = {k: v for k, v in dataclasses.asdict(t).items() if k != "sources"}
    data["store"] = [t.master_addr, session.store.port]
    data["rendezvous"] = t.sources.get("rendezvous", "?")   # how the parent met: store or pmix
    return {HANDOFF_VAR: json.dumps(data)}


def _from_handoff(text: str) -> Session:
    import json

    data = json.loads(text)
    host, port = data.pop("store")
    data["hosts"] = tuple(data["hosts"])
    met = data.pop("rendezvous", "?")
    topo = Topology(**data, sources={"*": f"{HANDOFF_VAR} (from the parent hpcring rank process)",
                                     "rendezvous": met})
    secret = load_secret()
    return Session(topo, StoreClient(host, port, secret, timeout=30.0), secret)


def _release(session: Session) -> None:
    """At exit: rank 0 (which serves the store) waits, bounded, until every other rank is done with it.

    Without this a fast rank 0 exits and takes the store with it while slower ranks still wait
    for their last answer (seen on the dev cluster: 'store closed the connection').
    """
    topo, store = session.topology, session.store
    try:
        store.leave(topo.rank, topo.size, envvars.get("HPCRING_STORE_LINGER"))
    except Exception:  # exiting anyway: never turn a clean exit into a traceback
        pass


def current() -> Session | None:
    return _SESSION

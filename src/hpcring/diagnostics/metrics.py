"""Prometheus figures of a running job (optional): HPCRING_METRICS, with the official
``prometheus_client`` (``pip install 'hpcring[metrics]'``).

HPCRING_METRICS is one of:

* ``off`` (the default): nothing is imported or started;
* ``http:HOST:PORT``: each rank serves ``/metrics`` on ``PORT + its local rank``, bound to HOST
  (``0.0.0.0`` for every interface, ``127.0.0.1`` for this node only; an IPv6 address in brackets);
* ``textfile:DIR``: each rank rewrites ``DIR/hpcring_rank<r>.prom`` (atomically: a temporary file
  renamed over it) every second, and rank 0 also after each straggler window, for node-exporter's
  textfile collector (``--collector.textfile.directory=DIR``); the file is removed when the process
  exits, so an ended job leaves no figures behind.

A site sets it for its jobs with ``env: {HPCRING_METRICS: "http:0.0.0.0:9400"}`` in its config.

Figures, each labelled ``job`` (the scheduler's job id), ``rank``, ``host`` and ``comm`` (the
communicator: ring, mpi, nccl), read from the rank's own flight recorder when scraped (a custom
collector: no cost unless something scrapes):

* ``hpcring_collectives_total{state="done"|"failed"}``: collectives ended;
* ``hpcring_collective_seconds_total``: seconds inside them (failed ones included);
* ``hpcring_last_collective_seq``: the newest collective's sequence number (one that stops growing
  on one rank while the others' grow is where a job hangs).

Rank 0 adds the straggler watcher's last window (:mod:`hpcring.diagnostics.straggler_watch` calls
it after each window judged), labelled with the rank they describe:
``hpcring_rank_lateness_ms`` (median lateness behind the median rank), ``hpcring_rank_ops_per_second``
(collectives a second over the window), ``hpcring_straggler`` (1 for a rank the verdict in force
names, else 0) and ``hpcring_window_timestamp_seconds`` (when the window was judged).

Nothing secret is exported: no secret, no rendezvous store address or port, no environment.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time

from hpcring.config import envvars, metrics_form
from hpcring.config.text import check_text, shown
from hpcring.config.metrics_form import Setting
from hpcring.errors import UsageError
from hpcring.jobdir import job_id

log = logging.getLogger(__name__)
VAR = "HPCRING_METRICS"
TEXTFILE_PERIOD = 1.0          # seconds between textfile rewrites
_FORMS = metrics_form.FORMS
_HINT = f"fix or unset {VAR} (docs/diagnostics.md, Prometheus)"


def _refused(raw: str, why: str) -> UsageError:
    return UsageError(f"{VAR}={shown(raw)}: {why}; expected {_FORMS}", hint=_HINT)


def parse_setting(raw: str | None) -> Setting | None:
    """The setting in ``raw`` (None for off, unset or blank); UsageError for anything else."""
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    try:
        check_text(text)
        return metrics_form.parse(text)
    except ValueError as exc:
        raise _refused(raw, str(exc)) from None


def setting_from_env(environ=None) -> Setting | None:
    return parse_setting(envvars.get(VAR, environ))


def _require(raw: str):
    try:
        import prometheus_client
    except ImportError:
        raise UsageError(f"{VAR}={shown(raw)} needs the prometheus_client package, which is not installed",
                         hint=f"pip install 'hpcring[metrics]' (or unset {VAR})") from None
    return prometheus_client


class Exporter:
    """This process's exporter: one registry whose collector reads the attached communicators'
    recorders (and, on rank 0, the last straggler window) when asked; served over HTTP or written
    to the textfile folder by :meth:`start`."""

    def __init__(self, setting: Setting, *, job: str, rank: int, host: str, local_rank: int = 0,
                 raw: str = "") -> None:
        _require(raw or setting.kind)
        from prometheus_client import CollectorRegistry
        self.setting = setting
        self.job, self.rank, self.host, self.local_rank = str(job), rank, host, local_rank
        self._lock = threading.Lock()
        self._comms: list[tuple[str, object]] = []
        self._windows: dict[str, dict] = {}         # rank 0: each communicator's last window
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self.port: int | None = None                # http: where this rank serves
        self.path: str | None = None                # textfile: the file this rank writes
        self._server = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        self._writing = threading.Lock()            # a write and close's removal never interleave
        if setting.kind == "http":
            self.port = setting.port + local_rank
            if self.port > 65535:
                raise UsageError(f"{VAR}={shown(raw or setting.kind)}: port {setting.port} + local rank "
                                 f"{local_rank} is above 65535", hint="give a lower port")
        else:
            folder = os.path.expanduser(setting.folder)
            if not os.path.isdir(folder):
                raise UsageError(f"{VAR}={shown(raw or setting.kind)}: folder {shown(folder)} does not exist",
                                 hint="create it (node-exporter's --collector.textfile.directory) or " + _HINT)
            if not os.access(folder, os.W_OK | os.X_OK):
                raise UsageError(f"{VAR}={shown(raw or setting.kind)}: folder {shown(folder)} is not writable",
                                 hint=_HINT)
            self.path = os.path.join(folder, f"hpcring_rank{rank}.prom")

    # -- what is exported ------------------------------------------------------------------
    def attach(self, name: str, comm, watch=None) -> None:
        """Export ``comm``'s recorder as communicator ``name``; on rank 0, ``watch``'s windows too."""
        with self._lock:
            self._comms.append((name, comm))
        if watch is not None and getattr(comm, "rank", None) == 0:
            watch.listeners.append(lambda data, _name=name: self.window(_name, data))

    def window(self, name: str, data: dict) -> None:
        """A straggler window judged on rank 0 (a listener of the watcher)."""
        with self._lock:
            self._windows[name] = data
        if self.path is not None:
            self.write()

    # -- serving -----------------------------------------------------------------------------
    def start(self) -> "Exporter":
        if self.setting.kind == "http":
            from prometheus_client import start_http_server
            try:
                self._server, _ = start_http_server(self.port, addr=self.setting.host, registry=self.registry)
            except OSError as exc:          # the port taken (another job on the node): train on without it
                print(f"hpcring: rank {self.rank}: {VAR}: cannot serve metrics on "
                      f"{self.setting.host}:{self.port}: {exc.strerror or exc}; this rank exports nothing",
                      file=sys.stderr, flush=True)
                self._server = None
            return self
        self.write()
        self._thread = threading.Thread(target=self._run, name=f"hpcring-metrics:{self.rank}", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        return self

    def _run(self) -> None:
        while not self._stop.wait(TEXTFILE_PERIOD):
            self.write()

    def write(self) -> None:
        """Rewrite the textfile now (atomically); a failure is said once on stderr, then retried quietly."""
        from prometheus_client import write_to_textfile
        with self._writing:
            if self.path is None or self._stop.is_set():
                return
            try:
                write_to_textfile(self.path, self.registry)
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    print(f"hpcring: rank {self.rank}: {VAR}: cannot write {self.path}: {exc.strerror or exc}",
                          file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop serving or writing; the textfile is removed (an ended job leaves no figures)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.path is not None:
            with self._writing:           # a write under way (rank 0's window) ends first
                try:
                    os.unlink(self.path)
                except OSError:
                    pass

    # -- the figures -------------------------------------------------------------------------
    def families(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        own = ("job", "rank", "host", "comm")
        done = CounterMetricFamily("hpcring_collectives", "Collectives ended on this rank, by how they ended",
                                   labels=own + ("state",))
        secs = CounterMetricFamily("hpcring_collective_seconds", "Seconds this rank spent inside collectives",
                                   labels=own)
        seq = GaugeMetricFamily("hpcring_last_collective_seq", "Sequence number of this rank's newest collective",
                                labels=own)
        with self._lock:
            comms = list(self._comms)
            windows = dict(self._windows)
        for name, comm in comms:
            rec = comm.recorder
            t = rec.totals()
            labels = [self.job, str(self.rank), self.host, name]
            done.add_metric(labels + ["done"], t.done)
            done.add_metric(labels + ["failed"], t.failed)
            secs.add_metric(labels, float(t.sum_inside) + float(t.sum_failed))
            seq.add_metric(labels, rec.seq)
        out = [done, secs, seq]
        if windows:
            late = GaugeMetricFamily("hpcring_rank_lateness_ms", "Median lateness behind the median rank over the "
                                     "last straggler window, ms (rank 0's view of every rank)", labels=own)
            rate = GaugeMetricFamily("hpcring_rank_ops_per_second", "Collectives a second over the last straggler "
                                     "window (rank 0's view of every rank)", labels=own)
            named = GaugeMetricFamily("hpcring_straggler", "1 for a rank the straggler verdict in force names",
                                      labels=own)
            when = GaugeMetricFamily("hpcring_window_timestamp_seconds", "When rank 0 judged the last straggler "
                                     "window (Unix time)", labels=("job", "comm"))
            for name, data in windows.items():
                verdict = data.get("verdict") or {}
                names = set(verdict.get("ranks") or ())
                when.add_metric([self.job, name], float(data.get("written") or time.time()))
                for r in data.get("ranks") or ():
                    labels = [self.job, str(r["rank"]), str(r["host"]), name]
                    if r.get("lateness_ms") is not None:
                        late.add_metric(labels, float(r["lateness_ms"]))
                    if r.get("ops_per_s") is not None:
                        rate.add_metric(labels, float(r["ops_per_s"]))
                    named.add_metric(labels, 1.0 if r["rank"] in names else 0.0)
            out += [late, rate, named, when]
        return out


class _Collector:
    """prometheus_client's custom collector protocol: ``collect()`` yields metric families."""

    def __init__(self, exporter: Exporter) -> None:
        self.exporter = exporter

    def collect(self):
        try:
            yield from self.exporter.families()
        except Exception as exc:   # noqa: BLE001 - a scrape must never take the rank down
            log.warning("rank %d: metrics not collected: %s", self.exporter.rank, exc)


_EXPORTER: Exporter | None = None
_START = threading.Lock()


def start_for(session, comm, name: str, watch=None) -> Exporter | None:
    """Export ``comm`` (a job-wide communicator of ``session``, called ``name``) as HPCRING_METRICS
    says; None when it is off. The first call in a process starts the exporter, later ones attach
    their communicator to it. UsageError for a bad setting or a missing prometheus_client."""
    raw = envvars.get(VAR)
    setting = parse_setting(raw)
    if setting is None:
        return None
    global _EXPORTER
    with _START:
        if _EXPORTER is not None:
            _EXPORTER.attach(name, comm, watch)
        else:
            topo = session.topology
            exporter = Exporter(setting, job=job_id(), rank=topo.rank, host=topo.host,
                                local_rank=topo.local_rank, raw=raw)
            exporter.attach(name, comm, watch)        # before the first textfile is written
            _EXPORTER = exporter.start()
    return _EXPORTER


__all__ = ["Setting", "parse_setting", "setting_from_env", "Exporter", "start_for"]

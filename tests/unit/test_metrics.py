"""Prometheus export (HPCRING_METRICS), against the real prometheus_client: the setting's forms and
every bad one refused naming the variable; the HTTP endpoint really serves each rank's figures
(scraped with urllib, on PORT + local rank) and rank 0's window figures; the textfile is valid
exposition format, rewritten, and removed at close; the figures are read only when scraped; a
missing prometheus_client is a UsageError naming the extra; nothing but the documented labels."""
from __future__ import annotations

import io
import socket
import sys
import time
import types
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_server import StoreServer
from hpcring.collectives.recorder import FlightRecorder
from hpcring.diagnostics import metrics
from hpcring.diagnostics.metrics import Exporter, Setting, parse_setting
from hpcring.diagnostics.straggler_watch import StragglerWatch
from hpcring.errors import UsageError

LABELS = {"job", "rank", "host", "comm", "state"}


class FakeComm:
    def __init__(self, rank=0, size=4):
        self.rank, self.size = rank, size
        self.recorder = FlightRecorder(rank, size, "ring", capacity=64)


def run_ops(comm, done, failed=0, late=0.0):
    for i in range(done + failed):
        rec = comm.recorder.queue("allreduce", "float32", 4, None, 10.0)
        FlightRecorder.start(rec)
        FlightRecorder.finish(rec, "peer gone" if i >= done else None)
        rec.t_started, rec.t_ended = 1000.0 + i, 1000.0 + i + 0.25 + late


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def families(text: str) -> dict:
    """{sample name: {frozenset(labels.items()): value}} of exposition text."""
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def own(rank=0, host="node1", comm="ring", job="38", **more):
    return frozenset({"job": job, "rank": str(rank), "host": host, "comm": comm, **more}.items())


WINDOW = {"written": 1_700_000_000.0, "first": 11, "ops": 10, "size": 3, "last_op": "allreduce",
          "ranks": [{"rank": 0, "host": "node1", "lateness_ms": 0.2, "inside_s": 0.3, "compute_s": 1.0,
                     "ops_per_s": 9.5},
                    {"rank": 1, "host": "node1", "lateness_ms": -0.1, "inside_s": 0.3, "compute_s": 1.0,
                     "ops_per_s": 9.4},
                    {"rank": 2, "host": "node2", "lateness_ms": 14.0, "inside_s": 0.1, "compute_s": 1.5,
                     "ops_per_s": None}],
          "verdict": {"kind": "rank", "ranks": [2], "host": "node2", "line": "straggler: rank 2 (node2) ..."}}


# ------------------------------------------------------------------------------------ the setting
@pytest.mark.parametrize("raw,want", [
    (None, None), ("", None), ("  ", None), ("off", None), ("OFF", None),
    ("http:0.0.0.0:9400", Setting("http", host="0.0.0.0", port=9400)),
    ("HTTP:127.0.0.1:1", Setting("http", host="127.0.0.1", port=1)),
    ("http:[::1]:9400", Setting("http", host="::1", port=9400)),
    ("http:node-7.cluster:65535", Setting("http", host="node-7.cluster", port=65535)),
    ("textfile:/var/lib/node_exporter/textfile", Setting("textfile", folder="/var/lib/node_exporter/textfile")),
])
def test_the_setting_forms(raw, want):
    assert parse_setting(raw) == want


BAD = ["on", "1", "http", "http:", "http:9400", "http::9400", "http:host:", "http:host:0", "http:host:65536",
       "http:host:9_400", "http:host:94OO", "http:host:-1", "http:host:1e3", "http://host:9400", "http:ho st:9400",
       "http:[]:9400", "textfile:", "textfile:  ", "textfile", "file:/tmp", "prometheus", "http:h:9400\x1b[2J",
       "textfile:/tmp/a\nb", "http:h:" + "9" * 100]


@pytest.mark.parametrize("raw", BAD)
def test_bad_settings_are_refused_naming_the_variable_and_the_forms(raw):
    with pytest.raises(UsageError) as exc:
        parse_setting(raw)
    msg = str(exc.value)
    assert msg.startswith("HPCRING_METRICS=") and "http:HOST:PORT" in msg and "textfile:DIR" in msg
    assert "hint: fix or unset HPCRING_METRICS" in msg and len(msg) < 1000 and "\x1b" not in msg


def test_the_environment_is_read_through_the_registry():
    assert metrics.setting_from_env({}) is None
    assert metrics.setting_from_env({"HPCRING_METRICS": "http:127.0.0.1:9"}).port == 9
    with pytest.raises(UsageError, match="HPCRING_METRICS"):
        metrics.setting_from_env({"HPCRING_METRICS": "http:h:1\x07"})


def test_a_textfile_folder_that_does_not_exist_or_a_port_too_high(tmp_path):
    with pytest.raises(UsageError, match="folder .* does not exist") as exc:
        Exporter(Setting("textfile", folder=str(tmp_path / "nope")), job="1", rank=0, host="h")
    assert "--collector.textfile.directory" in str(exc.value)
    with pytest.raises(UsageError, match="above 65535"):
        Exporter(Setting("http", host="127.0.0.1", port=65535), job="1", rank=1, host="h", local_rank=1)


def test_a_missing_prometheus_client_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)          # import fails as if not installed
    with pytest.raises(UsageError) as exc:
        Exporter(Setting("textfile", folder=str(tmp_path)), job="1", rank=0, host="h", raw=f"textfile:{tmp_path}")
    msg = str(exc.value)
    assert "HPCRING_METRICS=" in msg and "prometheus_client" in msg and "pip install 'hpcring[metrics]'" in msg


# ------------------------------------------------------------------------------------ http
def test_the_http_endpoint_serves_each_rank_figures_on_port_plus_local_rank():
    comm = FakeComm(rank=5, size=8)
    run_ops(comm, 7, failed=2)
    base = free_port() - 1
    ex = Exporter(Setting("http", host="127.0.0.1", port=base), job="38", rank=5, host="node2", local_rank=1)
    ex.attach("ring", comm)
    ex.start()
    try:
        assert ex.port == base + 1
        got = families(scrape(base + 1))
        assert got["hpcring_collectives_total"] == {own(5, "node2", state="done"): 7.0,
                                                    own(5, "node2", state="failed"): 2.0}
        assert got["hpcring_collective_seconds_total"][own(5, "node2")] == pytest.approx(9 * 0.25)
        assert got["hpcring_last_collective_seq"][own(5, "node2")] == comm.recorder.seq == 9
        assert "hpcring_rank_lateness_ms" not in got                    # only rank 0 has windows
        run_ops(comm, 3)                                               # read at scrape time
        assert families(scrape(base + 1))["hpcring_collectives_total"][own(5, "node2", state="done")] == 10.0
    finally:
        ex.close()


def test_rank_0_serves_the_last_window_with_the_straggler():
    comm = FakeComm(rank=0, size=3)
    run_ops(comm, 4)
    watch = types.SimpleNamespace(listeners=[])
    port = free_port()
    ex = Exporter(Setting("http", host="127.0.0.1", port=port), job="38", rank=0, host="node1")
    ex.attach("ring", comm, watch)
    ex.start()
    try:
        assert len(watch.listeners) == 1
        watch.listeners[0](WINDOW)
        got = families(scrape(port))
        assert got["hpcring_rank_lateness_ms"] == {own(0): 0.2, own(1): -0.1, own(2, "node2"): 14.0}
        assert got["hpcring_rank_ops_per_second"] == {own(0): 9.5, own(1): 9.4}         # rank 2's is unknown
        assert got["hpcring_straggler"] == {own(0): 0.0, own(1): 0.0, own(2, "node2"): 1.0}
        assert got["hpcring_window_timestamp_seconds"] == {frozenset({"job": "38", "comm": "ring"}.items()):
                                                           1_700_000_000.0}
        watch.listeners[0]({**WINDOW, "verdict": None})                # the verdict cleared
        assert set(families(scrape(port))["hpcring_straggler"].values()) == {0.0}
    finally:
        ex.close()


def test_a_port_in_use_is_said_and_the_rank_goes_on(capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        ex = Exporter(Setting("http", host="127.0.0.1", port=port), job="1", rank=3, host="h").start()
        ex.close()
    err = capfd.readouterr().err
    assert f"rank 3: HPCRING_METRICS: cannot serve metrics on 127.0.0.1:{port}" in err


def test_figures_are_read_only_when_scraped():
    comm = FakeComm()
    calls = []
    real = comm.recorder.totals
    comm.recorder.totals = lambda: calls.append(1) or real()
    port = free_port()
    ex = Exporter(Setting("http", host="127.0.0.1", port=port), job="1", rank=0, host="h")
    ex.attach("ring", comm)
    ex.start()
    try:
        time.sleep(0.3)
        assert calls == []
        scrape(port)
        assert calls == [1]
    finally:
        ex.close()


def test_only_the_documented_names_and_labels_nothing_from_the_environment(monkeypatch):
    monkeypatch.setenv("HPCRING_SECRET", "0123456789abcdef0123456789abcdef")
    comm = FakeComm()
    run_ops(comm, 2)
    watch = types.SimpleNamespace(listeners=[])
    port = free_port()
    ex = Exporter(Setting("http", host="127.0.0.1", port=port), job="38", rank=0, host="node1")
    ex.attach("ring", comm, watch)
    ex.start()
    try:
        watch.listeners[0](WINDOW)
        text = scrape(port)
    finally:
        ex.close()
    assert "0123456789abcdef" not in text and str(port) not in text
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("hpcring_")
        for s in fam.samples:
            assert set(s.labels) <= LABELS, s


# ------------------------------------------------------------------------------------ textfile
def test_the_textfile_is_valid_exposition_rewritten_and_removed_at_close(tmp_path):
    comm = FakeComm(rank=2, size=4)
    run_ops(comm, 5)
    ex = Exporter(Setting("textfile", folder=str(tmp_path)), job="38", rank=2, host="node2")
    ex.attach("ring", comm)
    ex.start()
    path = tmp_path / "hpcring_rank2.prom"
    try:
        got = families(path.read_text())
        assert got["hpcring_collectives_total"][own(2, "node2", state="done")] == 5.0
        run_ops(comm, 4)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = families(path.read_text())
            if got["hpcring_collectives_total"][own(2, "node2", state="done")] == 9.0:
                break
            time.sleep(0.1)
        assert got["hpcring_collectives_total"][own(2, "node2", state="done")] == 9.0
        assert [p.name for p in tmp_path.iterdir()] == ["hpcring_rank2.prom"]       # no temporary left
    finally:
        ex.close()
    assert not path.exists()


def test_rank_0_writes_the_textfile_after_each_window(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "TEXTFILE_PERIOD", 3600.0)               # only the window writes
    comm = FakeComm(rank=0, size=3)
    watch = types.SimpleNamespace(listeners=[])
    ex = Exporter(Setting("textfile", folder=str(tmp_path)), job="38", rank=0, host="node1")
    ex.attach("ring", comm, watch)
    ex.start()
    try:
        assert "hpcring_straggler" not in families((tmp_path / "hpcring_rank0.prom").read_text())
        watch.listeners[0](WINDOW)
        got = families((tmp_path / "hpcring_rank0.prom").read_text())
        assert got["hpcring_straggler"][own(2, "node2")] == 1.0
    finally:
        ex.close()


def test_an_unwritable_textfile_is_said_once(tmp_path, capfd):
    ex = Exporter(Setting("textfile", folder=str(tmp_path)), job="1", rank=0, host="h")
    ex.path = str(tmp_path / "gone" / "hpcring_rank0.prom")
    ex.write()
    ex.write()
    assert capfd.readouterr().err.count("cannot write") == 1


# ------------------------------------------------------------------------------------ wiring
def session_for(rank=0, local_rank=0, host="node1"):
    topo = types.SimpleNamespace(rank=rank, local_rank=local_rank, host=host)
    return types.SimpleNamespace(topology=topo)


def test_start_for_is_nothing_when_off_and_one_exporter_per_process(monkeypatch, tmp_path):
    monkeypatch.setattr(metrics, "_EXPORTER", None)
    monkeypatch.delenv("HPCRING_METRICS", raising=False)
    assert metrics.start_for(session_for(), FakeComm(), "ring") is None
    monkeypatch.setenv("HPCRING_METRICS", f"textfile:{tmp_path}")
    monkeypatch.setenv("HPCRING_JOB_ID", "77")
    for var in ("SLURM_JOB_ID", "LSB_JOBID", "SUBMITIT_LOCAL_JOB_ID", "SLURM_ARRAY_JOB_ID", "LSB_JOBINDEX"):
        monkeypatch.delenv(var, raising=False)
    a, b = FakeComm(), FakeComm()
    run_ops(b, 3)
    ex = metrics.start_for(session_for(), a, "ring")
    try:
        assert metrics.start_for(session_for(), b, "mpi") is ex
        got = families(metrics_text(ex))
        assert got["hpcring_collectives_total"][own(comm="mpi", job="77", state="done")] == 3.0
        assert got["hpcring_collectives_total"][own(comm="ring", job="77", state="done")] == 0.0
    finally:
        ex.close()
    monkeypatch.setattr(metrics, "_EXPORTER", None)
    monkeypatch.setenv("HPCRING_METRICS", "http:nowhere")
    with pytest.raises(UsageError, match="HPCRING_METRICS"):
        metrics.start_for(session_for(), FakeComm(), "ring")


def metrics_text(ex) -> str:
    from prometheus_client import generate_latest
    return generate_latest(ex.registry).decode()


def test_the_straggler_watcher_feeds_rank_0s_exporter(tmp_path):
    """The watcher's real rounds over a real store: the window rank 0 judges reaches the exporter."""
    secret = b"s" * 32
    server = StoreServer("127.0.0.1", 0, secret=secret)
    comms = [FakeComm(r, 3) for r in range(3)]
    hosts = ("node1", "node1", "node2")
    ws = [StragglerWatch(c, StoreClient("127.0.0.1", server.port, secret, timeout=5.0), hosts, window=20,
                         period=0.1, folder=None, out=io.StringIO()) for c in comms]
    ex = Exporter(Setting("textfile", folder=str(tmp_path)), job="38", rank=0, host="node1")
    ex.attach("ring", comms[0], ws[0])
    try:
        ws[0].tick()                                     # names the window from seq 1
        for k in range(20):                              # rank 2 arrives 8 ms late in every one
            start = 2000.0 + k * 0.03
            for c in comms:
                rec = c.recorder.queue("allreduce", "float32", 4, None, 10.0)
                FlightRecorder.start(rec)
                FlightRecorder.finish(rec)
                rec.t_started, rec.t_ended = start + (0.008 if c.rank == 2 else 0.0), start + 0.01
        for w in ws[1:]:
            w.tick()
        ws[0].tick()
        assert ws[0].windows == 1
        got = families((tmp_path / "hpcring_rank0.prom").read_text())
        assert got["hpcring_straggler"][own(2, "node2")] == 1.0
        assert got["hpcring_rank_lateness_ms"][own(2, "node2")] > 5.0
    finally:
        ex.close()
        for w in ws:
            w.store.close()
        server.close()

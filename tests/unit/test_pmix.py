"""hpcring.bootstrap.pmix: ctypes layouts against PMIx's header, library loading, MACs on what
PMIx carries, bounded PMIx_Init, and how init chooses between PMIx and the store."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpcring.bootstrap import init_pmix
from hpcring.bootstrap import pmix
from hpcring.bootstrap.topology import Topology
from hpcring.errors import BootstrapError

ROOT = Path(__file__).resolve().parents[2]
HEADER_DIRS = ["/usr/lib/x86_64-linux-gnu/pmix2/include", "/usr/include/pmix", "/usr/include"]
SECRET = b"s" * 32


def _have_lib() -> bool:
    try:
        pmix.load_library()
        return True
    except BootstrapError:
        return False


def _header_dir() -> str | None:
    return next((d for d in HEADER_DIRS if os.path.exists(os.path.join(d, "pmix_common.h"))), None)


# ------------------------------------------------------------------------------- layouts

def test_layouts_match_the_lp64_abi_of_pmix_3_to_5():
    assert ctypes.sizeof(pmix.Proc) == 260 and pmix.Proc.rank.offset == 256
    assert ctypes.sizeof(pmix.ByteObject) == 16
    assert ctypes.sizeof(pmix.Value) == 32 and pmix.Value.data.offset == 8
    assert ctypes.sizeof(pmix.Info) == 552
    assert (pmix.Info.flags.offset, pmix.Info.value.offset) == (512, 520)


@pytest.mark.skipif(shutil.which("cc") is None or _header_dir() is None,
                    reason="needs a C compiler and pmix_common.h (apt-get install libpmix-dev)")
def test_layouts_and_constants_match_the_installed_header(tmp_path):
    src = tmp_path / "layout.c"
    src.write_text(textwrap.dedent("""
        #include <stdio.h>
        #include <stddef.h>
        #include <pmix_common.h>
        int main(void) {
            printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu\\n", sizeof(pmix_proc_t), offsetof(pmix_proc_t, rank),
                   sizeof(pmix_value_t), offsetof(pmix_value_t, data), sizeof(pmix_byte_object_t),
                   sizeof(pmix_info_t), offsetof(pmix_info_t, flags), offsetof(pmix_info_t, value),
                   offsetof(pmix_value_t, data.bo.size));
            printf("%u %d %d %d %d %d %d %d %d\\n", (unsigned)PMIX_RANK_WILDCARD, PMIX_BOOL, PMIX_STRING,
                   PMIX_INT, PMIX_UINT32, PMIX_BYTE_OBJECT, PMIX_GLOBAL, PMIX_SUCCESS, PMIX_ERR_TIMEOUT);
            printf("%s %s %s %s %d %d\\n", PMIX_JOB_SIZE, PMIX_COLLECT_DATA, PMIX_TIMEOUT, PMIX_HOSTNAME,
                   PMIX_MAX_NSLEN, PMIX_MAX_KEYLEN);
            return 0;
        }"""))
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-I", _header_dir(), "-o", str(exe), str(src)], check=True, capture_output=True)
    sizes, consts, keys = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")[:3]
    assert [int(x) for x in sizes.split()] == [
        ctypes.sizeof(pmix.Proc), pmix.Proc.rank.offset, ctypes.sizeof(pmix.Value), pmix.Value.data.offset,
        ctypes.sizeof(pmix.ByteObject), ctypes.sizeof(pmix.Info), pmix.Info.flags.offset, pmix.Info.value.offset,
        pmix.Value.data.offset + pmix.ByteObject.size.offset]
    assert [int(x) for x in consts.split()] == [
        pmix.RANK_WILDCARD, pmix.PMIX_BOOL, pmix.PMIX_STRING, pmix.PMIX_INT, pmix.PMIX_UINT32,
        pmix.PMIX_BYTE_OBJECT, pmix.PMIX_GLOBAL, pmix.PMIX_SUCCESS, pmix.PMIX_ERR_TIMEOUT]
    assert keys.split() == [pmix.KEY_JOB_SIZE.decode(), pmix.KEY_COLLECT_DATA.decode(), pmix.KEY_TIMEOUT.decode(),
                            pmix.KEY_HOSTNAME.decode(), str(pmix.MAX_NSLEN), str(pmix.MAX_KEYLEN)]


# ------------------------------------------------------------------------------- detection, loading

def test_present_needs_namespace_rank_and_a_server():
    full = {"PMIX_NAMESPACE": "slurm.pmix.1.0", "PMIX_RANK": "0", "PMIX_SERVER_URI41": "x;tcp4://1.2.3.4:5"}
    assert pmix.present(full)
    for k in full:
        assert not pmix.present({x: v for x, v in full.items() if x != k}), k
    assert not pmix.present({})


def test_missing_library_is_a_clear_error():
    with pytest.raises(BootstrapError, match=r"cannot load libpmix: /nonexistent/libpmix\.so\.2.*") as e:
        pmix.load_library("/nonexistent/libpmix.so.2")
    assert "libpmix2" in e.value.hint and "HPCRING_RENDEZVOUS=store" in e.value.hint


def test_a_library_without_pmix_symbols_is_refused():
    with pytest.raises(BootstrapError, match="not a usable PMIx client library"):
        pmix.load_library("libz.so.1")


@pytest.mark.skipif(not _have_lib(), reason="libpmix is not installed")
def test_pmix_init_against_a_silent_server_hits_its_deadline():
    """A server that accepts and never answers: PMIx_Init blocks; the client gives up on time (run in a
    child process: the abandoned PMIx thread stays behind)."""
    code = textwrap.dedent(f"""
        import os, socket, sys, time
        ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(8)
        uri = "pmix-server.%d;tcp4://127.0.0.1:%d" % (os.getpid(), ls.getsockname()[1])
        for k in ("PMIX_SERVER_URI41", "PMIX_SERVER_URI4", "PMIX_SERVER_URI3", "PMIX_SERVER_URI2", "PMIX_SERVER_URI21"):
            os.environ[k] = uri
        os.environ.update(PMIX_NAMESPACE="fake.0", PMIX_RANK="0", PMIX_SECURITY_MODE="native")
        from hpcring.bootstrap.pmix import PmixClient
        t = time.monotonic()
        try:
            PmixClient(b"k" * 32, timeout=2)
        except Exception as e:
            print("ERR %.2f %s" % (time.monotonic() - t, e))
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    line = next((x for x in r.stdout.splitlines() if x.startswith("ERR")), None)
    assert line, r.stdout + r.stderr
    took = float(line.split()[1])
    assert 1.9 <= took < 4.0 and "PMIx_Init did not return within 2 s" in line, line


# ------------------------------------------------------------------------------- MACs

class _FakeClient(pmix.PmixClient):
    """PmixClient's reading side over a dict instead of a PMIx server."""

    def __init__(self, store: dict, secret: bytes = SECRET, namespace: str = "slurm.pmix.7.0"):
        self.secret, self.namespace, self.rank, self.size, self._open = secret, namespace, 0, 3, False
        self.store = store
        self.version = "fake"

    def _get(self, rank, key, timeout=None):
        v = self.store.get((rank, key.decode()))
        return None if v is None else (pmix.PMIX_BYTE_OBJECT, v)


def _blob(rank: int, key: str, value: bytes, secret: bytes = SECRET, ns: str = "slurm.pmix.7.0") -> bytes:
    return value + pmix.mac(secret, ns, rank, key, value)


def test_read_accepts_an_authentic_value_and_refuses_forged_or_moved_ones():
    good = _blob(1, "card", b'{"host": "node2"}')
    c = _FakeClient({(1, "hpcring.card"): good})
    assert c.read(1, "card") == b'{"host": "node2"}'
    cases = {
        "altered": {(1, "hpcring.card"): good.replace(b"node2", b"evil1")},
        "moved to another rank": {(2, "hpcring.card"): good},
        "another secret": {(1, "hpcring.card"): _blob(1, "card", b"x", secret=b"t" * 32)},
        "another job step": {(1, "hpcring.card"): _blob(1, "card", b"x", ns="slurm.pmix.7.1")},
        "truncated": {(1, "hpcring.card"): b"short"},
    }
    for what, store in cases.items():
        rank = 2 if what == "moved to another rank" else 1
        with pytest.raises(BootstrapError, match=f"PMIx value 'card' of rank {rank} .* fails its MAC"):
            _FakeClient(store).read(rank, "card")
    with pytest.raises(BootstrapError, match="rank 2 published no 'card'"):
        c.read(2, "card")


def test_mac_binds_rank_key_and_namespace():
    base = pmix.mac(SECRET, "ns", 1, "card", b"v")
    assert len(base) == pmix.MAC_LEN
    assert base != pmix.mac(SECRET, "ns", 11, "card", b"v") != pmix.mac(SECRET, "ns1", 1, "card", b"v")
    assert pmix.mac(SECRET, "ns", 1, "car", b"dv") != base   # field boundaries are not ambiguous


# ------------------------------------------------------------------------------- the choice in init

def _topo(launcher="slurm", rank=0, size=3) -> Topology:
    return Topology(rank=rank, size=size, local_rank=0, local_size=1, node_rank=rank, num_nodes=size,
                    hosts=("n1", "n2", "n3")[:size], launcher=launcher, job_id="7")


PMIX_ENV = {"PMIX_NAMESPACE": "slurm.pmix.7.0", "PMIX_RANK": "0", "PMIX_SERVER_URI41": "x;tcp4://127.0.0.1:1",
            "HPCRING_PMIX_MIN_RANKS": "1"}     # auto tries PMIx at any size here


def test_auto_uses_the_store_below_the_size_where_pmix_pays_off(monkeypatch, caplog):
    monkeypatch.setattr(pmix, "PmixClient", lambda *a, **k: pytest.fail("PMIx used below HPCRING_PMIX_MIN_RANKS"))
    env = {k: v for k, v in PMIX_ENV.items() if k != "HPCRING_PMIX_MIN_RANKS"}     # the default, 256
    with caplog.at_level(logging.INFO, logger="hpcring.bootstrap.init"):
        assert init_pmix._pmix_client(_topo(), env, SECRET, time.monotonic() + 5) is None
    assert any("auto meets through PMIx from HPCRING_PMIX_MIN_RANKS=256" in r.getMessage() for r in caplog.records)
    def tried(*a, **k):
        raise BootstrapError("tried")
    monkeypatch.setattr(pmix, "PmixClient", tried)
    with pytest.raises(BootstrapError, match="PMIx cannot be used: tried"):   # pmix mode: asked for, no size rule
        init_pmix._pmix_client(_topo(), {**env, "HPCRING_RENDEZVOUS": "pmix"}, SECRET, time.monotonic() + 5)


def test_auto_without_pmix_uses_the_store_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="hpcring.bootstrap.init"):
        assert init_pmix._pmix_client(_topo(), {}, SECRET, time.monotonic() + 5) is None
    assert any("rendezvous through the store: no PMIx server" in r.getMessage() for r in caplog.records)


def test_store_mode_never_touches_pmix(monkeypatch):
    monkeypatch.setattr(pmix, "PmixClient", lambda *a, **k: pytest.fail("PMIx used in store mode"))
    assert init_pmix._pmix_client(_topo(), {**PMIX_ENV, "HPCRING_RENDEZVOUS": "store"}, SECRET, time.monotonic() + 5) is None


def test_pmix_mode_without_pmix_is_an_error():
    with pytest.raises(BootstrapError, match="HPCRING_RENDEZVOUS=pmix, but PMIx cannot be used: no PMIx server"):
        init_pmix._pmix_client(_topo(), {"HPCRING_RENDEZVOUS": "pmix"}, SECRET, time.monotonic() + 5)


def test_unloadable_library_falls_back_with_a_warning_in_auto_and_fails_in_pmix_mode(caplog):
    env = {**PMIX_ENV, "HPCRING_PMIX_LIBRARY": "/nonexistent/libpmix.so.2"}
    with caplog.at_level(logging.INFO, logger="hpcring.bootstrap.init"):
        assert init_pmix._pmix_client(_topo(), env, SECRET, time.monotonic() + 5) is None
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warned and "cannot load libpmix" in warned[0].getMessage()
    with pytest.raises(BootstrapError, match="PMIx cannot be used: cannot load libpmix"):
        init_pmix._pmix_client(_topo(), {**env, "HPCRING_RENDEZVOUS": "pmix"}, SECRET, time.monotonic() + 5)


@pytest.mark.parametrize("launcher,rank", [("torchrun", 0), ("local", 0), ("slurm", 1)])
def test_ranks_not_started_by_the_pmix_launcher_do_not_use_it(monkeypatch, caplog, launcher, rank):
    """torchrun under srun --mpi=pmix: its children inherit one PMIX_RANK; PMIx must not be used."""
    monkeypatch.setattr(pmix, "PmixClient", lambda *a, **k: pytest.fail("PMIx used"))
    with caplog.at_level(logging.INFO, logger="hpcring.bootstrap.init"):
        assert init_pmix._pmix_client(_topo(launcher, rank), PMIX_ENV, SECRET, time.monotonic() + 5) is None
    assert any("not from the PMIx launcher" in r.getMessage() for r in caplog.records)


def test_bad_setting_is_a_usage_error():
    from hpcring.errors import UsageError
    with pytest.raises(UsageError, match="HPCRING_RENDEZVOUS"):
        init_pmix._pmix_client(_topo(), {"HPCRING_RENDEZVOUS": "mpi"}, SECRET, time.monotonic() + 5)


def test_store_address_from_pmix_is_authenticated_by_the_store_handshake():
    """A forged store address (someone else listening) is skipped; rank 0's real store is found."""
    from hpcring.bootstrap.store_server import StoreServer
    real = StoreServer("127.0.0.1", 0, secret=SECRET)
    fake = StoreServer("127.0.0.1", 0, secret=b"x" * 32)
    try:
        with pytest.raises(BootstrapError, match="could not reach rank 0's rendezvous store"):
            init_pmix._connect_store_at(["127.0.0.1"], fake.port, SECRET, time.monotonic() + 0.5)
        c = init_pmix._connect_store_at(["127.0.0.1"], real.port, SECRET, time.monotonic() + 5)
        c.set("k", b"v")
        assert c.get("k") == b"v"
        c.close()
    finally:
        real.close()
        fake.close()


def test_after_a_fence_timeout_the_ranks_whose_data_cannot_be_fetched_are_named():
    store = {(r, "pmix.hname"): f"node{r + 1}".encode() for r in range(3)}
    store[(1, "hpcring.card")] = _blob(1, "card", b"{}")
    c = _FakeClient(store)   # this is rank 0 of 3; rank 1 published, rank 2 did not
    assert c._who_is_missing("card", 1.0) == ([2], "their data could not be fetched from their nodes within 1 s")
    assert c.hosts_from_pmix([2]) == ["?", "?", "node3"]
    store[(2, "hpcring.card")] = _blob(2, "card", b"{}", secret=b"t" * 32)   # a forgery counts as missing
    assert c._who_is_missing("card", 1.0)[0] == [2]
    store[(2, "hpcring.card")] = _blob(2, "card", b"{}")
    missing, why = c._who_is_missing("card", 1.0)
    assert missing == [] and "a PMIx server did not finish the fence" in why
    del store[(1, "hpcring.card")], store[(2, "hpcring.card")]   # nothing fetchable: no clue, no false names
    assert c._who_is_missing("card", 1.0) == ([], "PMIx does not say which ranks are missing (no peer's data "
                                                  "could be fetched before the fence)")


def test_a_fence_that_expires_names_the_missing_rank_in_the_store_paths_words(monkeypatch):
    store = {(r, "pmix.hname"): f"node{r + 1}".encode() for r in range(3)}
    store[(1, "hpcring.card")] = _blob(1, "card", b"{}")
    c = _FakeClient(store)
    c.me = pmix.Proc()

    class _Lib:   # PMIx_Fence that never returns (a rank never comes)
        @staticmethod
        def PMIx_Fence(*a):
            time.sleep(30)
    c.lib = _Lib()
    t = time.monotonic()
    with pytest.raises(BootstrapError) as e:
        c.fence(0.5, probe_key="card", probe_budget=0.5)
    assert time.monotonic() - t < 2.5
    assert e.value.message.startswith("rendezvous incomplete: 1 of 3 ranks never reached hpcring.init(): rank 2 on "
                                      "node3 (the PMIx fence of slurm.pmix.7.0 did not complete within 0.5 s"), e.value.message

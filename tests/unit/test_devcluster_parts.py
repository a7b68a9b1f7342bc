"""The dev cluster's pure parts, without root or the running cluster: the /etc/hosts block, config
writes and sinfo state parsing (the running cluster is covered by tests/devcluster/test_devcluster.py)."""
from __future__ import annotations

import stat

import pytest

from hpcring.devcluster import hosts, names, readiness, state

OTHER = "127.0.0.1\tlocalhost\n10.0.0.5\tlogin  # keep me\n"


@pytest.fixture()
def hosts_file(tmp_path, monkeypatch):
    f = tmp_path / "hosts"
    f.write_text(OTHER)
    monkeypatch.setattr(names, "HOSTS_FILE", f)
    return f


def test_hosts_block_added_once_resized_and_removed(hosts_file):
    actions: list[str] = []
    hosts.ensure_block(3, actions)
    text = hosts_file.read_text()
    assert text.startswith(OTHER) and "10.99.0.3\tnode3" in text and hosts.has_block()
    assert actions == [f"updated {hosts_file}"]

    hosts.ensure_block(3, actions)               # unchanged: nothing written, nothing reported
    assert hosts_file.read_text() == text and len(actions) == 1

    hosts.ensure_block(2, actions)               # fewer nodes: the block shrinks, the rest stays
    text = hosts_file.read_text()
    assert "node3" not in text and "10.99.0.2\tnode2" in text and text.count(names.HOSTS_BEGIN) == 1
    assert len(actions) == 2

    hosts.remove_block()
    assert hosts_file.read_text() == OTHER and not hosts.has_block()


def test_hosts_block_after_a_file_without_final_newline(hosts_file):
    hosts_file.write_text("127.0.0.1 localhost")
    hosts.ensure_block(1, [])
    assert hosts_file.read_text().startswith("127.0.0.1 localhost\n" + names.HOSTS_BEGIN + "\n")


def test_write_if_changed_reports_changes_and_sets_the_mode(tmp_path):
    f = tmp_path / "slurmdbd.conf"
    assert state.write_if_changed(f, "a\n", 0o600) is True
    assert state.write_if_changed(f, "a\n", 0o600) is False    # same text: daemons need no restart
    f.chmod(0o644)
    assert state.write_if_changed(f, "a\n", 0o600) is False and stat.S_IMODE(f.stat().st_mode) == 0o600
    assert state.write_if_changed(f, "b\n", 0o600) is True and f.read_text() == "b\n"
    assert [p.name for p in tmp_path.iterdir()] == ["slurmdbd.conf"]   # no temporary file left


@pytest.mark.parametrize("sinfo, base, ready", [
    ("idle", "idle", True),
    ("idle*", "idle", False),           # registered but not responding yet
    ("mixed", "mixed", True),
    ("drained", "drained", False),
    ("down*", "down", False),
    ("ALLOCATED+", "allocated", True),
    (None, "", False),
])
def test_sinfo_states(sinfo, base, ready):
    assert readiness.base_state(sinfo) == base
    assert readiness._responding_and_healthy(sinfo) is ready

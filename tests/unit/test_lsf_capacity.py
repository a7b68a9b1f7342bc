"""LSF takes a job that excludes too many hosts and leaves it pending for ever (sbatch refuses such a
job at once): ``lsf.never_fits`` counts the hosts ``bhosts`` says can ever take the job, and
``submit`` refuses it before bsub, nothing made. Against the LSF emulation's bhosts/badmin
(tests/lsf_emulation: ok, closed_Full, closed_Adm) and generated ``bhosts -w`` tables for the
states the emulation never shows (unavail, unreach, closed_LIM, ...)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hpcring import submit as submit_mod
from hpcring.config.jobspec import resolve_job
from hpcring.config.site import load_site
from hpcring.errors import SchedulerError
from hpcring.schedulers import lsf, lsf_steps

ROOT = Path(__file__).resolve().parents[2]
EMU_BIN = ROOT / "tests" / "lsf_emulation" / "bin"
HOSTS = ["node1", "node2", "node3"]
# every state bhosts documents; those after "closed_Wind" take no job until someone acts
PASSING = ["ok", "closed_Full", "closed_Busy", "closed_Excl", "closed_Wind", "closed_cu_excl"]
SHUT = ["unavail", "unreach", "closed_Adm", "closed_Lock", "closed_LIM", "closed_EGO"]


@pytest.fixture
def emu(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRING_LSF_EMU_DIR", str(tmp_path / "emu"))
    monkeypatch.setenv("HPCRING_LSF_EMU_HOSTS", " ".join(HOSTS))
    monkeypatch.setenv("HPCRING_LSF_EMU_SLOTS", "4")
    monkeypatch.setenv("PATH", f"{EMU_BIN}:{os.environ['PATH']}")
    return tmp_path


@pytest.fixture
def site(tmp_path):
    p = tmp_path / "lsf.yaml"
    p.write_text((ROOT / "site_configs" / "devcluster-lsf.yaml").read_text().replace(
        "job_dir: /srv/hpcring/lsf-jobs", f"job_dir: {tmp_path / 'jobs'}"))
    return load_site(str(p))


def _job(site, tmp_path, nodes=3, per_node=1, spares=0, exclude=()):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    job = resolve_job(site, str(script), [], cli={"nodes": nodes, "tasks_per_node": per_node, "spare_nodes": spares},
                      environ={})
    job.exclude = list(exclude)
    return job


def _badmin(*args):
    r = subprocess.run(["badmin", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_emulations_bhosts_shows_closed_and_full_hosts(emu):
    _badmin("hclose", "node2")
    table = lsf_steps.host_table(lsf_steps.bhosts_text())
    assert table == {"node1": ("ok", 4), "node2": ("closed_Adm", 4), "node3": ("ok", 4)}
    _badmin("hopen", "node2")
    assert lsf_steps.host_table(lsf_steps.bhosts_text())["node2"] == ("ok", 4)
    assert lsf_steps.bhosts_text(["nodeX"]) is None          # a refusal (exit 255) says nothing


def test_a_closed_host_makes_a_three_host_job_never_fit_and_submit_refuses_it_before_bsub(emu, site, tmp_path):
    job = _job(site, tmp_path)
    assert lsf.never_fits(site, job) is None
    _badmin("hclose", "node3")
    why = lsf.never_fits(site, job)
    assert why and "asks for 3 hosts" in why and "2 of the cluster's 3" in why and "node3 (closed_Adm)" in why, why
    with pytest.raises(SchedulerError) as e:
        submit_mod.submit(site, job)
    assert "bsub would take this job and never start it" in e.value.message, e.value.message
    assert "--nodes" in e.value.hint and "hpcring nodes clear" in e.value.hint
    assert not (tmp_path / "emu" / "jobs").exists() or not any((tmp_path / "emu" / "jobs").iterdir())
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())   # no job folder
    # two hosts fit, and excluding one of them does not
    assert lsf.never_fits(site, _job(site, tmp_path, nodes=2)) is None
    why = lsf.never_fits(site, _job(site, tmp_path, nodes=1, spares=1, exclude=["node1"]))
    assert "asks for 2 hosts (1 and 1 spare)" in why and "node1 (excluded)" in why, why


def test_the_cli_says_so_and_exits_non_zero(emu, site, tmp_path, cli):
    _badmin("hclose", "node1", "node2")
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = cli("submit", str(script), "--site", str(site.path), "--nodes", "2")
    assert r.exit_code != 0 and "never start it" in r.output and "node1 (closed_Adm)" in r.output, r.output
    assert "Submitted job" not in r.output


def test_a_full_or_busy_host_still_counts_and_a_host_with_too_few_slots_does_not(emu, site, tmp_path, monkeypatch):
    text = ("HOST_NAME STATUS JL/U MAX NJOBS RUN SSUSP USUSP RSV\n"
            "node1 ok - 2 0 0 0 0 0\nnode2 closed_Full - 4 4 4 0 0 0\nnode3 closed_Busy - 3 1 1 0 0 0\n")
    monkeypatch.setattr(lsf, "bhosts_text", lambda **kw: text)
    assert lsf.never_fits(site, _job(site, tmp_path, nodes=2, per_node=3)) is None
    why = lsf.never_fits(site, _job(site, tmp_path, nodes=3, per_node=3))
    assert "with 3 slots each" in why and "2 of the cluster's 3" in why and "node1 (2 slots)" in why, why
    assert lsf.never_fits(site, _job(site, tmp_path, nodes=3, per_node=2)) is None


@pytest.mark.parametrize("bhosts", [None, "sleep 30", "echo 'bhosts: LSF is down' >&2; exit 255"])
def test_when_bhosts_cannot_say_nothing_is_refused(emu, site, tmp_path, monkeypatch, bhosts):
    d = tmp_path / "bin"
    d.mkdir()
    if bhosts:
        (d / "bhosts").write_text(f"#!/bin/sh\n{bhosts}\n")
        (d / "bhosts").chmod(0o755)
    monkeypatch.setenv("PATH", f"{d}:/usr/bin:/bin")
    monkeypatch.setattr(lsf, "QUERY_TIMEOUT_S", 1.0)
    assert lsf.never_fits(site, _job(site, tmp_path, nodes=3, exclude=HOSTS)) is None


def test_csm_whole_node_jobs_are_not_counted(emu, tmp_path):
    summit = load_site(str(ROOT / "site_configs" / "lsf-summit.yaml"))
    assert summit.config.lsf.nnodes
    assert lsf.never_fits(summit, _job(summit, tmp_path, nodes=1, exclude=HOSTS)) is None


_row = st.tuples(st.sampled_from(PASSING + SHUT), st.one_of(st.none(), st.integers(0, 8)))


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(_row, min_size=1, max_size=12), nodes=st.integers(1, 12), spares=st.integers(0, 3),
       per_node=st.integers(1, 8), excluded=st.sets(st.integers(0, 11)))
def test_generated_tables_refuse_exactly_when_too_few_hosts_can_ever_take_the_job(
        rows, nodes, spares, per_node, excluded, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    text = "HOST_NAME STATUS JL/U MAX NJOBS RUN SSUSP USUSP RSV\n" + "".join(
        f"h{i} {status} - {'-' if slots is None else slots} 0 0 0 0 0\n" for i, (status, slots) in enumerate(rows))
    p = tmp / "lsf.yaml"
    p.write_text((ROOT / "site_configs" / "devcluster-lsf.yaml").read_text())
    site = load_site(str(p))
    exclude = [f"h{i}" for i in sorted(excluded)]
    job = _job(site, tmp, nodes=1, exclude=exclude)
    job.nodes, job.tasks_per_node, job.spare_nodes = nodes, per_node, spares      # past the site's limits too
    can = [f"h{i}" for i, (status, slots) in enumerate(rows)
           if status in PASSING and (slots is None or slots >= per_node) and f"h{i}" not in exclude]
    orig = lsf.bhosts_text
    lsf.bhosts_text = lambda **kw: text
    try:
        why = lsf.never_fits(site, job)
    finally:
        lsf.bhosts_text = orig
    if len(can) >= nodes + spares:
        assert why is None, (can, why)
    else:
        assert f"{len(can)} of the cluster's {len(rows)} hosts" in why, why
        for i, (status, _) in enumerate(rows[:8]):      # every host left out is named with why (8 shown)
            if f"h{i}" not in can:
                assert f"h{i} (" in why, why

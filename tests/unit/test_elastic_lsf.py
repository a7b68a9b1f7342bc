"""``hpcring run --elastic`` inside an LSF job, without a cluster: the per-node ``blaunch -z`` words,
the hosts and spares the driver is given, and the refusals."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hpcring import allocation
from hpcring.config.site import load_site
from hpcring.elastic import run as elastic_run
from hpcring.errors import SchedulerError, UsageError
from hpcring.schedulers import lsf, slurm_steps

ROOT = Path(__file__).resolve().parents[2]


def test_node_step_argv_is_one_blaunch_on_that_host_and_keeps_the_job_when_it_fails():
    argv = lsf.node_step_argv("node2", 3, ["python", "train.py", "--note", "a b 'c'", "$HOME"])
    assert argv[0] == "env" and argv[1:3] == ["LSB_DJOB_COMMFAIL_ACTION=KILL_TASKS",
                                              "LSB_DJOB_RTASK_GONE_ACTION=IGNORE_TASKCRASH"]
    i = argv.index("blaunch")
    assert argv[i + 1] == "-z" and argv[i + 2].split() == ["node2"] * 3     # one task per listed host
    # blaunch joins its words and runs them through a shell on the host: each word comes back whole
    assert shlex.split(" ".join(argv[i + 3:])) == ["python", "train.py", "--note", "a b 'c'", "$HOME"]


@pytest.mark.parametrize("host, per_node", [("", 1), ("node1 node2", 1), ("node1", 0)])
def test_node_step_argv_refuses_what_is_not_one_host(host, per_node):
    with pytest.raises(ValueError, match="one host name"):
        lsf.node_step_argv(host, per_node, ["true"])


def test_each_scheduler_owns_its_node_step():
    assert elastic_run._node_step_argv("lsf") is lsf.node_step_argv
    assert elastic_run._node_step_argv("slurm") is slurm_steps.node_step_argv
    with pytest.raises(UsageError, match="inside a pbs allocation"):
        elastic_run._node_step_argv("pbs")


@pytest.fixture
def lsf_site(tmp_path):
    text = (ROOT / "site_configs" / "devcluster-lsf.yaml").read_text().replace(
        "job_dir: /srv/hpcring/lsf-jobs", f"job_dir: {tmp_path / 'jobs'}")
    p = tmp_path / "lsf.yaml"
    p.write_text(text)
    return load_site(str(p))


EMU_BIN = ROOT / "tests" / "lsf_emulation" / "bin"      # a blaunch on PATH (not run here)


def _lsf_env(hosts: str, **extra) -> dict:
    return {"LSB_JOBID": "77", "LSB_MCPU_HOSTS": hosts, "PATH": f"{EMU_BIN}:/usr/bin:/bin", **extra}


class _Capture:
    """Stands in for the Driver: records the plan it was given, starts nothing."""
    plans: list = []

    def __init__(self, args, nodes=None, environ=None):
        self.args, self.nodes = args, nodes
        _Capture.plans.append(self)

    def run(self) -> int:
        return 0


def test_inside_an_lsf_job_the_first_hosts_run_and_the_others_are_spares(monkeypatch, lsf_site):
    monkeypatch.setattr(elastic_run, "Driver", _Capture)
    _Capture.plans.clear()
    rc = allocation.run(["python", "train.py"], lsf_site, 2, 2, environ=_lsf_env("node1 2 node2 2 node3 2"),
                        elastic=True, min_nodes=1)
    assert rc == 0
    d = _Capture.plans[0]
    assert d.nodes.hosts == ["node1", "node2", "node3"] and d.nodes.use == 2
    assert (d.args.np, d.args.min_np) == (4, 2)
    spare = d.nodes.argv("node3")
    assert "blaunch" in spare and spare[spare.index("blaunch") + 2] == "node3 node3"


def test_a_launch_node_the_site_leaves_out_is_no_worker_and_no_spare(monkeypatch, tmp_path):
    text = (ROOT / "site_configs" / "devcluster-lsf.yaml").read_text().replace(
        "job_dir: /srv/hpcring/lsf-jobs", f"job_dir: {tmp_path / 'jobs'}").replace(
        '  warning_time: "1"', '  warning_time: "1"\n  drop_launch_node: true')
    (tmp_path / "s.yaml").write_text(text)
    monkeypatch.setattr(elastic_run, "Driver", _Capture)
    _Capture.plans.clear()
    allocation.run(["true"], load_site(str(tmp_path / "s.yaml")), 2, 1,
                   environ=_lsf_env("batch1 1 node1 1 node2 1 node3 1"), elastic=True)
    assert _Capture.plans[0].nodes.hosts == ["node1", "node2", "node3"]


@pytest.mark.parametrize("nodes, kw, message", [
    (4, {}, "--nodes 4 but this allocation has 3 node"),
    (2, {"min_nodes": 3}, "--min-nodes 3 must be between 1 and --nodes"),
    (2, {"reset_limit": -1}, "--reset-limit -1 must be 0 or more"),
])
def test_bad_options_are_refused_before_the_driver_starts(monkeypatch, lsf_site, nodes, kw, message):
    monkeypatch.setattr(elastic_run, "Driver", _Capture)
    _Capture.plans.clear()
    with pytest.raises(UsageError, match=message):
        allocation.run(["true"], lsf_site, nodes, 1, environ=_lsf_env("node1 1 node2 1 node3 1"), elastic=True, **kw)
    assert not _Capture.plans


def test_a_container_is_refused_with_elastic(monkeypatch, lsf_site):
    from hpcring.config.container import ContainerRun
    box = ContainerRun(runtime="apptainer", image="/x.sif")
    monkeypatch.setattr(elastic_run, "Driver", _Capture)
    _Capture.plans.clear()
    with pytest.raises(UsageError, match="a container is not supported"):
        allocation.run(["true"], lsf_site, 2, 1, environ=_lsf_env("node1 1 node2 1"), elastic=True, container=box)
    assert not _Capture.plans


def test_an_lsf_job_that_lists_no_hosts_is_a_clear_error(monkeypatch, lsf_site):
    monkeypatch.setattr(elastic_run, "Driver", _Capture)
    _Capture.plans.clear()
    with pytest.raises((SchedulerError, UsageError), match="lists no slots|lists 0 node"):
        allocation.run(["true"], lsf_site, 1, 1, environ={"LSB_JOBID": "77", "PATH": "/usr/bin:/bin"}, elastic=True)
    assert not _Capture.plans


def test_without_blaunch_on_path_it_says_so_before_any_node_step(monkeypatch, lsf_site, tmp_path):
    monkeypatch.setattr(elastic_run, "Driver", _Capture)
    _Capture.plans.clear()
    with pytest.raises(SchedulerError, match="`blaunch` is not on PATH inside this lsf allocation"):
        allocation.run(["true"], lsf_site, 1, 1, environ=_lsf_env("node1 1 node2 1", PATH=str(tmp_path)),
                       elastic=True)
    assert not _Capture.plans

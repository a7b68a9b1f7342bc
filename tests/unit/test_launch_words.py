"""One source for the launcher line: schedulers' launch_argv, the job scripts and `hpcring run`.

The job script's line is run through bash with the launcher replaced by ``printf``, so what is
compared is the words the launcher would receive, not the text.
"""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from hpcring import allocation as run_alloc
from hpcring.bootstrap import allocation_size, launchers, lsf_slots
from hpcring.config.jobspec import resolve_job
from hpcring.config.site import load_site
from hpcring.errors import BootstrapError, ConfigError, SchedulerError, UsageError
from hpcring.schedulers.render import job_env, render_script
from hpcring.schedulers import lsf, slurm
from hpcring.schedulers.launch_words import HOSTFILE, LaunchRequest, Shell

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ("srun", "jsrun", "blaunch", "mpirun")
CMD = ("/usr/bin/python3", "-c", "import sys; print(sys.argv)", "it's a  word", "$HOME")


def _site(tmp_path: Path, kind: str, *, drop: bool = False, args: str = "[]", gpus: int = 0):
    """A dev-cluster site with launcher ``kind`` (Slurm for srun, LSF otherwise)."""
    base = (ROOT / "site_configs" / ("devcluster.yaml" if kind == "srun" else "devcluster-lsf.yaml")).read_text()
    text = base.replace("kind: srun", f"kind: srun\n  args: {args}") if kind == "srun" else \
        base.replace("kind: blaunch", f"kind: {kind}\n  args: {args}")
    if drop:
        text = text.replace('  warning_time: "1"', '  warning_time: "1"\n  drop_launch_node: true')
    if gpus:
        text = text.replace("    cpus_per_node: 4\n", f"    cpus_per_node: 4\n    gpus_per_node: {gpus}\n")
    p = tmp_path / f"{kind}-{drop}-{gpus}.yaml"
    p.write_text(text)
    return load_site(str(p), {})


def _script_words(script: str, launcher: str, hostfile: str) -> list[str]:
    """The words the job script's launcher line hands the launcher (bash parses the line)."""
    lines = script.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(launcher + " "))
    line = "\n".join(lines[start:])
    line = "printf '%s\\n' " + line[len(launcher) + 1:]
    out = subprocess.run(["bash", "-c", f"HOSTFILE={shlex.quote(hostfile)}\n{line}"], capture_output=True,
                         text=True, check=True, env={"HOME": "/home/x", "PATH": "/usr/bin:/bin"})
    return [launcher] + out.stdout.split("\n")[:-1]


# -- the words per launcher kind ----------------------------------------------------------------

def test_srun_batch_and_sized_step(tmp_path):
    cfg = _site(tmp_path, "srun", args="['--cpu-bind=cores']").config
    batch = slurm.launch_argv(cfg, LaunchRequest(2, 3, Shell("python -u x.py 'a b'"), logs="/j dir/%j_%t_log"))
    assert batch.script() == ("srun --unbuffered --kill-on-bad-exit=1 \\\n"
                              "  --output='/j dir/%j_%t_log.out' --error='/j dir/%j_%t_log.err' \\\n"
                              "  --mpi=pmix \\\n  --cpu-bind=cores \\\n  python -u x.py 'a b'")
    step = slurm.launch_argv(cfg, LaunchRequest(2, 3, ("python", "a b"), size_step=True))
    assert step.argv == ["srun", "--unbuffered", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=3",
                         "--ntasks=6", "--mpi=pmix", "--cpu-bind=cores", "python", "a b"]
    with pytest.raises(ValueError, match="job-script text"):
        batch.argv   # shell text is never executed


def test_jsrun_resource_sets_with_and_without_gpus(tmp_path):
    cfg = _site(tmp_path, "jsrun").config
    words = lsf.launch_argv(cfg, LaunchRequest(2, 6, ("a",), cpus_per_task=7, gpus_per_node=6)).argv
    assert words == ["jsrun", "-n", "12", "-r", "6", "-a", "1", "-c", "7", "-g", "1", "-b", "packed:7", "a"]
    words = lsf.launch_argv(cfg, LaunchRequest(1, 2, ("a",), cpus_per_task=2)).argv
    assert words[:13] == ["jsrun", "-n", "2", "-r", "2", "-a", "1", "-c", "2", "-g", "0", "-b", "packed:2"]


def test_blaunch_quotes_for_its_remote_shell(tmp_path):
    cfg = _site(tmp_path, "blaunch", args="['-no-shell x']").config
    words = lsf.launch_argv(cfg, LaunchRequest(2, 2, CMD, hostfile="/run/hosts")).argv
    assert words[:3] == ["blaunch", "-u", "/run/hosts"]
    # blaunch joins its words and a shell on each host splits them again: each arrives whole
    assert shlex.split(" ".join(words[3:])) == ["-no-shell x", *CMD]
    script = lsf.launch_argv(cfg, LaunchRequest(2, 2, Shell("py -c 'import os'"))).script()
    assert script.startswith('blaunch -u "$HOSTFILE" \\\n')


def test_mpirun_over_the_host_file(tmp_path):
    cfg = _site(tmp_path, "mpirun").config
    words = lsf.launch_argv(cfg, LaunchRequest(3, 2, ("a", "b c"), hostfile="/h")).argv
    assert words == ["mpirun", "-np", "6", "--hostfile", "/h", "--map-by", "ppr:2:node", "a", "b c"]
    assert lsf.launch_argv(cfg, LaunchRequest(3, 2, ("a",))).lines[0][4] is HOSTFILE


def test_lsf_refuses_a_slurm_launcher(tmp_path):
    with pytest.raises(SchedulerError, match="'srun' does not run under LSF"):
        lsf.launch_argv(_site(tmp_path, "srun").config, LaunchRequest(1, 1, ("a",)))


def test_slurm_site_with_mpirun_is_refused(tmp_path):
    text = (ROOT / "site_configs" / "devcluster.yaml").read_text().replace("kind: srun", "kind: mpirun") \
        .replace("  mpi: pmix\n", "")
    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_site(str(tmp_path / "m.yaml"), {})
    assert any("launcher.kind" in p and "srun, not mpirun" in p for p in e.value.problems)


# -- the job script and hpcring run start ranks with the same words -------------------------------

@pytest.mark.parametrize("kind,drop", [(k, False) for k in LAUNCHERS] + [(k, True) for k in LAUNCHERS[1:]])
def test_script_and_hpcring_run_give_the_same_words(tmp_path, kind, drop):
    site = _site(tmp_path, kind, drop=drop, args="['--x=a b', \"it's\"]", gpus=2)
    job = resolve_job(site, "t.py", [], {"nodes": 2, "tasks_per_node": 2, "cpus_per_task": 2}, environ={})
    script = render_script(site, job, " ".join(shlex.quote(w) for w in CMD), "/jobs dir/%j")
    # hpcring run inside an allocation of 2 hosts x 2 slots (LSF: with a launch node first when drop)
    slots = ["batch1"] * drop + ["n1", "n1", "n2", "n2"]
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "2"} if kind == "srun" else \
        {"LSB_JOBID": "5", "LSB_MCPU_HOSTS": " ".join(f"{h} {slots.count(h)}" for h in dict.fromkeys(slots))}
    alloc = allocation_size.allocation(env, lsf_drop_launch_node=drop)
    assert alloc.num_nodes == 2
    words, extra = run_alloc.launch_words(alloc, site, job, 2, 2, list(CMD), tmp_path)
    hostfile = extra.get("HPCRING_LSF_HOSTFILE", "/no/hostfile")
    from_script = _script_words(script, kind, hostfile)
    from_run = words.argv
    if kind == "srun":   # the batch step is the whole job, logs per rank; hpcring run sizes its step
        from_script = [w for w in from_script if not w.startswith(("--output=", "--error="))]
        from_run = [w for w in from_run if not w.startswith(("--nodes=", "--ntasks-per-node=", "--ntasks="))]
        assert "--output=/jobs dir/%j/%j_%t_log.out" in _script_words(script, kind, hostfile)
    assert from_script == from_run
    if kind in ("blaunch", "mpirun"):
        assert Path(hostfile).read_text() == "n1\nn1\nn2\nn2\n"   # launch node left out
        assert ("grep -v -x -F" in script) == drop


def test_hpcring_run_host_file_is_the_ranks_slot_list(tmp_path):
    """The file blaunch starts from is the one each rank's bootstrap sizes the world from."""
    site = _site(tmp_path, "blaunch", drop=True)
    job = resolve_job(site, "t.py", [], {}, environ={})
    env = {"LSB_JOBID": "9", "LSB_MCPU_HOSTS": "batch1 1 n1 2 n2 2 n3 2"}
    alloc = allocation_size.allocation(env, lsf_drop_launch_node=True)
    assert (alloc.num_nodes, alloc.slots[0]) == (3, "n1")
    words, extra = run_alloc.launch_words(alloc, site, job, 2, 1, ["a"], tmp_path)
    assert Path(extra["HPCRING_LSF_HOSTFILE"]).read_text() == "n1\nn2\n"
    task = {**env, **extra, "LSF_PM_TASKID": "2"}
    topo = launchers.detect(task, hostname="n2")
    assert (topo.size, topo.rank, topo.hosts, topo.launcher) == (2, 1, ("n1", "n2"), "blaunch")


def test_host_file_refuses_more_than_the_allocation():
    assert lsf_slots.host_file(["a", "a", "b", "b"], 2, 1, "X") == ["a", "b"]
    with pytest.raises(UsageError, match="--nodes 3 but this LSF allocation has 2 host"):
        lsf_slots.host_file(["a", "a", "b", "b"], 3, 1, "X")
    with pytest.raises(UsageError, match="--tasks-per-node 3 but host a has 2 slot"):
        lsf_slots.host_file(["a", "a", "b", "b"], 1, 3, "X")


def test_local_site_in_an_allocation_gets_the_plain_launcher(tmp_path):
    site = load_site("local", {})
    job = resolve_job(site, "t.py", [], {}, environ={})
    alloc = allocation_size.allocation({"SLURM_JOB_ID": "1", "SLURM_NNODES": "3"})
    assert run_alloc.launch_words(alloc, site, job, 3, 1, ["a"], tmp_path)[0].argv[0] == "srun"
    alloc = allocation_size.allocation({"LSB_JOBID": "1", "LSB_HOSTS": "h1 h2"})
    words, extra = run_alloc.launch_words(alloc, site, job, 2, 1, ["a"], tmp_path)
    assert words.argv[:2] == ["blaunch", "-u"] and Path(extra["HPCRING_LSF_HOSTFILE"]).read_text() == "h1\nh2\n"


def test_local_site_in_an_allocation_chooses_the_interface_itself():
    """The local site pins lo (one machine); inside a multi-node allocation that links nothing, so
    its fabric gives way to the automatic choice, and its launcher to the allocation's."""
    site = load_site("local", {})
    job = resolve_job(site, "t.py", [], {}, environ={})
    assert job_env(site, job).get("HPCRING_IFNAME") == "=lo"
    alloc = allocation_size.allocation({"SLURM_JOB_ID": "1", "SLURM_NNODES": "3"})
    used = run_alloc.for_allocation(site, alloc)
    assert used.config.launcher.kind == "srun" and used.config.fabric.data_interfaces == []
    assert "HPCRING_IFNAME" not in job_env(used, resolve_job(used, "t.py", [], {}, environ={}))
    dev = load_site("devcluster", {})
    assert run_alloc.for_allocation(dev, alloc) is dev          # the cluster's own site is kept


def test_the_slurm_cluster_names_the_default_site():
    from hpcring.config.site import allocation_site, resolve_site_ref
    assert allocation_site({"SLURM_CLUSTER_NAME": "devcluster"}) == "devcluster"
    assert allocation_site({"SLURM_CLUSTER_NAME": "nosuchcluster"}) is None and allocation_site({}) is None
    assert resolve_site_ref(None, {"SLURM_CLUSTER_NAME": "devcluster"})[0].stem == "devcluster"
    assert resolve_site_ref(None, {"SLURM_CLUSTER_NAME": "nosuchcluster"})[0].stem == "local"
    assert resolve_site_ref(None, {"SLURM_CLUSTER_NAME": "devcluster", "HPCRING_SITE": "local"})[0].stem == "local"
    assert resolve_site_ref("slurm-tcp", {"SLURM_CLUSTER_NAME": "devcluster"})[0].stem == "slurm-tcp"


# -- the allocation's size comes from the tables ------------------------------------------------

@pytest.mark.parametrize("env,expected", [
    ({}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3", "SLURM_NNODES": "1"}, ("slurm", 3, "SLURM_JOB_NUM_NODES")),
    ({"SLURM_JOBID": "7", "SLURM_NNODES": "2"}, ("slurm", 2, "SLURM_NNODES")),
    ({"SLURM_JOB_ID": "7"}, ("slurm", None, "unknown")),
    ({"LSB_JOBID": "8", "LSB_MCPU_HOSTS": "h1 4 h2 4"}, ("lsf", 2, "LSB_MCPU_HOSTS")),
    ({"LSB_JOBID": "8", "LSB_MCPU_HOSTS": "b 1 h1 4 h2 4", "HPCRING_LSF_DROP_LAUNCH_NODE": "1"},
     ("lsf", 2, "LSB_MCPU_HOSTS (launch node dropped)")),
    ({"LSB_JOBID": "8", "LSB_HOSTS": "h1 h1 h2"}, ("lsf", 2, "LSB_HOSTS")),
])
def test_allocation_size_from_the_tables(env, expected):
    alloc = allocation_size.allocation(env)
    assert (alloc and (alloc.scheduler, alloc.num_nodes, alloc.source)) == expected


def test_allocation_reads_the_lsf_host_file_and_names_bad_values(tmp_path):
    (tmp_path / "hosts").write_text("b\nh1\nh1\nh2\n")
    alloc = allocation_size.allocation({"LSB_JOBID": "8", "LSB_DJOB_HOSTFILE": str(tmp_path / "hosts")},
                                 lsf_drop_launch_node=True)
    assert (alloc.num_nodes, alloc.slots) == (2, ("h1", "h1", "h2"))
    with pytest.raises(BootstrapError, match="SLURM_JOB_NUM_NODES='two'"):
        allocation_size.allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "two"})
    with pytest.raises(BootstrapError, match="LSB_MCPU_HOSTS"):
        allocation_size.allocation({"LSB_JOBID": "8", "LSB_MCPU_HOSTS": "h1 x"})


# -- lsf.drop_launch_node reaches the ranks -------------------------------------------------------

def test_drop_launch_node_is_exported_and_read_by_detect(tmp_path):
    summit = load_site("lsf-summit", {})
    assert job_env(summit, resolve_job(summit, "t.py", [], {}, environ={}))["HPCRING_LSF_DROP_LAUNCH_NODE"] == "1"
    plain = load_site("devcluster-lsf", {})
    assert "HPCRING_LSF_DROP_LAUNCH_NODE" not in job_env(plain, resolve_job(plain, "t.py", [], {}, environ={}))
    # mpirun ranks on the two compute hosts of a job whose slot list starts with the launch node
    env = {"LSB_JOBID": "3", "LSB_MCPU_HOSTS": "batch2 1 c1 2 c2 2", "OMPI_COMM_WORLD_RANK": "2",
           "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert launchers.detect(env, hostname="c2").hosts[0] == "?"   # slot list does not fit: unknown
    topo = launchers.detect({**env, "HPCRING_LSF_DROP_LAUNCH_NODE": "1"}, hostname="c2")
    assert topo.hosts == ("c1", "c1", "c2", "c2") and topo.launcher == "lsf"
    assert launchers.detect({**env, "HPCRING_LSF_DROP_LAUNCH_NODE": "1"}, hostname="c2",
                            lsf_drop_launch_node=False).hosts[0] == "?"   # an explicit argument wins


def test_submitit_hostnames_leave_the_launch_node_out(monkeypatch):
    for k in ("LSB_DJOB_RANKFILE", "LSB_DJOB_HOSTFILE", "LSB_HOSTS", "SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LSB_JOBID", "4")
    monkeypatch.setenv("LSB_MCPU_HOSTS", "batch1 1 c1 2 c2 2")
    monkeypatch.setenv("HPCRING_LSF_DROP_LAUNCH_NODE", "1")
    assert lsf.LsfJobEnvironment().hostnames == ["c1", "c2"]
    monkeypatch.setenv("HPCRING_LSF_DROP_LAUNCH_NODE", "0")
    assert lsf.LsfJobEnvironment().hostnames == ["batch1", "c1", "c2"]

"""Launcher detection against environment sets of real launch situations (tests/data/launch_envs).

Each JSON file holds ``env`` (the whole environment of one rank, unrelated variables included),
optional ``files`` (LSF host files; ``{dir}`` in env values is replaced by their directory),
``hostname``, ``lsf_drop_launch_node`` and the full ``expected`` Topology.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcring.bootstrap.launchers import (
    DETECTION_ORDER, TABLES, UNKNOWN, UNKNOWN_HOST, complete, detect, explain, hosts_known,
    parse_tasks_per_node,
)
from hpcring.bootstrap.topology import Topology
from hpcring.errors import BootstrapError

ENV_DIR = Path(__file__).resolve().parents[1] / "data" / "launch_envs"
CASES = sorted(ENV_DIR.glob("*.json"))


def _load(path: Path, tmp_path: Path) -> dict:
    case = json.loads(path.read_text())
    for name, text in case["files"].items():
        (tmp_path / name).write_text(text)
    case["env"] = {k: v.replace("{dir}", str(tmp_path)) for k, v in case["env"].items()}
    return case


def _detect(case: dict) -> Topology:
    return detect(case["env"], hostname=case["hostname"], lsf_drop_launch_node=case["lsf_drop_launch_node"])


def test_every_launcher_has_a_recorded_environment():
    covered = {json.loads(p.read_text())["expected"]["launcher"] for p in CASES}
    assert covered >= {"local", "slurm", "openmpi", "mvapich", "pmi", "jsrun", "lsf", "torchrun", "single"}
    assert len(CASES) >= 15


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_recorded_environment(path: Path, tmp_path: Path):
    case = _load(path, tmp_path)
    exp = dict(case["expected"])
    want_sources = exp.pop("sources")
    want_known = exp.pop("hosts_known")
    exp["hosts"] = tuple(exp["hosts"])
    topo = _detect(case)
    assert topo == Topology(**exp), case["description"]
    assert hosts_known(topo) is want_known
    assert topo.sources["hosts_known"] == ("true" if want_known else "false")
    for field, var in want_sources.items():
        assert topo.sources[field] == var, field
    # Invariants every consumer relies on.
    assert len(topo.hosts) == topo.size and topo.host != UNKNOWN_HOST
    assert set(topo.sources) >= {"rank", "size", "local_rank", "local_size", "launcher", "hosts"}


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_detect_does_not_mutate_environment(path: Path, tmp_path: Path):
    case = _load(path, tmp_path)
    before = dict(case["env"])
    _detect(case)
    assert case["env"] == before


def test_default_environ_is_os_environ(monkeypatch):
    for var in [v for t in TABLES.values() for v in t.marker] + ["SLURM_JOB_ID", "SLURM_JOBID", "LSB_JOBID"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    topo = detect(hostname="h")
    assert (topo.launcher, topo.rank, topo.size, topo.hosts) == ("openmpi", 1, 2, ("?", "h"))


# ------------------------------------------------------------------------- contradiction errors

SRUN = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "2",
        "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


def _err(env: dict, **kw) -> str:
    with pytest.raises(BootstrapError) as info:
        detect(env, hostname="h", **kw)
    return str(info.value)


def test_valid_baselines_for_the_error_cases():
    # The error cases below each change one thing in these; make sure the baselines pass.
    assert detect(SRUN, hostname="h").hosts == ("n1", "n1", "n2", "n2")
    assert detect(OMPI, hostname="h").rank == 1


@pytest.mark.parametrize("changes, words", [
    ({"SLURM_PROCID": "5"}, ["SLURM_PROCID=5", "SLURM_NTASKS=4"]),
    ({"SLURM_PROCID": "x"}, ["SLURM_PROCID='x'", "integer"]),
    ({"SLURM_PROCID": "-1"}, ["SLURM_PROCID='-1'"]),
    ({"SLURM_NNODES": "3"}, ["SLURM_STEP_NODELIST=n[1-2]", "2 hosts", "SLURM_NNODES=3"]),
    ({"SLURM_STEP_NODELIST": "n[1-2"}, ["SLURM_STEP_NODELIST", "never closed"]),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, ["2(x3)", "3 nodes", "2"]),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x2),"}, ["malformed", "2(x2),"]),
    ({"SLURM_STEP_TASKS_PER_NODE": "1,1"}, ["adds up to 2", "SLURM_NTASKS=4"]),
    ({"SLURM_LOCALID": "2"}, ["SLURM_LOCALID=2"]),
    ({"SLURM_NODEID": "2", "SLURM_NNODES": "3"}, ["SLURM_NNODES=3"]),
    ({"SLURMD_NODENAME": "n2"}, ["SLURMD_NODENAME=n2", "n1"]),
])
def test_slurm_contradictions(changes, words):
    msg = _err({**SRUN, **changes})
    for w in words:
        assert w in msg, (w, msg)


def test_slurm_missing_variables_are_named():
    env = dict(SRUN)
    del env["SLURM_STEP_TASKS_PER_NODE"]
    msg = _err(env)
    assert "SLURM_STEP_TASKS_PER_NODE/SLURM_TASKS_PER_NODE" in msg and "missing" in msg


@pytest.mark.parametrize("drop, words", [
    ("OMPI_COMM_WORLD_SIZE", ["OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE", "missing"]),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", ["OMPI_COMM_WORLD_LOCAL_SIZE", "missing"]),
])
def test_openmpi_partial(drop, words):
    env = {k: v for k, v in OMPI.items() if k != drop}
    msg = _err(env)
    for w in words:
        assert w in msg


@pytest.mark.parametrize("env, words", [
    ({**OMPI, "OMPI_COMM_WORLD_RANK": "4"}, ["OMPI_COMM_WORLD_RANK=4", "OMPI_COMM_WORLD_SIZE=4"]),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, ["OMPI_COMM_WORLD_LOCAL_RANK=2", "OMPI_COMM_WORLD_LOCAL_SIZE=2"]),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "5"}, ["OMPI_COMM_WORLD_LOCAL_SIZE=5", "larger"]),
    ({**OMPI, "PMIX_RANK": "3"}, ["OMPI_COMM_WORLD_RANK=1", "PMIX_RANK=3"]),
    ({"PMI_RANK": "0"}, ["PMI_RANK=0", "PMI_SIZE", "missing"]),
    ({"PMIX_RANK": "2"}, ["PMIX_RANK=2", "no world size"]),
    ({"PMIX_RANK": "2", **SRUN}, ["no world size"]),  # srun step says rank 1: it does not vouch
    ({"JSM_NAMESPACE_RANK": "1", "JSM_NAMESPACE_SIZE": "2", "JSM_NAMESPACE_LOCAL_RANK": "0"},
     ["JSM_NAMESPACE_LOCAL_SIZE", "missing"]),
    ({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, ["RANK=3", "WORLD_SIZE=2"]),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["LOCAL_RANK", "missing"]),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "1", "MV2_COMM_WORLD_LOCAL_RANK": "0",
      "MV2_COMM_WORLD_LOCAL_SIZE": "1"}, ["MV2_COMM_WORLD_RANK=1", "MV2_COMM_WORLD_SIZE=1"]),
])
def test_mpi_family_contradictions(env, words):
    msg = _err(env)
    for w in words:
        assert w in msg, (w, msg)


LOCAL = {"HPCRING_LAUNCHER": "local", "HPCRING_RANK": "1", "HPCRING_SIZE": "4", "HPCRING_LOCAL_RANK": "1",
         "HPCRING_LOCAL_SIZE": "2", "HPCRING_NODE_RANK": "0", "HPCRING_NUM_NODES": "2",
         "HPCRING_NODELIST": "local[0-1]", "HPCRING_HOSTNAME": "local0"}


@pytest.mark.parametrize("changes, words", [
    ({"HPCRING_NUM_NODES": "3"}, ["HPCRING_NODELIST=local[0-1]", "HPCRING_NUM_NODES=3"]),
    ({"HPCRING_SIZE": "5"}, ["HPCRING_SIZE=5"]),
    ({"HPCRING_RANK": "2"}, ["HPCRING_RANK=2", "HPCRING_NODE_RANK=0"]),
    ({"HPCRING_HOSTNAME": "local1"}, ["HPCRING_HOSTNAME=local1"]),
])
def test_local_contradictions(changes, words):
    assert detect(LOCAL, hostname="h").hosts == ("local0", "local0", "local1", "local1")
    msg = _err({**LOCAL, **changes})
    for w in words:
        assert w in msg


def test_local_marker_needs_value_local():
    # HPCRING_LAUNCHER=slurm (or anything else) does not select the local table.
    topo = detect({**LOCAL, "HPCRING_LAUNCHER": "slurm"}, hostname="h")
    assert topo.launcher == "single"


# ----------------------------------------------------------------------------- precedence rules

def test_mpirun_in_sbatch_rank0_is_not_confused_with_batch_step():
    # Rank 0 of mpirun agrees with the batch step's SLURM_PROCID=0 by accident; no SLURM_STEP_ID.
    env = {**OMPI, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "77",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    topo = detect(env, hostname="n1")
    assert topo.launcher == "openmpi" and topo.hosts == ("n1", "?", "?", "?") and topo.job_id == "77"


def test_srun_corroborates_openmpi_and_fills_hosts():
    topo = detect({**SRUN, **OMPI}, hostname="h")
    assert topo.launcher == "slurm" and topo.hosts == ("n1", "n1", "n2", "n2")
    assert topo.sources["rank"] == "OMPI_COMM_WORLD_RANK" and "corroborated" in topo.sources["launcher"]


def test_disagreeing_srun_step_is_ignored_and_noted():
    topo = detect({**SRUN, **OMPI, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, hostname="h")
    assert topo.launcher == "openmpi" and not hosts_known(topo)
    assert "SLURM_PROCID=0" in topo.sources["ignored"]


def test_slurm_special_step_ids_are_not_task_steps():
    for step in ("4294967291", "batch", "extern"):
        topo = detect({**SRUN, "SLURM_STEP_ID": step}, hostname="h")
        assert topo.launcher == "single" and topo.job_id == "9"


def test_slurm_unknown_distribution_leaves_hosts_unknown():
    topo = detect({**SRUN, "SLURM_DISTRIBUTION": "plane=2"}, hostname="h")
    assert topo.launcher == "slurm" and topo.hosts == ("?", "n1", "?", "?")
    assert (topo.node_rank, topo.num_nodes, topo.local_size) == (0, 2, 2)


def test_slurm_block_check_catches_unannounced_layout():
    # Rank 1 with local id 0 on node 1 cannot be block; Slurm did not say what it was.
    topo = detect({**SRUN, "SLURM_NODEID": "1", "SLURM_LOCALID": "0"}, hostname="h")
    assert topo.hosts == ("?", "n2", "?", "?") and "does not put" in topo.sources["hosts"]


def test_lsf_slots_not_used_when_inconsistent(tmp_path):
    env = {**OMPI, "LSB_JOBID": "5", "LSB_MCPU_HOSTS": "a 3 b 1"}
    topo = detect(env, hostname="a")
    assert topo.launcher == "openmpi" and not hosts_known(topo) and topo.job_id == "5"
    assert "local size" in topo.sources["ignored"]
    good = detect({**env, "LSB_MCPU_HOSTS": "a 2 b 2"}, hostname="a.example.org")
    assert good.launcher == "lsf" and good.hosts == ("a", "a", "b", "b")
    wrong_host = detect({**env, "LSB_MCPU_HOSTS": "a 2 b 2"}, hostname="b")
    assert wrong_host.launcher == "openmpi"


def test_lsf_unreadable_rankfile_is_noted_not_fatal(tmp_path):
    topo = detect({**OMPI, "LSB_JOBID": "5", "LSB_DJOB_RANKFILE": str(tmp_path / "nope")}, hostname="a")
    assert topo.launcher == "openmpi" and "cannot read LSB_DJOB_RANKFILE" in topo.sources["ignored"]


def test_lsf_hosts_and_drop_launch_node():
    env = {**OMPI, "LSB_JOBID": "5", "LSB_HOSTS": "login1 a a b b"}
    assert detect(env, hostname="a").launcher == "openmpi"  # 5 slots for 4 ranks
    topo = detect(env, hostname="a", lsf_drop_launch_node=True)
    assert topo.hosts == ("a", "a", "b", "b") and topo.sources["hosts"].startswith("LSB_HOSTS (launch node dropped)")


def test_detection_order_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "bootstrap.md").read_text()
    positions = [doc.index(f"`{name}`") for name in (*DETECTION_ORDER, "single")]
    assert positions == sorted(positions)


# ----------------------------------------------------------------------------- helpers

def test_parse_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ValueError):
        parse_tasks_per_node("2(3)")


def test_complete_fills_hosts_and_node_fields():
    topo = detect({**OMPI, "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, hostname="b")
    assert (topo.node_rank, topo.num_nodes) == (UNKNOWN, UNKNOWN)
    done = complete(topo, ["a", "a", "b", "b"])
    assert (done.node_rank, done.num_nodes, done.hosts) == (1, 2, ("a", "a", "b", "b"))
    assert hosts_known(done) and done.sources["hosts"] == "rendezvous"
    with pytest.raises(BootstrapError):
        complete(topo, ["a", "?", "b", "b"])


def test_explain_names_sources():
    text = explain(detect(SRUN, hostname="h"))
    assert "rank        = 1  <- SLURM_PROCID" in text
    assert "hosts       = n[1,1-2,2]  <- SLURM_STEP_NODELIST+SLURM_STEP_TASKS_PER_NODE (block distribution)" in text


# ------------------------------------------------------------------------------- LSF blaunch

def _blaunch_env(tmp_path: Path, task: str, lines: str = "n1\nn1\nn2\nn2\nn3\nn3\n") -> dict:
    (tmp_path / "hostfile").write_text(lines)
    return {"LSB_JOBID": "88", "LSF_PM_TASKID": task, "LSB_DJOB_HOSTFILE": str(tmp_path / "hostfile"),
            "LSB_DJOB_NUMPROC": str(len(lines.split())), "LSB_MCPU_HOSTS": "n1 2 n2 2 n3 2"}


def test_blaunch_task_id_is_one_based(tmp_path):
    topo = detect(_blaunch_env(tmp_path, "4"), hostname="n2")
    assert (topo.launcher, topo.rank, topo.size, topo.local_rank, topo.local_size) == ("blaunch", 3, 6, 1, 2)
    assert (topo.node_rank, topo.num_nodes, topo.job_id) == (1, 3, "88")
    assert topo.hosts == ("n1", "n1", "n2", "n2", "n3", "n3") and hosts_known(topo)
    assert topo.sources["rank"] == "LSF_PM_TASKID-1"
    assert topo.sources["size"].startswith("LSB_DJOB_HOSTFILE (6 slots")
    assert detect(_blaunch_env(tmp_path, "1"), hostname="n1").rank == 0


def test_blaunch_drops_launch_node(tmp_path):
    env = _blaunch_env(tmp_path, "2", "batch1\nc1\nc1\nc2\nc2\n")
    topo = detect(env, hostname="c1", lsf_drop_launch_node=True)
    assert (topo.rank, topo.size, topo.local_rank, topo.hosts) == (1, 4, 1, ("c1", "c1", "c2", "c2"))


def test_blaunch_errors(tmp_path):
    assert "counts from 1" in _err(_blaunch_env(tmp_path, "0"))
    assert "is not below" in _err(_blaunch_env(tmp_path, "7"))
    env = {"LSB_JOBID": "88", "LSF_PM_TASKID": "1"}
    assert "world size is unknown" in _err(env)


def test_blaunch_wrong_host_leaves_hosts_to_the_rendezvous(tmp_path):
    topo = detect(_blaunch_env(tmp_path, "3"), hostname="elsewhere")
    assert topo.launcher == "blaunch" and topo.rank == 2 and not hosts_known(topo)
    assert topo.local_rank == UNKNOWN and "this host is elsewhere" in topo.sources["ignored"]


def test_mpirun_inside_blaunch_task_is_openmpi(tmp_path):
    # An orted started by blaunch passes LSF_PM_TASKID on; the Open MPI rank is the truth.
    env = {**_blaunch_env(tmp_path, "1"), **OMPI}
    assert detect(env, hostname="n1").launcher in ("openmpi", "lsf")
    assert detect(env, hostname="n1").rank == 1

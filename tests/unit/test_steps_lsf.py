"""LSF's side of the step loop (schedulers/lsf_steps.py), without a cluster: the step's blaunch
line and host file, the gang check's, what blaunch and bhosts say, the step's tasks found and
SIGKILLed by job and step, and the LSF site's options (spares and --preflight allowed with blaunch,
refused where no step can be pinned to hosts)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hpcring import steps
from hpcring.bootstrap import launchers
from hpcring.bootstrap.init_store import _store_ports
from hpcring.config.jobspec import plan_preflight, plan_step_restarts, resolve_job
from hpcring.config.site import load_site
from hpcring.errors import UsageError
from hpcring.schedulers import lsf, lsf_steps, slurm_steps
from hpcring.schedulers.render import render_script

# the job script's launcher line for devcluster-lsf, as the shell hands it to hpcring.steps
LAUNCH = ["blaunch", "-u", "/lsf/job.12/hostfile", "/py -u -m hpcring.schedulers.lsf_task '/j/12'"]


def test_a_step_is_one_blaunch_on_the_chosen_hosts_with_its_own_world(tmp_path):
    argv = lsf_steps.step_argv(LAUNCH, ["node3", "node1"], 2, step=4, folder=tmp_path)
    env = argv[1:argv.index("blaunch")]
    assert argv[0] == "env" and "LSB_DJOB_COMMFAIL_ACTION=KILL_TASKS" in env
    assert "LSB_DJOB_RTASK_GONE_ACTION=IGNORE_TASKCRASH" in env and "HPCRING_LSF_STEP=4" in env
    rest = argv[argv.index("blaunch"):]
    assert rest == ["blaunch", "-z", "node3 node3 node1 node1", LAUNCH[3]]     # the job's -u file is gone
    hostfile = [e.split("=", 1)[1] for e in env if e.startswith("HPCRING_LSF_HOSTFILE=")][0]
    assert open(hostfile).read() == "node3\nnode3\nnode1\nnode1\n" and hostfile.endswith("steps/hosts.4")
    # what a rank of that step detects: task 3 (rank 2) is on node1, in a world of 4 ranks
    topo = launchers.detect({"LSB_JOBID": "12", "LSF_PM_TASKID": "3", "HPCRING_LSF_HOSTFILE": hostfile,
                             "LSB_DJOB_HOSTFILE": "/nonexistent"}, hostname="node1")
    assert (topo.rank, topo.size, topo.host, topo.local_rank) == (2, 4, "node1", 0)


def test_the_step_number_keeps_two_steps_stores_apart(tmp_path):
    hostfile = tmp_path / "h"
    hostfile.write_text("node1\nnode2\n")
    env = {"LSB_JOBID": "12", "LSF_PM_TASKID": "1", "HPCRING_LSF_HOSTFILE": str(hostfile)}
    topo = launchers.detect(env, hostname="node1")
    ports = [_store_ports(topo, {**env, "HPCRING_LSF_STEP": s}, (20000, 30000))[0] for s in ("0", "1")]
    assert ports[0] != ports[1]


@pytest.mark.parametrize("launch, hosts, per_node", [
    (["srun", "x"], ["n1"], 1), (["mpirun", "x"], ["n1"], 1), (LAUNCH, ["n 1"], 1), (LAUNCH, [], 1),
    (LAUNCH, ["n1"], 0)])
def test_step_argv_refuses_what_it_cannot_pin(launch, hosts, per_node):
    with pytest.raises(ValueError):
        lsf_steps.step_argv(launch, hosts, per_node)


def test_the_gang_check_is_one_task_a_host_naming_its_host(tmp_path):
    argv = lsf_steps.gang_argv(["node1", "node2"], ["/py", "-m", "hpcring.preflight", "--out", "/o d"], folder=tmp_path)
    assert argv[argv.index("blaunch"):] == ["blaunch", "-z", "node1 node2", "/py", "-m", "hpcring.preflight",
                                            "--out", "'/o d'"]
    assert (tmp_path / "hosts").read_text() == "node1\nnode2\n"
    assert f"HPCRING_LSF_HOSTFILE={tmp_path / 'hosts'}" in argv


def test_casualties_are_the_hosts_blaunch_could_not_start_tasks_on():
    text = ("some rank output\nblaunch: host node4 is not part of job <12>'s allocation (node1 node2)\n"
            "Traceback ...\nblaunch: host node5 is not part of job <12>'s allocation (node1 node2)\n")
    assert lsf_steps.casualties(text) == [("node4", "?", "Launch failed"), ("node5", "?", "Launch failed")]
    assert lsf_steps.FAILED_TASK.search(text)
    assert lsf_steps.casualties("rank 1 exited with 137\nKilled\n") == []   # blaunch names no task's end


def test_bhosts_unavailable_hosts_count_as_gone():
    text = ("HOST_NAME STATUS JL/U MAX NJOBS RUN SSUSP USUSP RSV\n"
            "node1 ok - 4 1 1 0 0 0\nnode2 unavail - 4 0 0 0 0 0\nnode3 unreach - 4 0 0 0 0 0\n"
            "node4 closed_Full - 4 4 4 0 0 0\nother unavail - 4 0 0 0 0 0\n")
    assert lsf_steps.parse_bhosts(text, ["node1", "node2", "node3", "node4"]) == {"node2": "unavail",
                                                                                 "node3": "unreach"}


def test_without_bhosts_no_host_is_called_gone(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert lsf_steps.gone_nodes(["node1"]) == {}


def test_allocation_hosts_are_the_slot_list_once_per_host(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("batch\nnode2\nnode2\nnode1\nnode1\nnode3\nnode3\n")
    env = {"LSB_JOBID": "12", "LSB_DJOB_HOSTFILE": str(hf)}
    assert lsf_steps.allocation_hosts(env) == ["batch", "node2", "node1", "node3"]
    assert lsf_steps.allocation_hosts({**env, "HPCRING_LSF_DROP_LAUNCH_NODE": "1"}) == ["node2", "node1", "node3"]
    # a step's own host file (in the loop's environment after a restart) is not the allocation
    assert lsf_steps.allocation_hosts({**env, "HPCRING_LSF_HOSTFILE": "/nonexistent"})[0] == "batch"
    assert lsf_steps.allocation_hosts({"LSB_MCPU_HOSTS": "nodeA 2 nodeB 2"}) == ["nodeA", "nodeB"]
    assert lsf_steps.allocation_hosts({}) == []


def test_kill_finds_the_steps_tasks_by_job_and_step_and_spares_the_rest():
    def sleeper(job, step):
        env = dict(os.environ, LSB_JOBID=job, HPCRING_LSF_STEP=step)
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    mine, next_step, other_job = sleeper("777001", "3"), sleeper("777001", "4"), sleeper("777002", "3")
    try:
        time.sleep(0.3)                # the children have exec'd: their environ is readable
        os.kill(mine.pid, 19)          # a frozen task (SIGSTOP) is killed as well
        assert mine.pid in lsf_steps.step_pids("777001", "3")
        assert lsf_steps.main(["kill", "777001", "3"]) == 0
        assert mine.wait(10) == -9
        assert next_step.poll() is None and other_job.poll() is None
    finally:
        for p in (mine, next_step, other_job):
            p.kill()
            p.wait(10)
    assert lsf_steps.main(["kill", "777001"]) == 2


def test_kill_step_runs_the_killer_through_blaunch_on_the_steps_hosts(tmp_path, monkeypatch):
    log = tmp_path / "argv"
    fake = tmp_path / "blaunch"
    # written whole, then renamed: the test reads it once it exists (a plain `> log` is seen
    # empty between the shell's truncate and its write, which made this test flaky under load)
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {log}.tmp && mv {log}.tmp {log}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert lsf_steps.kill_step("12", ["node1", "node3"], 2) == ["12 step 2 on node1,node3"]
    deadline = time.time() + 10
    while not log.exists() and time.time() < deadline:
        time.sleep(0.05)
    words = log.read_text().splitlines()
    assert words[:2] == ["-z", "node1 node3"] and words[-3:] == ["kill", "12", "2"]
    assert lsf_steps.kill_step("12", [], 2) == [] and lsf_steps.kill_step("12", ["n"], None) == []


def test_a_rank_of_a_loop_step_leaves_the_job_to_the_loop():
    assert lsf.end_job_argv({"LSB_JOBID": "12"}) == ["bkill", "12"]
    assert lsf.end_job_argv({"LSB_JOBID": "12", "HPCRING_LSF_STEP": "0"}) is None


def test_the_loop_chooses_its_scheduler_module_by_name():
    assert steps.SCHEDULERS == {"slurm": slurm_steps, "lsf": lsf_steps}
    for mod in steps.SCHEDULERS.values():
        for name in ("allocation_hosts", "job_id", "step_argv", "gang_argv", "casualties", "gone_nodes",
                     "kill_step", "FAILED_TASK", "LAUNCHER"):
            assert hasattr(mod, name), (mod.__name__, name)
    with pytest.raises(SystemExit):
        steps.main(["--nodes", "1", "--tasks-per-node", "1", "--max-restarts", "1", "--folder", "/x",
                    "--scheduler", "pbs", "--", "x"])


def _lsf_job(site, **given):
    return resolve_job(site, "x.py", [], given, environ={})


def test_an_lsf_blaunch_site_holds_the_spares_and_runs_the_loop():
    site = load_site("devcluster-lsf")
    job = _lsf_job(site, nodes=2, spare_nodes=1, tasks_per_node=2)
    plan_step_restarts(site, job, 1, environ={})
    plan_preflight(site, job, True, environ={})
    text = render_script(site, job, "python3 -u -m submitit.core._submit /j/%j", "/j/%j", python="/py")
    assert "#BSUB -n 6\n#BSUB -R \"span[ptile=2]\"\n" in text          # 3 hosts of 2 slots
    assert ("/py -u -m hpcring.steps --nodes=2 --min-nodes=2 --tasks-per-node=2 --max-restarts=1 --folder=/j/%j "
            "--scheduler=lsf --cluster=devcluster-lsf ") in text and " --preflight " in text and "\\\n  blaunch -u \"$HOSTFILE\"" in text
    plain = render_script(site, _lsf_job(site, nodes=2, tasks_per_node=2), "python3 -u -m x /j/%j", "/j/%j",
                          python="/py")
    assert "#BSUB -n 4\n" in plain and "hpcring.steps" not in plain


def test_an_lsf_jsrun_site_refuses_spares_and_preflight_with_the_reason():
    site = load_site("lsf-summit")
    job = _lsf_job(site, nodes=2, spare_nodes=1)
    with pytest.raises(UsageError) as e:
        plan_step_restarts(site, job, 1, environ={})
    assert "blaunch" in e.value.message and "jsrun" in e.value.message
    with pytest.raises(UsageError) as e:
        plan_preflight(site, _lsf_job(site, nodes=2), True, environ={})
    assert "blaunch" in e.value.message

"""hpcring's readers of Slurm's output, fed what Slurm 22.05.8 and 24.11.5 printed on the dev cluster.

The texts are the two releases' answers to the same commands (docs/devcluster.md, "Two Slurm
releases"); job ids and times differ. Each reader must give the same answer for both."""
from __future__ import annotations

import subprocess

import pytest

from hpcring.schedulers import slurm, slurm_steps

# release -> (running job id, array job id, the outputs)
RECORDED = {
    "22.05": {
        "job": "2090", "array": "2093",
        "squeue_r": "2090|RUNNING|node[1-2]\n",
        "squeue_running": "RUNNING|2|node[1-2]|2090\n",
        "squeue_steps": "2090.0\n2090.batch\n",
        "sacct": "2090|CANCELLED by 0|0:0|node[1-2]\n2093_0|FAILED|3:0|node1\n2093_1|FAILED|3:0|node1\n",
        "sacct_submit": "2090|2026-11-28T16:45:56\n",
        "scontrol_job": ("JobId=2090 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A "
                         "Priority=4294901622 Nice=0 Account=root QOS=normal JobState=RUNNING Reason=None "
                         "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 "
                         "RunTime=00:00:02 TimeLimit=01:00:00 TimeMin=N/A SubmitTime=2026-11-28T16:50:28 "
                         "EligibleTime=2026-11-28T16:50:28 AccrueTime=2026-11-28T16:50:28 "
                         "StartTime=2026-11-28T16:50:28 EndTime=2026-11-28T17:50:28 Deadline=N/A "
                         "SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-28T16:50:28 Scheduler=Main "
                         "Partition=debug AllocNode:Sid=localhost:25943 ReqNodeList=(null) ExcNodeList=(null) "
                         "NodeList=node[1-2] BatchHost=node1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 "
                         "ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=2,billing=2 Socks/Node=* "
                         "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 "
                         "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) "
                         "Network=(null) Command=(null) WorkDir=/work/main StdErr=/dev/null StdIn=/dev/null "
                         "StdOut=/dev/null Power=\n"),
        "srun_false": "srun: error: node3: task 0: Exited with exit code 1\n",
        "srun_killed": "srun: error: node2: task 1: Killed\nsrun: Force Terminated StepId=2092.0\n",
        "config": "ClusterName             = devcluster\nEpilog                  = (null)\nSLURM_VERSION           = 22.05.8\n",
    },
    "24.11": {
        "job": "12", "array": "16",
        "squeue_r": "12|RUNNING|node[1-2]\n",
        "squeue_running": "RUNNING|2|node[1-2]|12\n",
        "squeue_steps": "12.0\n12.batch\n",
        "sacct": "12|CANCELLED by 0|0:0|node[1-2]\n16_0|FAILED|3:0|node1\n16_1|FAILED|3:0|node1\n",
        "sacct_submit": "12|2026-11-28T16:45:57\n",
        "scontrol_job": ("JobId=12 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 "
                         "Nice=0 Account=root QOS=normal JobState=RUNNING Reason=None Dependency=(null) "
                         "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:01 "
                         "TimeLimit=01:00:00 TimeMin=N/A SubmitTime=2026-11-28T16:50:30 "
                         "EligibleTime=2026-11-28T16:50:30 AccrueTime=2026-11-28T16:50:30 "
                         "StartTime=2026-11-28T16:50:31 EndTime=2026-11-28T17:50:31 Deadline=N/A "
                         "SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-28T16:50:31 Scheduler=Main "
                         "Partition=debug AllocNode:Sid=devcluster-host:25943 ReqNodeList=(null) "
                         "ExcNodeList=(null) NodeList=node[1-2] BatchHost=node1 NumNodes=2 NumCPUs=2 "
                         "NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* ReqTRES=cpu=2,mem=4G,node=2,billing=2 "
                         "AllocTRES=cpu=2,node=2,billing=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* "
                         "MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
                         "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) "
                         "WorkDir=/work/main StdErr=/dev/null StdIn=/dev/null StdOut=/dev/null\n"),
        "srun_false": "srun: error: node1: task 0: Exited with exit code 1\n",
        "srun_killed": "srun: error: node3: task 1: Killed\nsrun: Force Terminated StepId=14.0\n",
        # 24.11 leaves unset Prolog/Epilog out of `scontrol show config` (22.05 printed "(null)"), and its
        # `scontrol show job` has ReqTRES= and AllocTRES= where 22.05 had TRES=, and no Power=
        "config": "ClusterName             = devcluster\nSLURM_VERSION           = 24.11.5\n",
    },
}


def _answer(out: dict, monkeypatch) -> None:
    """slurm._run answers each command with the release's recorded output."""
    def fake(cmd, timeout=None):
        key = {("sacct", "JobID,State,ExitCode,NodeList"): "sacct", ("sacct", "JobID,Submit"): "sacct_submit",
               ("squeue", "%i|%T|%N"): "squeue_r", ("squeue", "%T|%D|%N|%A"): "squeue_running",
               ("scontrol", "config"): "config", ("scontrol", str(out["job"])): "scontrol_job"}[(cmd[0], cmd[-1])]
        return subprocess.CompletedProcess(cmd, 0, out[key], "")
    monkeypatch.setattr(slurm, "_run", fake)


@pytest.mark.parametrize("release", sorted(RECORDED))
def test_job_states_read_alike(release, monkeypatch):
    out = RECORDED[release]
    _answer(out, monkeypatch)
    job, arr = out["job"], out["array"]
    recs = [slurm.JobRecord(j, "slurm", "", "", 0, "", "", 0.0) for j in (job, f"{arr}_0", f"{arr}_1")]
    got = slurm.states(recs)
    assert got[job].state == "CANCELLED" and got[job].nodelist == "node[1-2]"
    for t in (f"{arr}_0", f"{arr}_1"):
        assert got[t].state == "FAILED" and got[t].exit_code == 3 and got[t].nodelist == "node1"


@pytest.mark.parametrize("release", sorted(RECORDED))
def test_running_job_and_its_steps_read_alike(release, monkeypatch):
    out = RECORDED[release]
    _answer(out, monkeypatch)
    assert slurm._running(out["job"]) == (2, "node[1-2]", out["job"])
    assert slurm.run_ending(out["job"], 0) is None
    assert slurm.queued_at(out["job"]) is not None
    steps = [w for w in out["squeue_steps"].split() if w == f"{out['job']}.0"]
    assert steps == [f"{out['job']}.0"]  # kill_step's filter keeps the numbered step, not .batch


@pytest.mark.parametrize("release", sorted(RECORDED))
def test_cluster_name_reads_alike(release, monkeypatch):
    _answer(RECORDED[release], monkeypatch)
    assert slurm.cluster_name(site=None) == "devcluster"  # type: ignore[arg-type]


@pytest.mark.parametrize("release", sorted(RECORDED))
def test_srun_messages_read_alike(release):
    out = RECORDED[release]
    m = slurm_steps.CASUALTY.search(out["srun_killed"])
    assert m and m.group(2) == "1" and m.group(3) == "Killed"
    assert slurm._SRUN_CASUALTY.search(out["srun_killed"]).group(3) == "Killed"
    assert slurm_steps.FAILED_TASK.search(out["srun_false"])
    assert not slurm_steps.CASUALTY.search(out["srun_false"])  # an exit code is not a signal


# An array of 4 tasks, at most 1 at once: sacct's line for the tasks not started names them as a range.
ARRAYS = {
    "22.05": ("2131", "2131_0|CANCELLED by 0|0:0|node1\n2131_[1-3%1]|CANCELLED by 0|0:0|None assigned\n", "",
              "CANCELLED", "CANCELLED"),
    "24.11": ("34", "34_0|RUNNING|0:0|node1\n34_[1-3%1]|PENDING|0:0|None assigned\n",
              "34_1|PENDING|\n34_2|PENDING|\n34_3|PENDING|\n34_0|RUNNING|node1\n", "RUNNING", "PENDING"),
}


@pytest.mark.parametrize("release", sorted(ARRAYS))
def test_array_task_ranges_read_alike(release, monkeypatch):
    job, sacct, squeue, first, rest = ARRAYS[release]

    def fake(cmd, timeout=None):
        return subprocess.CompletedProcess(cmd, 0, sacct if cmd[0] == "sacct" else squeue, "")
    monkeypatch.setattr(slurm, "_run", fake)
    tasks = [f"{job}_{t}" for t in range(4)]
    got = slurm.states([slurm.JobRecord(t, "slurm", "", "", 0, "", "", 0.0) for t in tasks])
    assert got[tasks[0]].state == first
    assert {got[t].state for t in tasks[1:]} == {rest}

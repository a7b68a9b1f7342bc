"""The step loop (hpcring.steps) and the --spare-nodes/--min-nodes options, without a cluster.

The loop's decisions run against a stand-in ``srun`` (a shell script on PATH that prints srun's
own casualty line and exits as srun does); the real one is tested on the dev cluster
(tests/devcluster/test_steps_devcluster.py).
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from hpcring import restarts, steps, steps_record
from hpcring.config.jobspec import plan_step_restarts, resolve_job
from hpcring.config.site import load_site
from hpcring.errors import UsageError
from hpcring.schedulers import slurm_steps


# ---- pure parts ------------------------------------------------------------------------------

def test_choose_keeps_survivors_then_takes_spares_in_allocation_order():
    alloc = ["n1", "n2", "n3", "n4", "n5"]
    assert steps.choose(alloc, {"n2"}, {}, ["n1", "n2"], 2, 2) == ["n1", "n3"]
    assert steps.choose(alloc, {"n1"}, {"n4": "down"}, ["n3", "n1"], 3, 3) == ["n3", "n2", "n5"]
    assert steps.choose(["n1", "n2"], {"n2"}, {}, ["n1", "n2"], 2, 2) is None          # no spare, no shrink
    assert steps.choose(["n1", "n2"], {"n2"}, {}, ["n1", "n2"], 2, 1) == ["n1"]        # --min-nodes 1
    assert steps.choose(["n1", "n2"], {"n1", "n2"}, {}, ["n1", "n2"], 2, 1) is None


def test_step_argv_pins_the_step_to_the_chosen_nodes():
    argv = slurm_steps.step_argv(["srun", "--unbuffered", "--kill-on-bad-exit=1", "python", "x.py"],
                                 ["node1", "node3"], 4)
    assert argv[0] == "srun" and argv[-2:] == ["python", "x.py"]
    assert {"--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--nodelist=node[1,3]", "--overlap"} <= set(argv)
    with pytest.raises(ValueError):
        slurm_steps.step_argv(["mpirun", "x"], ["n1"], 1)


def test_an_elastic_node_step_runs_its_workers_on_that_node_alone_and_survives_their_failures():
    argv = slurm_steps.node_step_argv("node3", 2, ["python", "train.py", "--lr", "0.1"])
    assert argv[0] == "srun" and argv[-4:] == ["python", "train.py", "--lr", "0.1"]
    assert {"--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--nodelist=node3", "--kill-on-bad-exit=0"} <= set(argv)
    assert "--kill-on-bad-exit=1" not in argv


def test_srun_casualty_lines():
    text = ("srun: error: node2: task 1: Killed\nsrun: launch/slurm: _step_signal: Terminating StepId=1.0\n"
            "srun: error: node1: tasks 0,2-3: Terminated\nsrun: error: node4: task 7: Exited with exit code 1\n")
    assert slurm_steps.casualties(text) == [("node2", "1", "Killed"), ("node1", "0,2-3", "Terminated")]
    assert slurm_steps.FAILED_TASK.search("srun: error: node4: task 7: Exited with exit code 1")
    launch = "srun: error: Task launch for StepId=9.1 failed on node node3: Communication connection failure\n"
    assert slurm_steps.casualties(launch + text)[0] == ("node3", "?", "Launch failed")
    v = restarts.classify_step({}, 2, None, slurm_steps.casualties(launch), {}, ["node1", "node3"])
    assert v.restart and v.nodes == ("node3",) and "could not start" in v.cause


def test_folder_of_expands_job_and_array_ids():
    env = {"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2"}
    assert steps.folder_of("/j/%j", env) == Path("/j/42")
    assert steps.folder_of("/j/%A_%a", env) == Path("/j/40_2")


def _records(*ranks, error=None, code=1):
    return {r: {"rank": r, "host": f"n{r}", "exit_code": code, "error": error, "ended": 10.0} for r in ranks}


def test_classify_step_sides():
    hosts = ["n1", "n2"]
    # srun's word alone: a node whose tasks were SIGKILLed is lost
    v = restarts.classify_step({}, 2, None, [("n2", "1", "Killed")], {}, hosts)
    assert v.restart and v.nodes == ("n2",)
    # a segfault is the code's
    v = restarts.classify_step({}, 2, None, [("n2", "1", "Segmentation fault")], {}, hosts)
    assert not v.restart
    # a rank's own error wins over the launcher's lines
    v = restarts.classify_step(_records(0, error="ValueError: bad"), 2, None, [("n2", "1", "Killed")], {}, hosts)
    assert not v.restart and v.cause.startswith("code error")
    # a node the scheduler holds down is NODE_FAIL
    v = restarts.classify_step({}, 2, None, [], {"n2": "down*"}, hosts)
    assert v.restart and v.nodes == ("n2",)
    # every node killed at once: no single bad node
    v = restarts.classify_step({}, 1, None, [("n1", "0", "Killed")], {}, ["n1"])
    assert not v.restart
    # the report decides when there is one
    report = {"headline": "allreduce#3: rank 1 (n2) unreachable", "categories": {"unreachable": [1]},
              "hosts": hosts, "trigger": {"time": 5.0}}
    v = restarts.classify_step({}, 2, report, [], {}, hosts)
    assert v.restart and v.nodes == ("n2",)


@pytest.mark.parametrize("text", ["", "{", "[]", '{"steps": 3}', '{"steps": [1, "x", {"size": "2"}]}',
                                  '{"steps": [{"size": 99}]}', '{"steps": [{"size": -1}]}'])
def test_a_bad_steps_file_never_breaks_status(tmp_path, text):
    (tmp_path / steps_record.STEPS_FILE).write_text(text)
    assert steps_record.final_size(tmp_path, 4) == 4
    assert isinstance(steps_record.step_lines(steps_record.read_steps(tmp_path)), list)


def test_final_size_is_the_last_steps():
    assert steps_record.final_size("/nonexistent", 4) == 4


# ---- the options -------------------------------------------------------------------------------

@pytest.fixture
def devcluster():
    return load_site("devcluster")


def _job(site, **given):
    return resolve_job(site, "x.py", [], given, environ={})


def test_spares_need_restarts(devcluster):
    job = _job(devcluster, nodes=2, spare_nodes=1)
    with pytest.raises(UsageError, match=r"--spare-nodes 1 but max-restarts is 0 \(default\)"):
        plan_step_restarts(devcluster, job, None, environ={})
    plan_step_restarts(devcluster, job, 2, environ={})
    assert job.step_restarts == 2 and job.alloc_nodes == 3
    job = _job(devcluster, nodes=2, spare_nodes=1)
    plan_step_restarts(devcluster, job, None, environ={"HPCRING_MAX_RESTARTS": "3"})
    assert job.step_restarts == 3 and job.sources["step_restarts"] == "env HPCRING_MAX_RESTARTS"


def test_no_step_loop_without_spares_or_a_lower_min(devcluster):
    job = _job(devcluster, nodes=2, min_nodes=2)
    plan_step_restarts(devcluster, job, 3, environ={})
    assert job.step_restarts == 0 and job.alloc_nodes == 2


@pytest.mark.parametrize("given, words", [
    ({"nodes": 2, "min_nodes": 3}, "--min-nodes 3 is above --nodes 2"),
    ({"nodes": 1, "spare_nodes": 100000}, "--spare-nodes"),
])
def test_bad_combinations(devcluster, given, words):
    with pytest.raises(UsageError) as e:
        _job(devcluster, **given)
    assert words in e.value.message


def test_spares_beyond_the_partition():
    site = load_site("slurm-tcp")            # partition cpu: max_nodes 16
    _job(site, nodes=16, partition="cpu")
    with pytest.raises(UsageError, match="more than partition 'cpu' max_nodes 16"):
        _job(site, nodes=15, spare_nodes=2, partition="cpu")


@pytest.mark.parametrize("site_name", ["local", "lsf-summit"])   # lsf-summit: jsrun, no per-step host list
def test_sites_without_the_step_loop_refuse_spares(site_name):
    site = load_site(site_name)
    with pytest.raises(UsageError) as e:
        job = _job(site, nodes=2, spare_nodes=1)
        plan_step_restarts(site, job, 1, environ={})
    assert "spare" in e.value.message.lower()


def test_the_rendered_script_holds_the_spares_and_the_loop(devcluster):
    from hpcring.schedulers.render import render_script
    job = _job(devcluster, nodes=2, spare_nodes=1, min_nodes=1)
    plan_step_restarts(devcluster, job, 2, environ={})
    text = render_script(devcluster, job, "python3 -u -m submitit.core._submit /j/%j", "/j/%j", python="/py")
    assert "#SBATCH --nodes=3\n#SBATCH --no-kill\n" in text
    assert ("/py -u -m hpcring.steps --nodes=2 --min-nodes=1 --tasks-per-node=1 --max-restarts=2 "
            "--folder=/j/%j -- \\\n  srun ") in text
    plain = render_script(devcluster, _job(devcluster, nodes=2), "python3 -u -m x /j/%j", "/j/%j", python="/py")
    assert "--no-kill" not in plain and "hpcring.steps" not in plain and "#SBATCH --nodes=2\n" in plain


# ---- the loop against a stand-in srun -----------------------------------------------------------

FAKE_SRUN = r"""#!/bin/bash
# srun as the loop sees it: the step's node list, then srun's own casualty line and exit status.
for a in "$@"; do case "$a" in --nodelist=*) nodes="${a#--nodelist=}";; esac; done
n=$(cat "$STATE/count" 2>/dev/null || echo 0); echo $((n + 1)) > "$STATE/count"
echo "$nodes $HPCRING_RESTART_COUNT" >> "$STATE/steps"
what=$(sed -n "$((n + 1))p" "$STATE/plan")
case "$what" in
  ok) exit 0;;
  kill:*) echo "srun: error: ${what#kill:}: task 1: Killed" >&2; exit 137;;
  segv:*) echo "srun: error: ${what#segv:}: task 1: Segmentation fault" >&2; exit 139;;
  *) exit 1;;
esac
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("squeue", "#!/bin/sh\nexit 0\n"), ("sinfo", "#!/bin/sh\nexit 0\n"),
                       ("scancel", "#!/bin/sh\nexit 0\n")):
        p = bin_ / name
        p.write_text(body)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    state = tmp_path / "state"
    state.mkdir()
    folder = tmp_path / "jobs" / "7"
    folder.mkdir(parents=True)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", STATE=str(state), SLURM_JOB_ID="7",
               SLURM_JOB_NODELIST="n[1-3]", SLURM_CLUSTER_NAME="c", HPCRING_STEP_GRACE="0")
    env.pop("HPCRING_RESTART_COUNT", None)

    def run(plan_lines, nodes=2, min_nodes=None, max_restarts=2, preflight=False):
        (state / "plan").write_text("\n".join(plan_lines) + "\n")
        plan = steps.Plan(nodes, min_nodes or nodes, 1, max_restarts, folder, ["srun", "true"], preflight=preflight)
        rc = steps.run(plan, env)
        ran = (state / "steps").read_text().splitlines() if (state / "steps").exists() else []
        return rc, ran, json.loads((folder / steps_record.STEPS_FILE).read_text())
    return run


def test_loop_restarts_on_the_spare_and_counts(fake_slurm):
    rc, ran, data = fake_slurm(["kill:n2", "ok"])
    assert rc == 0 and ran == ["n[1-2] 0", "n[1,3] 1"]
    assert data["steps"][0]["blamed"] == {"n2": "lost (task 1 killed; srun)"}
    assert data["steps"][1]["spares"] == ["n3"] and data["steps"][1]["end"] == "COMPLETED"


def test_loop_stops_on_a_code_signal_and_when_restarts_are_used_up(fake_slurm):
    rc, ran, data = fake_slurm(["segv:n2"])
    assert rc == 139 and len(ran) == 1 and data["steps"][0]["decision"] == "not restarted (no node-level fault)"


def test_loop_with_restarts_used_up(fake_slurm):
    rc, ran, data = fake_slurm(["kill:n2", "kill:n3"], max_restarts=1)
    assert rc == 137 and ran == ["n[1-2] 0", "n[1,3] 1"]
    assert data["steps"][1]["decision"] == "not restarted: --max-restarts 1 used up"


def test_loop_shrinks_to_min_nodes_when_no_spare_is_left(fake_slurm):
    rc, ran, data = fake_slurm(["kill:n2", "kill:n3", "ok"], nodes=2, min_nodes=1, max_restarts=3)
    assert rc == 0 and ran == ["n[1-2] 0", "n[1,3] 1", "n1 2"]
    assert [s["size"] for s in data["steps"]] == [2, 2, 1]


def test_loop_without_enough_nodes_left(fake_slurm):
    rc, ran, data = fake_slurm(["kill:n2", "kill:n3"], nodes=2, max_restarts=5)
    assert rc == 137 and len(ran) == 2
    assert data["steps"][1]["decision"].startswith("not restarted: 1 healthy node(s) left")


def test_the_node_history_gets_each_blame(fake_slurm, tmp_path):
    fake_slurm(["kill:n2", "ok"])
    lines = (tmp_path / "jobs" / ".hpcring" / "node-history.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    assert len(lines) == 1 and rec["node"] == "n2" and rec["key"] == "slurm-c-7" and rec["cluster"] == "c"


def test_main_refuses_a_bad_plan(capsys):
    for argv in (["--nodes", "2", "--min-nodes", "3", "--tasks-per-node", "1", "--max-restarts", "1",
                  "--folder", "/x", "--", "srun"],
                 ["--nodes", "2", "--tasks-per-node", "1", "--max-restarts", "1", "--folder", "/x"]):
        with pytest.raises(SystemExit) as e:
            steps.main(argv)
        assert e.value.code == 2


# ---- --preflight ----------------------------------------------------------------------------------

def test_preflight_precedence_and_the_rendered_loop(devcluster):
    from hpcring.config.jobspec import plan_preflight
    from hpcring.schedulers.render import render_script
    job = _job(devcluster, nodes=2)
    plan_preflight(devcluster, job, None, environ={})
    assert not job.preflight and job.sources["preflight"] == "site devcluster"
    plan_preflight(devcluster, job, None, environ={"HPCRING_PREFLIGHT": "1", "HPCRING_PREFLIGHT_MIN_GBPS": "2.5"})
    assert job.preflight and job.sources["preflight"] == "env HPCRING_PREFLIGHT" and job.preflight_min_gbps == 2.5
    plan_preflight(devcluster, job, False, environ={"HPCRING_PREFLIGHT": "1"})
    assert not job.preflight and job.sources["preflight"] == "cli"
    plan_preflight(devcluster, job, True, environ={})
    text = render_script(devcluster, job, "python3 -u -m x /j/%j", "/j/%j", python="/py")
    assert "#SBATCH --no-kill\n" in text and "--max-restarts=0" in text and "--preflight --gpus=0 --" in text


@pytest.mark.parametrize("site_name", ["lsf-summit", "local"])
def test_preflight_needs_the_step_loop(site_name):
    from hpcring.config.jobspec import plan_preflight
    site = load_site(site_name)
    job = _job(site, nodes=1)
    with pytest.raises(UsageError, match="--preflight"):
        plan_preflight(site, job, True, environ={})


def test_loop_leaves_preflight_failures_out(fake_slurm, monkeypatch):
    from hpcring.preflight import Verdict
    monkeypatch.setattr(steps, "_preflight", lambda plan, sched, alloc, env: (
        setattr(plan, "checked", {"ok": False, "bad": {"n1": "no answer"}, "seconds": 1.0}) or {"n1": "preflight: no answer"}))
    rc, ran, data = fake_slurm(["ok"], preflight=True)
    assert rc == 0 and ran == ["n[2-3] 0"] and data["preflight"]["bad"] == {"n1": "no answer"}
    assert steps_record.step_lines(data)[0].startswith("preflight  1.0 s  left out n1 (no answer)")
    assert Verdict  # the real verdict type is what _preflight reads (tests/integration: test_steps_devcluster)


def _fake_verdict(monkeypatch, bad, unsure=()):
    from hpcring import preflight
    from hpcring.schedulers import slurm_steps as sched
    v = preflight.Verdict(ok=not bad, bad=dict(bad), seconds=1.0, lines=["preflight: stand-in"], unsure=set(unsure))
    monkeypatch.setattr(preflight, "read_verdict", lambda out, hosts: v)
    monkeypatch.setattr(sched, "gang_argv", lambda hosts, cmd, folder=None: ["true"])


def test_preflight_unsure_nodes_are_left_out_but_not_recorded(fake_slurm, tmp_path, monkeypatch):
    _fake_verdict(monkeypatch, {"n2": "a version tie"}, unsure={"n2"})
    rc, ran, data = fake_slurm(["ok"], nodes=2, preflight=True)
    assert rc == 0 and ran == ["n[1,3] 0"] and data["preflight"]["bad"] == {"n2": "a version tie"}
    assert not (tmp_path / "jobs" / ".hpcring" / "node-history.jsonl").exists()


def test_preflight_failing_most_nodes_suspects_the_environment(fake_slurm, monkeypatch):
    _fake_verdict(monkeypatch, {"n1": "torch 2.12", "n2": "torch 2.12"})
    rc, ran, data = fake_slurm(["ok"], nodes=2, preflight=True)
    assert rc == 0 and ran == ["n[1-2] 0"] and data["preflight"]["suspect_environment"]


def test_preflight_without_a_verdict_leaves_nobody_out(fake_slurm, monkeypatch):
    from hpcring import preflight
    from hpcring.errors import BootstrapError
    from hpcring.schedulers import slurm_steps as sched

    def no_secret(out, hosts):
        raise BootstrapError("no secret")
    monkeypatch.setattr(preflight, "read_verdict", no_secret)
    monkeypatch.setattr(sched, "gang_argv", lambda hosts, cmd, folder=None: ["true"])
    rc, ran, data = fake_slurm(["ok"], nodes=2, preflight=True)
    assert rc == 0 and ran == ["n[1-2] 0"] and data["preflight"]["error"]

"""Job arrays, sweeps and dependencies and the Scheduler interface's
batched state query: spec parsing over generated inputs, the rendered scripts (golden),
task records, `status` of an array, and one scheduler query for many jobs."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcring import jobstatus, submit
from hpcring.config.arrays import (MAX_ARRAY_INDEX, ArraySpec, Dependency, parse_array, parse_dependency,
                                   parse_sweep, sweep_args)
from hpcring.config.jobspec import resolve_job
from hpcring.config.site import load_site
from hpcring.errors import UsageError
from hpcring.schedulers.render import render_script
from hpcring.schedulers import base, get
from hpcring.schedulers.base import new_record

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
COMMAND = "/usr/bin/python3 -u -m submitit.core._submit /jobs/%j"


# ---- --array -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,indices,limit,slurm,lsf", [
    ("0-15%4", range(16), 4, "0-15%4", "[1-16]%4"),
    ("0-15:2", range(0, 16, 2), None, "0,2,4,6,8,10,12,14", "[1,3,5,7,9,11,13,15]"),
    ("1,3,8", [1, 3, 8], None, "1,3,8", "[2,4,9]"),
    ("8,0-3", [0, 1, 2, 3, 8], None, "0-3,8", "[1-4,9]"),
    ("7", [7], None, "7", "[8]"),
    ("0-2%2", [0, 1, 2], 2, "0-2%2", "[1-3]%2"),
])
def test_array_specs(spec, indices, limit, slurm, lsf):
    a = parse_array(spec)
    assert a == ArraySpec(tuple(indices), limit)
    assert (a.slurm(), a.lsf()) == (slurm, lsf)     # LSF's indices start at 1: task i is index i + 1


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 3000), min_size=1, max_size=40), st.none() | st.integers(1, 100))
def test_any_index_set_round_trips_through_slurms_syntax(indices, limit):
    a = ArraySpec(tuple(sorted(indices)), limit)
    assert parse_array(a.slurm()) == a


_VALID = re.compile(r"(\d+(-\d+(:\d+)?)?)(,\d+(-\d+(:\d+)?)?)*(%\d+)?")


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="0123456789-:,% x\n\u0663", max_size=14))
def test_generated_array_specs_parse_or_say_what_is_wrong(spec):
    """Anything that is not Slurm's syntax, or asks for nonsense (backwards, step 0, limit 0, an
    index twice), is a UsageError naming --array and giving the syntax; the rest parses."""
    try:
        a = parse_array(spec)
    except UsageError as exc:
        assert exc.message.startswith("--array ") and exc.hint
        return
    assert _VALID.fullmatch(spec) and a.indices and all(0 <= i <= MAX_ARRAY_INDEX for i in a.indices)
    assert len(set(a.indices)) == len(a.indices) and list(a.indices) == sorted(a.indices)


@pytest.mark.parametrize("spec,words", [
    ("", "no indices"), ("%4", "needs --sweep"), ("3-1", "backwards"), ("0-9:0", "step"), ("0-3%0", "limit"),
    ("1,1", "twice"), ("a-b", "not an index"), ("0-2000000", "above"), ("0-15%x", "whole number"),
])
def test_bad_array_specs(spec, words):
    with pytest.raises(UsageError, match=words):
        parse_array(spec)


def test_a_sweep_with_array_picks_or_limits_its_combinations():
    assert parse_array("%2", tasks=4) == ArraySpec((0, 1, 2, 3), 2)
    assert parse_array("1,3", tasks=4).indices == (1, 3)
    with pytest.raises(UsageError, match="sweep has 4 combination"):
        parse_array("0-4", tasks=4)


# ---- --sweep -------------------------------------------------------------------------------

def test_sweep_is_every_combination_first_flag_slowest():
    combos = parse_sweep(["lr=0.1,0.01", "bs=32,64"])
    assert combos == [{"lr": "0.1", "bs": "32"}, {"lr": "0.1", "bs": "64"},
                      {"lr": "0.01", "bs": "32"}, {"lr": "0.01", "bs": "64"}]
    assert sweep_args(combos[2]) == ["--lr", "0.01", "--bs", "32"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="ab_-=,1 .\t$;'", max_size=10), min_size=1, max_size=3))
def test_generated_sweeps_parse_or_say_what_is_wrong(items):
    try:
        combos = parse_sweep(items)
    except UsageError as exc:
        assert exc.message.startswith("--sweep") and exc.hint
        return
    names = [i.partition("=")[0] for i in items]
    assert all(set(c) == set(names) for c in combos) and len(combos) >= 1
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", n) for n in names)


@pytest.mark.parametrize("items,words", [
    (["lr"], "NAME=V1"), (["1x=3"], "NAME=V1"), (["lr="], "empty"), (["lr=1,,2"], "empty"),
    (["lr=1", "lr=2"], "twice"), (["lr=1,1"], "twice"), (["lr=a\x1bb"], "control"),
])
def test_bad_sweeps(items, words):
    with pytest.raises(UsageError, match=words):
        parse_sweep(items)


# ---- --dependency / --after ----------------------------------------------------------------

def test_dependencies():
    d = parse_dependency("afterok:38:39_2")
    assert d == Dependency("afterok", ("38", "39_2"))
    assert (d.slurm(), d.lsf()) == ("afterok:38:39_2", "done(38) && done(39[3])")
    assert parse_dependency(None, ["40"]) == Dependency("afterok", ("40",))
    assert parse_dependency("afterany:5").lsf() == "ended(5)"
    assert parse_dependency("afternotok:5").lsf() == "exit(5)"
    assert parse_dependency(None, None) is None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="afterokny:_0123$;( ", max_size=16), st.lists(st.text(alphabet="0123_x;", max_size=5),
                                                                       max_size=2))
def test_generated_dependencies_parse_or_say_what_is_wrong(spec, after):
    try:
        d = parse_dependency(spec, after)
    except UsageError as exc:
        assert exc.message.startswith(("--dependency", "--after")) and exc.hint
        return
    assert d.kind in ("afterok", "afterany", "afternotok", "after")
    assert all(re.fullmatch(r"\d+(_\d+)?", j) for j in d.jobs)    # nothing else reaches a script


# ---- rendered scripts ----------------------------------------------------------------------

CASES = {
    "array": dict(array="0-15%4", dependency="afterok:38"),
    "sweep": dict(sweep=["lr=0.1,0.01", "bs=32,64"], after=["40_1"]),
}


@pytest.mark.parametrize("site_name", ["devcluster", "slurm-infiniband", "devcluster-lsf", "lsf-summit"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_array_scripts(site_name, case):
    site = load_site(site_name, {})
    job = resolve_job(site, "train.py", ["--lr", "0.1"], {"nodes": 2, "name": "golden"}, environ={},
                      **CASES[case])
    text = render_script(site, job, COMMAND, "/jobs/%j", python="/usr/bin/python3")
    path = GOLDEN / f"{site_name}-{case}.sh"
    if os.environ.get("HPCRING_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()
    if site.config.scheduler == "slurm":
        assert "#SBATCH --hold" in text and "%A_%a_0_log.out" in text and "/%j_" not in text   # %j: the task's own id
        assert 'export HPCRING_ARRAY_TASK="$SLURM_ARRAY_TASK_ID"' in text
    else:
        assert "HPCRING_ARRAY_TASK=$((LSB_JOBINDEX - 1))" in text and "%J_%I_batch.out" in text


# ---- records and status --------------------------------------------------------------------

def test_task_records(state_dir, tmp_path):
    rec = new_record("38", "slurm", "dev", str(tmp_path / "38"), 2, "t", "/x/t.py", cluster="dev",
                     array=[0, 2, 4], array_limit=2, sweep=[{"lr": "1"}, {"lr": "2"}, {"lr": "3"}])
    task = base.load_record("38_2")
    assert (task.job_id, task.folder, task.parent, task.task_index) == ("38_2", str(tmp_path / "38_2"), "38", 2)
    assert base.load_record("slurm-dev-38_4").job_id == "38_4"
    with pytest.raises(UsageError, match="no array task 1: its tasks are 0,2,4"):
        base.load_record("38_1")
    assert [t.job_id for t in rec.tasks()] == ["38_0", "38_2", "38_4"]


class Recorder:
    """A recording wrapper around the scheduler command runner: every command, and a fixed answer."""

    def __init__(self, answers):
        self.calls, self.answers = [], answers

    def __call__(self, cmd, **kw):
        import subprocess
        self.calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, self.answers(cmd), "")


def test_status_of_50_slurm_jobs_is_one_query(cli, state_dir, tmp_path, monkeypatch):
    for i in range(50):
        new_record(str(1000 + i), "slurm", "dev", str(tmp_path / str(1000 + i)), 1, "t", "/x/t.py", cluster="dev")
    rec = Recorder(lambda cmd: "".join(f"{1000 + i}|COMPLETED|0:0|node1\n" for i in range(50)))
    from hpcring.schedulers import slurm
    monkeypatch.setattr(slurm, "run_command", rec)
    r = cli("status", "-n", "50")
    assert r.exit_code == 0, r.output
    assert r.output.count("COMPLETED") == 50
    assert [c[0] for c in rec.calls] == ["sacct"]                 # one query for all 50, not 50
    assert rec.calls[0][rec.calls[0].index("-j") + 1] == ",".join(str(1000 + i) for i in range(50))[::1] or True
    assert set(rec.calls[0][rec.calls[0].index("-j") + 1].split(",")) == {str(1000 + i) for i in range(50)}


def test_live_jobs_add_one_squeue_for_them_all(state_dir, tmp_path, monkeypatch):
    for i in range(5):
        new_record(str(2000 + i), "slurm", "dev", str(tmp_path / str(2000 + i)), 1, "t", "/x/t.py", cluster="dev")

    def answers(cmd):
        if cmd[0] == "sacct":         # accounting lags: the running ones still PENDING there
            return "2000|COMPLETED|0:0|node1\n2001|PENDING|0:0|None\n2002|PENDING|0:0|None\n"
        return "2001|RUNNING|node2\n2002|PENDING|\n"
    rec = Recorder(answers)
    from hpcring.schedulers import slurm
    monkeypatch.setattr(slurm, "run_command", rec)
    rows = {r.job_id: st for r, st, _ in jobstatus.recent(10)}
    assert [c[0] for c in rec.calls] == ["sacct", "squeue"]
    assert set(rec.calls[1][rec.calls[1].index("-j") + 1].split(",")) == {"2001", "2002", "2003", "2004"}
    assert (rows["2000"].state, rows["2001"].state, rows["2002"].state, rows["2003"].state) == \
        ("COMPLETED", "RUNNING", "PENDING", "UNKNOWN")


def test_status_summarises_an_array_in_one_line_per_state(cli, state_dir, tmp_path, monkeypatch):
    new_record("38", "slurm", "dev", str(tmp_path / "38"), 2, "t", "/x/t.py", cluster="dev",
               array=list(range(16)), array_limit=4, sweep=None)

    def answers(cmd):
        if cmd[0] == "sacct":         # sacct shows tasks not started yet as one line: 38_[6-15%4]
            return ("38_0|COMPLETED|0:0|node1\n38_1|COMPLETED|0:0|node1\n38_[5-15%4]|PENDING|0:0|None assigned\n"
                    "38_2|COMPLETED|0:0|node2\n38_3|FAILED|3:0|node2\n38_4|RUNNING|0:0|node1\n"
                    "38_5|RUNNING|0:0|node3\n")   # a started task keeps its place in the bracket a while
        return "38_4|RUNNING|node1\n38_5|RUNNING|node3\n" + "".join(f"38_{i}|PENDING|\n" for i in range(6, 16))
    rec = Recorder(answers)
    from hpcring.schedulers import slurm
    monkeypatch.setattr(slurm, "run_command", rec)
    r = cli("status", "38")
    assert r.exit_code == 0, r.output
    assert "3 COMPLETED, 1 FAILED, 2 RUNNING, 10 PENDING" in r.output
    assert re.search(r"38_3\s+FAILED\s+exit 3", r.output)
    assert [c[0] for c in rec.calls] == ["sacct", "squeue"]
    r = cli("status", "38_4")
    assert r.exit_code == 0 and "job 38_4  RUNNING" in r.output, r.output


def test_every_scheduler_implements_the_whole_interface():
    members = [m for m in dir(base.Scheduler) if not m.startswith("_")] + ["COMMAND"]
    for name in ("slurm", "lsf", "local"):
        mod = get(name)
        missing = [m for m in members if not hasattr(mod, m)]
        assert not missing, f"{name} lacks {missing}"
        for m in ("release", "run_on_nodes"):
            assert callable(getattr(mod, m)), (name, m)


def test_no_scheduler_command_runs_outside_schedulers():
    """sbatch, srun, scancel, squeue, sacct, scontrol, bsub, bjobs, bkill, blaunch, jsrun
    are run (and their output read) only in schedulers/ (and the dev cluster's own code)."""
    src = Path(__file__).resolve().parents[2] / "src" / "hpcring"
    words = r"(sbatch|srun|scancel|squeue|sacct|scontrol|bsub|bjobs|bkill|blaunch|jsrun)"
    call = re.compile(r"(?<!Literal)\[\s*\"" + words + r"\"")   # an argv list that starts with one (not a schema's names)
    found = []
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).as_posix()
        if rel.startswith(("schedulers/", "devcluster/")):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if call.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


# ---- bad input on the command line -----------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (["--array", "3-1"], "--array '3-1': the range '3-1' runs backwards"),
    (["--array", "0-3%0"], "limit %0"),
    (["--sweep", "lr"], "--sweep 'lr'"),
    (["--sweep", "lr=1,2", "--array", "0-5"], "sweep has 2 combination"),
    (["--dependency", "afterfoo:3"], "unknown kind 'afterfoo'"),
    (["--dependency", "afterok:$(reboot)"], "is not a job id"),
    (["--after", "3;rm"], "--after: '3;rm' is not a job id"),
])
def test_bad_flags_submit_nothing(cli, state_dir, tmp_path, args, words):
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    r = cli("submit", str(script), "--site", "local", *args, env={"HPCRING_JOB_DIR": str(tmp_path / "jobs")})
    assert r.exit_code == 2, r.output
    assert words in r.output and "hint:" in r.output
    assert not (tmp_path / "jobs").exists() and not list(state_dir.glob("*.json"))


def test_local_dependency_on_a_job_that_is_not_local(cli, state_dir, tmp_path):
    new_record("7", "slurm", "dev", str(tmp_path / "7"), 1, "t", "/x/t.py", cluster="dev")
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    r = cli("submit", str(script), "--site", "local", "--after", "7", env={"HPCRING_JOB_DIR": str(tmp_path / "jobs")})
    assert r.exit_code == 2 and "job 7 is a slurm job" in r.output, r.output
    r = cli("submit", str(script), "--site", "local", "--after", "99", env={"HPCRING_JOB_DIR": str(tmp_path / "jobs")})
    assert r.exit_code == 2 and "job 99 is not a job of the local backend" in r.output, r.output


def test_concurrent_tasks_of_one_lsf_array_meet_at_their_own_store_port():
    """LSF's elements share LSB_JOBID (and the secret): the store port must differ per task, or a
    task's ranks could join another task's store on a shared host (seen on the LSF emulation)."""
    from hpcring.bootstrap.init import _store_ports
    from hpcring.bootstrap.launchers import Topology
    import dataclasses
    fields = {f.name for f in dataclasses.fields(Topology)}
    topo = Topology(**{k: v for k, v in dict(rank=0, size=2, local_rank=0, local_size=1, node_rank=0, num_nodes=2,
                                              hosts=("node1", "node2"), launcher="blaunch", job_id="101").items()
                       if k in fields})
    plain = _store_ports(topo, {}, (29500, 29999))
    assert plain == _store_ports(topo, {}, (29500, 29999))            # every rank of a job agrees
    per_task = {_store_ports(topo, {"HPCRING_ARRAY_TASK": str(t)}, (29500, 29999))[0] for t in range(20)}
    assert len(per_task) == 20            # sha256 of "101/2/taskN": deterministic, no two alike here


def test_a_scheduler_that_cannot_answer_keeps_its_hint(cli, state_dir, tmp_path, monkeypatch):
    new_record("77", "slurm", "dev", str(tmp_path / "77"), 1, "t", "/x/t.py", cluster="dev")
    new_record("78", "slurm", "dev", str(tmp_path / "78"), 1, "t", "/x/t.py", cluster="dev",
               array=[0, 1], array_limit=None, sweep=None)
    monkeypatch.setenv("PATH", str(tmp_path))           # no sacct here
    for ref in ("77", "78", "78_1"):
        r = cli("status", ref)
        assert r.exit_code == 1 and "`sacct` is not on PATH" in r.output and "login node" in r.output, r.output
    r = cli("status")
    assert r.exit_code == 0 and r.output.count("`sacct` is not on PATH") == 2, r.output


def test_an_array_task_runs_its_own_pickle_in_a_folder_another_job_left(state_dir, tmp_path):
    """Job ids of two clusters overlap (the dev cluster's Slurm and its LSF emulation both start at
    1): a task folder may already hold another job's pickle. The task must get this job's, or it
    runs the other job's function (seen: an LSF sweep task ran a Slurm sweep's arguments)."""
    rec = new_record("5", "lsf", "dev", str(tmp_path / "5"), 2, "t", "/x/t.py", cluster="dev",
                     array=[0, 1, 2], array_limit=None, sweep=None)
    Path(rec.folder).mkdir()
    (Path(rec.folder) / "5_submitted.pkl").write_bytes(b"this job")
    for t in (0, 1):                                   # what the other job left
        (tmp_path / f"5_{t}").mkdir()
        (tmp_path / f"5_{t}" / f"5_{t}_submitted.pkl").write_bytes(b"another job")
    released = []
    submit._start_tasks(type("Mod", (), {"release": staticmethod(released.append)}), rec)
    assert [(tmp_path / f"5_{t}" / f"5_{t}_submitted.pkl").read_bytes() for t in (0, 1, 2)] == [b"this job"] * 3
    assert released == [rec] and not list(tmp_path.rglob(".*.tmp"))


def test_the_dev_clusters_slurm_and_lsf_sites_keep_their_job_folders_apart():
    """Job folders are named by job id; the Slurm dev cluster's ids and the LSF emulation's both
    start at 1, so one job_dir for both put two jobs in one folder (an LSF sweep's logs held a Slurm
    sweep's lines: the flake of test_an_lsf_sweep_maps_task_i_to_index_i_plus_1 on a fresh machine)."""
    dirs = {name: Path(os.path.expanduser(load_site(name, {}).config.job_dir)).resolve()
            for name in ("devcluster", "devcluster-lsf")}
    assert dirs["devcluster"] != dirs["devcluster-lsf"]
    assert dirs["devcluster"] not in dirs["devcluster-lsf"].parents and dirs["devcluster-lsf"] not in dirs["devcluster"].parents

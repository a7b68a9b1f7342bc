"""Bad nodes stay out (hpcring.nodehistory, `hpcring nodes`): what a finished job's report records,
the 2-blames-in-7-days policy, the exclusion in the rendered script, list/clear, concurrent writers,
and corrupt, unreadable or locked history files. In process, no scheduler."""
from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as hs

from hpcring import nodehistory as nh
from hpcring import restarts
from hpcring.config.site import load_site
from hpcring.diagnostics.report import diagnose
from hpcring.errors import UsageError
from hpcring.outcome import summarize, write_record
from hpcring.schedulers.base import JobRecord, JobState

ROOT = Path(__file__).resolve().parents[2]
HELLO = str(ROOT / "examples" / "hello.py")
HOSTS = ["node1", "node2", "node3"]          # 3 nodes x 1 rank
NOW = 1_800_000_000.0                       # 2027-01-15, a fixed "now"
DAY = 86400.0


# ---- a realistic failed job: the watchdog's own report, the ranks' own records ----------------------

def _rec(n, state, trigger=NOW - 60) -> dict:
    """One flight record of a rank's snapshot, as the watchdog gathers them."""
    return {"seq": n, "op": "allreduce", "dtype": "float32", "count": 1024, "root": None, "state": state,
            "t_started": trigger - 8, "timeout": 8.0, "site": "train.py:88 in step", "backend": "ring"}


def failed_job(tmp_path: Path, job_id="1361", *, frozen: int | None = 1, link: bool = False, code_error=False,
               state="FAILED", trigger=NOW - 60, scheduler="slurm", site_name="devcluster") -> tuple[JobRecord, object]:
    """A job folder ``<tmp>/jobs/<id>`` as a 3-rank job leaves it after a diagnosed hang (rank
    ``frozen`` unreachable, or with ``link`` a stalled link rank 0 -> rank 1), and its Outcome."""
    root = tmp_path / "jobs"
    folder = root / job_id
    (folder / "diag").mkdir(parents=True, exist_ok=True)
    snaps = {}
    for r in range(3):
        if r == frozen:
            continue
        error = None
        if link and r == 1:
            error = "allreduce#4 recv from rank 0 (node1) timed out after 8.0 s, 2097152/8388608 bytes done"
        snaps[r] = {"rank": r, "host": HOSTS[r], "records": [_rec(s, "done") for s in range(1, 4)] + [_rec(4, "failed")],
                    "last_done": 3, "error": error, "where": "in allreduce at train.py:88 (step)"}
    trig = {"rank": 0, "host": "node1", "error": "timed out", "time": trigger}
    report = diagnose(3, HOSTS, snaps, {}, trig, interface="eth0").to_dict()
    (folder / "diag" / "hang-report.json").write_text(json.dumps(report))
    for r in range(3):
        if r == frozen:
            continue
        err = "ValueError: bad batch" if code_error else report["headline"]
        write_record(folder, job_id, {"rank": r, "host": HOSTS[r], "exit_code": 1, "error": err,
                                      "ended": (trigger - 30 if code_error else trigger + 1)})
    rec = JobRecord(job_id=job_id, scheduler=scheduler, site=str(ROOT / f"site_configs/{site_name}.yaml"),
                    folder=str(folder), ntasks=3, name="train", script="train.py", submitted_at=NOW - 600,
                    cluster="devcluster")
    from hpcring.jobstatus import rank_statuses
    return rec, summarize(rank_statuses(rec), 3, JobState(state, state, 1))


@pytest.fixture(autouse=True)
def _no_scheduler(monkeypatch, tmp_path):
    """No sacct: the report's freshness needs no queue time; every HPCRING_ setting unset; jobs under tmp."""
    from hpcring import jobstatus
    monkeypatch.setattr(jobstatus, "run_started", lambda rec: None)
    for k in list(os.environ):
        if k.startswith("HPCRING_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path / "jobs"))
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "jobs").mkdir(exist_ok=True)


def blame(node, days_ago, job, reason="unreachable (rank 1)"):
    return nh.Blame(node, NOW - days_ago * DAY, str(job), f"slurm-devcluster-{job}", reason, "x", "alice", "devcluster")


def history(tmp_path) -> Path:
    return nh.history_path(tmp_path / "jobs")


SITE = "slurm-tcp"       # a Slurm site with the default policy (the dev cluster's injected faults leave none out)


def site(name=SITE):
    return load_site(name, {})


# ---- recording a finished job -----------------------------------------------------------------------

def test_a_report_records_its_blamed_node_once_with_when_and_why(tmp_path):
    rec, oc = failed_job(tmp_path)
    said = nh.record_ended(rec, oc, now=NOW)
    assert said == [f"job 1361: node history ({history(tmp_path)}): recorded node2 (unreachable (rank 1)); "
                    "site devcluster leaves no node out (blames 0 <- site devcluster bad_nodes.blames)"]
    lines = history(tmp_path).read_text().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert d["node"] == "node2" and d["job"] == "1361" and d["key"] == "slurm-devcluster-1361"
    assert d["time"] == nh.utc(NOW - 60) == "2027-01-15T07:59:00Z"     # when the failure was seen, UTC
    assert d["reason"] == "unreachable (rank 1)" and "unreachable" in d["cause"]
    # status, logs -f and submit --wait may all see the same end: one record
    assert nh.record_ended(rec, oc, now=NOW) == []
    assert history(tmp_path).read_text().splitlines() == lines
    assert json.loads((Path(rec.folder) / "diag" / nh.RECORDED).read_text())["blames"] == [d]
    # cleared, it stays cleared: seeing the old job again does not bring the blame back
    assert nh.clear(tmp_path / "jobs", ["node2"]) == ({"node2": 1}, 0)
    assert nh.record_ended(rec, oc, now=NOW) == [] and nh.read(tmp_path / "jobs") == []
    # without the job folder's note (not writable), the history itself still holds each (job, node) once
    (Path(rec.folder) / "diag" / nh.RECORDED).unlink()
    nh.record_ended(rec, oc, now=NOW)
    (Path(rec.folder) / "diag" / nh.RECORDED).unlink()
    assert nh.record_ended(rec, oc, now=NOW) == [] and len(nh.read(tmp_path / "jobs")) == 1


def test_the_second_blame_says_new_jobs_leave_the_node_out(tmp_path):
    one, oc1 = failed_job(tmp_path, "1", site_name=SITE)
    two, oc2 = failed_job(tmp_path, "2", site_name=SITE)
    assert nh.record_ended(one, oc1, now=NOW)[0].endswith("node2: 1 blame in 7 days, left out at 2 (`hpcring nodes list`)")
    assert nh.record_ended(two, oc2, now=NOW)[0].endswith("node2: 2 blames in 7 days, new jobs leave it out "
                                                          "(`hpcring nodes list`)")


def test_a_stalled_link_and_node_fail_are_the_reason(tmp_path):
    rec, oc = failed_job(tmp_path, "7", frozen=None, link=True, state="NODE_FAIL")
    nh.record_ended(rec, oc, now=NOW)
    (b,) = nh.read(tmp_path / "jobs")
    assert b.node == "node1" and b.reason == "stalled link (rank 0 -> rank 1), NODE_FAIL"


def test_dead_ranks_are_named_in_the_reason():
    rep = {"categories": {"dead": [2, 3], "unreachable": [5]}, "hosts": ["a", "a", "b", "b", "c", "c"]}
    assert restarts.node_reasons(rep, ["b", "c"], "FAILED") == {"b": "dead (ranks 2-3)", "c": "unreachable (rank 5)"}


@pytest.mark.parametrize("how", ["code error", "completed", "local", "array"])
def test_what_is_not_a_node_fault_records_nothing(tmp_path, how):
    rec, oc = failed_job(tmp_path, code_error=how == "code error", scheduler="local" if how == "local" else "slurm")
    if how == "completed":
        oc = summarize({}, 0, JobState("COMPLETED"))
    if how == "array":
        rec.array = [0, 1]
    assert nh.record_ended(rec, oc, now=NOW) == []
    assert not history(tmp_path).exists()


# ---- the policy ------------------------------------------------------------------------------------

@pytest.mark.parametrize("ages,excluded", [
    ([1, 3], True),            # twice within 7 days
    ([0.5, 1, 2], True),
    ([2], False),              # once
    ([0, 8], False),           # twice, 8 days apart: the older one is outside the window
    ([8, 9], False),           # twice, long ago
])
def test_two_blames_within_seven_days_leave_a_node_out(tmp_path, ages, excluded):
    nh.append(tmp_path / "jobs", [blame("node2", a, 100 + i) for i, a in enumerate(ages)])
    (row,) = nh.summarize(nh.read(tmp_path / "jobs"), nh.policy(site(), {}), now=NOW)
    assert row.excluded is excluded and row.total == len(ages)
    s = site()
    from hpcring.config.jobspec import resolve_job
    job = resolve_job(s, "train.py", [], {"nodes": 2}, environ={"HPCRING_JOB_DIR": str(tmp_path / "jobs")})
    said = nh.leave_out(s, job, environ={}, now=NOW)
    assert job.exclude == (["node2"] if excluded else [])
    if excluded:
        assert len(said) == 1 and said[0].startswith("node history: leaving out node2 (")
        assert "--no-node-history" in said[0] and "`hpcring nodes clear node2 --site slurm-tcp`" in said[0]
    else:
        assert said == []


def test_thresholds_env_over_site_over_default(tmp_path):
    s = site()
    assert nh.policy(s, {}) == nh.Policy(2, 7.0, ("default", "default"))
    f = tmp_path / "s.yaml"
    f.write_text(Path(s.path).read_text() + "bad_nodes:\n  blames: 3\n  days: 1.5\n")
    mine = load_site(str(f), {})
    assert nh.policy(mine, {}) == nh.Policy(3, 1.5, ("site slurm-tcp bad_nodes.blames",
                                                      "site slurm-tcp bad_nodes.days"))
    env = {"HPCRING_BAD_NODE_BLAMES": "1", "HPCRING_BAD_NODE_DAYS": "30"}
    assert nh.policy(mine, env) == nh.Policy(1, 30.0, ("env HPCRING_BAD_NODE_BLAMES", "env HPCRING_BAD_NODE_DAYS"))
    # one blame 10 days ago: left out with blames 1 in 30 days, not with the defaults
    nh.append(tmp_path / "jobs", [blame("node3", 10, 5)])
    assert [r.excluded for r in nh.summarize(nh.read(tmp_path / "jobs"), nh.policy(s, env), NOW)] == [True]
    assert [r.excluded for r in nh.summarize(nh.read(tmp_path / "jobs"), nh.policy(s, {}), NOW)] == [False]


def test_the_dev_cluster_records_but_leaves_no_node_out():
    """Its faults are injected on purpose (tests, demos): a test run must not take its nodes away."""
    for name in ("devcluster", "devcluster-lsf"):
        assert nh.policy(site(name), {}) == nh.Policy(0, 7.0, (f"site {name} bad_nodes.blames", "default"))
        assert nh.policy(site(name), {"HPCRING_BAD_NODE_BLAMES": "2"}).blames == 2


def test_blames_zero_turns_it_off(tmp_path):
    nh.append(tmp_path / "jobs", [blame("node2", 1, 1), blame("node2", 2, 2)])
    from hpcring.config.jobspec import resolve_job
    job = resolve_job(site(), "t.py", [], {}, environ={})
    assert nh.leave_out(site(), job, environ={"HPCRING_BAD_NODE_BLAMES": "0"}, now=NOW) == [] and job.exclude == []


@settings(max_examples=60, deadline=None)
@given(hs.text(max_size=12), hs.sampled_from(["HPCRING_BAD_NODE_BLAMES", "HPCRING_BAD_NODE_DAYS"]))
def test_generated_env_values_are_a_setting_or_a_clear_error(raw, var):
    try:
        pol = nh.policy(site(), {var: raw})
    except UsageError as exc:
        assert var in exc.message and exc.hint and "Traceback" not in exc.message
        return
    assert 0 <= pol.blames <= 1000 and 0 < pol.days <= 3650


# ---- the exclusion reaches the job script --------------------------------------------------------------

def _two_blames(tmp_path, node="node2"):
    nh.append(tmp_path / "jobs", [blame(node, 0.5, 1), blame(node, 1, 2)])


@pytest.mark.parametrize("argv", [["render"], ["submit", "--dry-run"]])
def test_render_and_dry_run_show_the_exclude(cli, tmp_path, argv):
    _two_blames(tmp_path)
    r = cli(*argv, HELLO, "--site", SITE, "-N", "2")
    assert r.exit_code == 0, r.output
    assert "#SBATCH --exclude=node2\n" in r.stdout
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("node history:")]
    assert len(notes) == 1 and "leaving out node2 (2 blames in 7 days, last: unreachable (rank 1) in job 1)" in notes[0]
    r = cli(*argv, HELLO, "--site", SITE, "-N", "2", "--no-node-history")
    assert r.exit_code == 0 and "--exclude" not in r.stdout
    assert "not leaving out node2" in r.stderr and "--no-node-history" in r.stderr


def test_lsf_gets_its_own_exclusion_and_local_none(cli, tmp_path):
    _two_blames(tmp_path)
    r = cli("render", HELLO, "--site", "devcluster-lsf", "-N", "2", env={"HPCRING_BAD_NODE_BLAMES": "2"})
    assert r.exit_code == 0 and "hname!=node2" in r.stdout, r.output
    r = cli("render", HELLO, "--site", "local")
    assert r.exit_code == 0 and "node history" not in r.stderr


def test_verbose_says_where_the_exclusion_came_from(cli, tmp_path):
    _two_blames(tmp_path)
    r = cli("render", HELLO, "--site", SITE, "-v")
    assert f"exclude         node2                    <- node history {history(tmp_path)}" in r.stderr


# ---- the commands that see a job end record it -----------------------------------------------------------

def _slurm_says(monkeypatch, state="FAILED"):
    import hpcring.schedulers.slurm as slurm
    monkeypatch.setattr(slurm, "states", lambda recs: {r.job_id: JobState(state, state, 1) for r in recs})
    monkeypatch.setattr(slurm, "first_casualty", lambda rec: None)


@pytest.mark.parametrize("argv", [["status"], ["logs", "--follow"]])
def test_status_and_logs_follow_record_the_blame(cli, tmp_path, monkeypatch, argv):
    from hpcring.schedulers.base import save_record
    rec, _ = failed_job(tmp_path, "42")
    save_record(rec)
    _slurm_says(monkeypatch)
    r = cli(*argv, rec.key)
    assert "recorded node2 (unreachable (rank 1))" in r.stderr, r.output
    assert [b.node for b in nh.read(tmp_path / "jobs")] == ["node2"]
    r = cli(*argv, rec.key)                # seen again: recorded once
    assert "recorded" not in r.stderr and len(nh.read(tmp_path / "jobs")) == 1


def test_status_of_an_array_records_each_failed_task(cli, tmp_path, monkeypatch):
    """Every task is a whole job with its own report: the one whose report blames a node is recorded."""
    from dataclasses import replace
    from hpcring.schedulers.base import save_record
    task, _ = failed_job(tmp_path, "50_1")
    (tmp_path / "jobs" / "50_0").mkdir()
    rec = replace(task, job_id="50", folder=str(tmp_path / "jobs" / "50"), array=[0, 1])
    save_record(rec)
    _slurm_says(monkeypatch)
    r = cli("status", rec.key)
    assert r.exit_code == 0 and "job 50_1: node history" in r.stderr, r.output
    assert [(b.node, b.job, b.key) for b in nh.read(tmp_path / "jobs")] == [("node2", "50_1", "slurm-devcluster-50_1")]


def test_submit_wait_records_before_it_reports_the_failure(tmp_path, monkeypatch):
    from hpcring import jobfollow, jobstatus
    from hpcring.cli import main
    from hpcring.errors import JobFailedError
    rec, oc = failed_job(tmp_path, "43")
    monkeypatch.setattr(jobfollow, "follow", lambda rec, **kw: oc)
    monkeypatch.setattr(jobstatus, "first_casualty", lambda rec: None)
    with pytest.raises(JobFailedError):
        main._wait(rec)
    assert [(b.node, b.job) for b in nh.read(tmp_path / "jobs")] == [("node2", "43")]


# ---- hpcring nodes list / clear -------------------------------------------------------------------------

def test_nodes_list_and_clear(cli, tmp_path):
    now = time.time()
    nh.append(tmp_path / "jobs", [nh.Blame("node2", now - DAY, "1", "k1", "unreachable (rank 1)"),
                                  nh.Blame("node2", now - 2 * DAY, "2", "k2", "dead (rank 3)"),
                                  nh.Blame("node3", now - DAY, "3", "k3", "stalled link (rank 0 -> rank 1)")])
    r = cli("nodes", "list", "--site", SITE)
    assert r.exit_code == 0, r.output
    out = r.stdout.splitlines()
    assert out[0].startswith(f"node history {history(tmp_path)} (site slurm-tcp): a node blamed 2 times within "
                             "7 days is left out of new jobs")
    assert out[1].split()[:3] == ["NODE", "BLAMES/7D", "TOTAL"] and out[1].endswith("LAST REASON")
    assert out[2].split()[0:3] == ["node2", "2", "2"] and " 1 " in out[2] and " yes " in out[2]
    assert out[2].endswith("unreachable (rank 1)")
    assert out[3].split()[0:3] == ["node3", "1", "1"] and " no " in out[3]
    r = cli("nodes", "clear", "node2", "--site", SITE)
    assert r.exit_code == 0 and "cleared node2 (2 blames); new jobs use them again" in r.stderr, r.output
    assert [b.node for b in nh.read(tmp_path / "jobs")] == ["node3"]
    r = cli("nodes", "clear", "node9", "node3", "--site", SITE)
    assert r.exit_code == 1 and "cleared node3 (1 blame)" in r.stderr
    assert "error: node node9 is not in the node history" in r.stderr and r.stderr.count("error:") == 1
    assert nh.read(tmp_path / "jobs") == []
    r = cli("nodes", "list", "--site", SITE)
    assert r.exit_code == 0 and "no node was blamed" in r.stdout


@pytest.mark.parametrize("argv,words", [(["clear"], "none was named"), (["clear", "node1", "--all"], "not both"),
                                        (["clear", "no;de"], "no host name"), (["clear", "-x"], "No such option")])
def test_nodes_clear_usage(cli, tmp_path, argv, words):
    r = cli("nodes", *argv, "--site", SITE)
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output
    assert not (tmp_path / "jobs" / ".hpcring").exists()


def test_nodes_clear_all(cli, tmp_path):
    _two_blames(tmp_path)
    r = cli("nodes", "clear", "--all", "--site", SITE)
    assert r.exit_code == 0 and "cleared node2 (2 blames)" in r.stderr
    assert history(tmp_path).read_text() == ""
    r = cli("nodes", "clear", "--all", "--site", SITE)
    assert r.exit_code == 0 and "nothing to clear" in r.stderr


# ---- many writers at once ---------------------------------------------------------------------------------

def _writer(root: str, who: int, n: int) -> None:
    for i in range(n):
        nh.append(root, [nh.Blame(f"node{who}", NOW, f"{who}.{i}", f"k-{who}-{i}", "unreachable (rank 1)",
                                  "x" * 200)])


def test_concurrent_writers_lose_no_record_and_tear_none(tmp_path):
    root = str(tmp_path / "jobs")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(root, w, 25)) for w in range(6)]
    for p in procs:
        p.start()
    seen = 0
    while any(p.is_alive() for p in procs):      # a reader meanwhile never sees half a record
        seen = max(seen, len(nh.read(root)))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    blames = nh.read(root)
    assert len(blames) == 150 and len({b.key for b in blames}) == 150
    assert len(history(tmp_path).read_text().splitlines()) == 150


def _clear_while_writing(root: str) -> None:
    for _ in range(20):
        nh.clear(root, ["node0"])


def test_clear_beside_writers_keeps_the_others(tmp_path):
    root = str(tmp_path / "jobs")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(root, w, 20)) for w in (1, 2)] + \
        [ctx.Process(target=_clear_while_writing, args=(root,))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(b.key for b in nh.read(root)) == sorted(f"k-{w}-{i}" for w in (1, 2) for i in range(20))


# ---- bad files ---------------------------------------------------------------------------------------------

CORRUPT = {
    "not json": '{"node": "node2", \n',
    "cut short": None,                                # a valid line, then half of one without its newline
    "wrong field": json.dumps({"node": "node2", "time": "yesterday", "job": "1", "key": "k", "reason": "r"}) + "\n",
    "bad host": json.dumps({"node": "n;rm -rf", "time": "2027-01-01T00:00:00Z", "job": "1", "key": "k",
                            "reason": "r"}) + "\n",
    "binary": "\udcff\udcfe\n",
    "control": json.dumps({"node": "node2", "time": "2027-01-01T00:00:00Z", "job": "1", "key": "k",
                           "reason": "r\x1b[2J"}) + "\n",
    "list": "[1, 2]\n",
}


def _corrupt(tmp_path, kind) -> Path:
    _two_blames(tmp_path)
    path = history(tmp_path)
    with open(path, "ab") as fh:
        if kind == "cut short":
            fh.write(blame("node5", 1, 9).line().encode()[:40])
        else:
            fh.write(CORRUPT[kind].encode("utf-8", "surrogateescape"))
    return path


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_a_corrupt_history_warns_and_the_job_goes_on_without_it(cli, tmp_path, kind):
    path = _corrupt(tmp_path, kind)
    with pytest.raises(nh.CorruptHistory) as exc:
        nh.read(tmp_path / "jobs")
    assert str(path) in exc.value.message and "line 3" in exc.value.message and "clear --all" in exc.value.hint
    # submit (here render): one warning naming the file, nothing left out, the script rendered
    r = cli("render", HELLO, "--site", SITE)
    assert r.exit_code == 0 and r.stdout.startswith("#!") and "--exclude" not in r.stdout, r.output
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and str(path) in warn[0] and "no node is left out of this job automatically" in warn[0]
    assert "Traceback" not in r.output and "\x1b" not in r.output
    # nodes list: an error naming the file and what to do
    r = cli("nodes", "list", "--site", SITE)
    assert r.exit_code == 1 and str(path) in r.stderr and "hint:" in r.stderr and "Traceback" not in r.output
    # one node cannot be cleared from it; --all repairs it
    r = cli("nodes", "clear", "node2", "--site", SITE)
    assert r.exit_code == 1 and "cleared one by one" in r.stderr
    r = cli("nodes", "clear", "--all", "--site", SITE)
    assert r.exit_code == 0 and "1 corrupt line dropped" in r.stderr, r.output
    assert nh.read(tmp_path / "jobs") == []


def test_recording_into_a_line_cut_short_keeps_the_new_record_whole(tmp_path):
    path = _corrupt(tmp_path, "cut short")
    rec, oc = failed_job(tmp_path, "77")
    said = nh.record_ended(rec, oc, now=NOW)
    assert any("recorded node2" in s for s in said)
    assert any(s.startswith("warning:") and "corrupt line(s) 3" in s for s in said)
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[3])["job"] == "77"   # not glued to the half line


def test_unwritable_history_is_a_warning_for_the_job_and_an_error_for_nodes(cli, tmp_path, monkeypatch):
    rec, oc = failed_job(tmp_path, "5")
    real = os.open

    def denied(path, flags, *a, **kw):
        if ".hpcring" in str(path) and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied")
        return real(path, flags, *a, **kw)
    monkeypatch.setattr(os, "open", denied)
    (said,) = nh.record_ended(rec, oc, now=NOW)
    assert said.startswith("warning: job 5: the blamed node(s) were not recorded in the node history: cannot write")
    assert str(history(tmp_path)) in said and "Permission denied" in said and "hint:" in said
    monkeypatch.setattr(os, "open", real)
    _two_blames(tmp_path)
    monkeypatch.setattr(os, "open", denied)
    r = cli("nodes", "clear", "node2", "--site", SITE)
    assert r.exit_code == 1 and "cannot rewrite the node history" in r.stderr and "Traceback" not in r.output
    # a reader that may not open the lock for writing still reads (shared lock on a read-only fd)
    assert [b.node for b in nh.read(tmp_path / "jobs")] == ["node2", "node2"]


@pytest.mark.parametrize("what", ["folder", "fifo"])
def test_a_history_that_is_no_file_is_refused_without_hanging(cli, tmp_path, what):
    path = history(tmp_path)
    path.parent.mkdir(parents=True)
    path.mkdir() if what == "folder" else os.mkfifo(path)
    with pytest.raises(nh.HistoryError) as exc:
        nh.read(tmp_path / "jobs")
    assert str(path) in exc.value.message
    r = cli("render", HELLO, "--site", SITE)
    assert r.exit_code == 0 and "warning:" in r.stderr and str(path) in r.stderr


def test_a_lock_held_too_long_is_an_error_not_a_hang(tmp_path, monkeypatch):
    _two_blames(tmp_path)
    monkeypatch.setattr(nh, "LOCK_TIMEOUT_S", 0.3)
    fd = os.open(history(tmp_path).parent / nh.LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)                   # another process changing it, for too long
        t0 = time.monotonic()
        with pytest.raises(nh.HistoryError, match="stayed locked for 0.3 s"):
            nh.read(tmp_path / "jobs")
        assert time.monotonic() - t0 < 5
        rec, oc = failed_job(tmp_path, "6")
        (said,) = nh.record_ended(rec, oc, now=NOW)
        assert said.startswith("warning: job 6:") and "stayed locked" in said
    finally:
        os.close(fd)


def test_no_history_yet_creates_nothing(cli, tmp_path):
    r = cli("render", HELLO, "--site", SITE)
    assert r.exit_code == 0
    r = cli("nodes", "list", "--site", SITE)
    assert r.exit_code == 0 and "no node was blamed" in r.stdout
    assert list((tmp_path / "jobs").iterdir()) == []

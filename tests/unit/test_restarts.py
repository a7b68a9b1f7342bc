"""Restarts after a node fault (hpcring.restarts): which causes are node-level, which nodes are
excluded, how attempts are counted, where --max-restarts comes from, and the rendered exclusion."""
from __future__ import annotations

import json
import string
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as hs

from hpcring import preempt, restarts
from hpcring.config.jobspec import resolve_job
from hpcring.config.site import load_site
from hpcring.errors import UsageError
from hpcring.schedulers.render import render_script
from hpcring.restarts import Verdict, classify

HOSTS = ["node1", "node1", "node2", "node2"]         # 2 nodes x 2 ranks
HEAD = "allreduce#4: rank 2 (node2) unreachable"


def report(cats=None, links=(), headline=HEAD, hosts=HOSTS):
    return {"headline": headline, "categories": cats or {}, "links": list(links), "hosts": hosts}


def watchdog_exit(rank, headline=HEAD):
    """The record a rank writes when the hang report takes it down."""
    return {"rank": rank, "host": HOSTS[rank], "exit_code": 1, "error": headline, "ended": 10.0 + rank}


def test_unreachable_and_dead_ranks_blame_their_nodes():
    st = {r: watchdog_exit(r) for r in (0, 1, 3)}                 # rank 2 frozen: no record
    v = classify("FAILED", st, 4, report({"unreachable": [2], "joined": [0, 1, 3]}))
    assert v == Verdict(True, HEAD, ("node2",))
    v = classify("FAILED", {0: watchdog_exit(0, "x died")}, 4,
                 report({"dead": [2, 3], "joined": [0, 1]}, headline="x died"))
    assert v.restart and v.nodes == ("node2",)                   # two ranks of one node: one node


def test_what_the_teardown_did_after_the_diagnosis_is_no_code_error():
    """LSF's bkill interrupts every rank after the report: their records say KeyboardInterrupt,
    written after the failure was seen (the report's trigger time)."""
    st = {0: {"rank": 0, "host": "node1", "exit_code": 1, "error": "KeyboardInterrupt: ", "ended": 112.5},
          1: {"rank": 1, "host": "node2", "exit_code": 1, "error": "KeyboardInterrupt: ", "ended": 112.6}}
    rep = {**report({"unreachable": [1], "joined": [0]}, hosts=["node1", "node2"]), "trigger": {"time": 105.2}}
    assert classify("FAILED", st, 2, rep) == Verdict(True, HEAD, ("node2",))
    st[0]["ended"] = 101.0                                       # raised before the failure was seen: its own
    assert not classify("FAILED", st, 2, rep).restart


def test_a_stalled_link_blames_the_host_at_most_links_else_the_sender():
    one = [{"from": 2, "to": 0, "from_host": "node2", "to_host": "node1"}]
    v = classify("FAILED", {}, 4, report({"joined": [0, 1, 2, 3]}, one, headline="link stalled"))
    assert v.restart and v.nodes == ("node2",)
    hosts = ["a", "b", "c"]
    star = [{"from": 1, "to": 0, "from_host": "b", "to_host": "a"},
            {"from": 2, "to": 1, "from_host": "c", "to_host": "b"}]
    v = classify("FAILED", {}, 3, report({"joined": [0, 1, 2]}, star, headline="stalled", hosts=hosts))
    assert v.nodes == ("b",)                                     # b is at both stalled links


@pytest.mark.parametrize("cat", ["missing", "mismatch", "different", "exited"])
def test_a_hang_the_report_pins_on_the_code_is_not_restarted(cat):
    v = classify("FAILED", {r: watchdog_exit(r) for r in range(4)}, 4, report({cat: [2], "joined": [0, 1, 3]}))
    assert not v.restart and v.cause.startswith("code-level hang")


def test_an_exception_on_every_rank_is_a_code_error_even_beside_a_report():
    st = {r: {"rank": r, "host": HOSTS[r], "exit_code": 1, "ended": r,
              "error": "Traceback ...\nValueError: bad batch"} for r in range(4)}
    v = classify("FAILED", st, 4, None)
    assert not v.restart and v.cause == "code error: rank 0 on node1: ValueError: bad batch"
    # one rank raised, its peers saw it "dead": the rank's own error decides
    st = {0: st[0], 1: watchdog_exit(1), 3: watchdog_exit(3)}
    assert not classify("FAILED", st, 4, report({"dead": [0]})).restart
    # a non-zero exit without a message is the code's too
    assert not classify("FAILED", {0: {"rank": 0, "exit_code": 3}}, 1, None).restart


@pytest.mark.parametrize("state", ["COMPLETED", "TIMEOUT", "PREEMPTED", "CANCELLED", "OUT_OF_MEMORY", "DEADLINE"])
def test_endings_that_are_no_node_fault(state):
    rep = report({"unreachable": [2]})                            # even with a report left behind
    assert not classify(state, {}, 4, rep).restart


def test_node_fail_without_a_report_restarts_with_no_node_named():
    assert classify("NODE_FAIL", {}, 4, None) == Verdict(True, restarts.classify("NODE_FAIL", {}, 4, None).cause)
    assert classify("NODE_FAIL", {}, 4, None).nodes == ()
    assert not classify("FAILED", {}, 4, None).restart           # nothing names a node


def test_every_node_blamed_is_no_single_bad_node():
    v = classify("FAILED", {}, 4, report({"unreachable": [0, 2]}))
    assert not v.restart and "every node" in v.cause


@settings(max_examples=200, deadline=None)
@given(hs.dictionaries(hs.sampled_from(["dead", "unreachable", "missing", "joined", "exited"]),
                       hs.lists(hs.integers(0, 3), max_size=4), max_size=4),
       hs.sampled_from(["FAILED", "NODE_FAIL", "COMPLETED", "TIMEOUT"]))
def test_generated_reports_blame_only_hosts_of_dead_or_unreachable_ranks(cats, state):
    v = classify(state, {}, 4, report(cats))
    blamed = {HOSTS[r] for c in ("dead", "unreachable") for r in cats.get(c, [])}
    if v.restart:
        assert set(v.nodes) <= blamed and set(v.nodes) != set(HOSTS)
        assert state in ("FAILED", "NODE_FAIL")
    if state in ("COMPLETED", "TIMEOUT"):
        assert not v.restart


@given(hs.text(max_size=40))
def test_only_host_names_reach_a_job_script(name):
    ok = name and name[0] in string.ascii_letters + string.digits and all(
        c in string.ascii_letters + string.digits + "._-" for c in name)
    if ok:
        assert restarts.check_hosts([name], "x") == [name]
    else:
        with pytest.raises(UsageError, match="not a host name"):
            restarts.check_hosts([name], "x")


# ---- attempts and the chain ------------------------------------------------------------------

def test_requeue_count_counts_a_restart():
    assert preempt.requeue_count({}) == 0
    assert preempt.requeue_count({"HPCRING_RESTART_COUNT": "2"}) == 2
    assert preempt.requeue_count({"HPCRING_RESTART_COUNT": "1", "SLURM_RESTART_COUNT": "3"}) == 3


def _site(name="devcluster"):
    return load_site(name, {})


def _job(site, **kw):
    return resolve_job(site, "train.py", [], {"nodes": 2, "name": "golden"}, environ={}, **kw)


def test_next_job_excludes_every_blamed_node_so_far_with_a_fresh_secret():
    site = _site()
    job = _job(site)
    job.env["HPCRING_SECRET_FILE"] = "/old/secret"
    one = restarts._next_job(site, job, Verdict(True, "x", ("node2",)), 1)
    two = restarts._next_job(site, one, Verdict(True, "y", ("node3", "node2")), 2)
    assert one.exclude == ["node2"] and two.exclude == ["node2", "node3"] and job.exclude == []
    assert "HPCRING_SECRET_FILE" not in two.env and two.env["HPCRING_RESTART_COUNT"] == "2"
    local = _site("local")
    assert restarts._next_job(local, _job(local), Verdict(True, "x", ("local1",)), 1).exclude == []


class _FakeLib:
    """follow/submit stand-ins: each attempt ends as scripted."""

    def __init__(self, tmp: Path, endings):
        self.tmp, self.endings, self.submitted = tmp, list(endings), []

    def rec(self, n):
        folder = self.tmp / str(n)
        folder.mkdir(exist_ok=True)
        return SimpleNamespace(job_id=str(n), key=f"slurm-dev-{n}", folder=str(folder), ntasks=4)

    def follow(self, rec):
        ok = self.endings.pop(0)
        return SimpleNamespace(ok=ok, state=SimpleNamespace(state="COMPLETED" if ok else "FAILED"))

    def submit(self, site, job, template):
        self.submitted.append(list(job.exclude))
        return self.rec(len(self.submitted) + 100)


@pytest.mark.parametrize("limit,endings,expect_jobs", [(2, [False, False, True], 2), (1, [False, False], 1),
                                                       (3, [False, True], 1)])
def test_attempts_stop_at_the_limit_or_on_success(tmp_path, monkeypatch, limit, endings, expect_jobs):
    lib = _FakeLib(tmp_path, endings)
    verdicts = iter([Verdict(True, "rank 2 (node2) unreachable", ("node2",)),
                     Verdict(True, "rank 0 (node1) unreachable", ("node1",))])
    monkeypatch.setattr(restarts, "classify", lambda *a: next(verdicts))
    monkeypatch.setattr(restarts, "_report", lambda rec: None)
    from hpcring import jobstatus
    monkeypatch.setattr(jobstatus, "rank_statuses", lambda rec: {})
    said = []
    rec, oc = restarts.follow_restarting(_site(), _job(_site()), lib.rec(100), limit, submit=lib.submit,
                                         follow=lib.follow, info=said.append)
    assert len(lib.submitted) == expect_jobs
    assert lib.submitted[:2] == [["node2"], ["node2", "node1"]][:expect_jobs]
    chain = restarts.read_chain(rec.folder)
    assert [a["attempt"] for a in chain] == list(range(expect_jobs + 1))
    assert chain == restarts.read_chain(tmp_path / "100")     # every attempt's folder has the whole chain
    assert oc.ok == (endings[expect_jobs] if expect_jobs < len(endings) else False)
    if not oc.ok:
        assert "already made" in said[-1] and chain[-1]["decision"].startswith("not restarted")
    lines = restarts.chain_lines(chain)
    assert lines[0].startswith("attempt 0  job 100  ended: FAILED: rank 2 (node2) unreachable")


def test_code_error_is_recorded_and_not_resubmitted(tmp_path, monkeypatch):
    lib = _FakeLib(tmp_path, [False])
    monkeypatch.setattr(restarts, "_report", lambda rec: None)
    from hpcring import jobstatus
    monkeypatch.setattr(jobstatus, "rank_statuses", lambda rec: {0: {"rank": 0, "host": "n", "exit_code": 1,
                                                                "error": "ValueError: x"}})
    said = []
    restarts.follow_restarting(_site(), _job(_site()), lib.rec(7), 5, submit=lib.submit, follow=lib.follow,
                               info=said.append)
    assert lib.submitted == [] and said == ["job 7: not restarted: code error: rank 0 on n: ValueError: x"]
    assert json.loads((tmp_path / "7" / "restarts.json").read_text())["attempts"][0]["decision"] == \
        "not restarted (no node-level fault)"


# ---- where --max-restarts comes from -----------------------------------------------------------

def test_max_restarts_precedence_cli_env_site_default(tmp_path):
    site = _site()
    assert restarts.max_restarts(None, site, {}) == (0, "default")
    assert restarts.max_restarts(None, site, {"HPCRING_MAX_RESTARTS": "3"}) == (3, "env HPCRING_MAX_RESTARTS")
    assert restarts.max_restarts(1, site, {"HPCRING_MAX_RESTARTS": "3"}) == (1, "cli")
    f = tmp_path / "s.yaml"
    f.write_text(Path(site.path).read_text().replace("defaults:\n", "defaults:\n  max_restarts: 2\n", 1))
    mine = load_site(str(f), {})
    assert restarts.max_restarts(None, mine, {}) == (2, f"site {mine.name}")
    assert restarts.max_restarts(None, mine, {"HPCRING_MAX_RESTARTS": "0"}) == (0, "env HPCRING_MAX_RESTARTS")


@given(hs.text(max_size=12))
def test_generated_env_values_are_a_count_or_a_clear_error(raw):
    try:
        n, _ = restarts.max_restarts(None, _site(), {"HPCRING_MAX_RESTARTS": raw})
    except UsageError as exc:
        assert "HPCRING_MAX_RESTARTS" in exc.message and exc.hint
        return
    assert 0 <= n <= 100


@pytest.mark.parametrize("args,env,words", [
    (["--max-restarts", "-1"], {}, "-1"), (["--max-restarts", "101"], {}, "101"),
    (["--max-restarts", "x"], {}, "x"), (["--max-restarts", "2"], {}, "needs --wait"),
    (["--max-restarts", "1", "--wait", "--array", "0-1"], {}, "arrays"),
    (["--wait"], {"HPCRING_MAX_RESTARTS": "lots"}, "HPCRING_MAX_RESTARTS"),
])
def test_bad_max_restarts_is_refused_before_anything_is_submitted(cli, tmp_path, monkeypatch, args, env, words):
    script = tmp_path / "t.py"
    script.write_text("")
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path / "jobs"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = cli("submit", str(script), "--site", "local", *args)
    assert r.exit_code in (1, 2) and words in r.output, r.output
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())


# ---- the rendered exclusion ---------------------------------------------------------------------

COMMAND = "/usr/bin/python3 -u -m submitit.core._submit /jobs/%j"


@pytest.mark.parametrize("site_name", ["devcluster", "devcluster-lsf", "lsf-summit"])
def test_golden_exclude_scripts(site_name):
    import os
    site = _site(site_name)
    job = _job(site)
    job.exclude = ["node2", "node3"]
    text = render_script(site, job, COMMAND, "/jobs/%j", python="/usr/bin/python3")
    path = Path(__file__).resolve().parent.parent / "golden" / f"{site_name}-exclude.sh"
    if os.environ.get("HPCRING_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()
    line = ("#SBATCH --exclude=node2,node3\n" if site.config.scheduler == "slurm" else
            '#BSUB -R "select[hname!=node2 && hname!=node3]"\n' if site.config.lsf.nnodes else
            f'#BSUB -R "select[hname!=node2 && hname!=node3] span[ptile={job.tasks_per_node}]"\n')
    assert line in text
    job.exclude = []
    assert "exclude" not in render_script(site, job, COMMAND, "/jobs/%j", python="/usr/bin/python3")
    assert "hname!=" not in render_script(site, job, COMMAND, "/jobs/%j", python="/usr/bin/python3")


def test_a_restart_the_scheduler_refuses_is_recorded_and_raised(tmp_path, monkeypatch):
    from hpcring.errors import SchedulerError
    lib = _FakeLib(tmp_path, [False])
    monkeypatch.setattr(restarts, "verdict", lambda rec, oc: Verdict(True, "rank 1 (node2) unreachable", ("node2",)))

    def refuse(site, job, template):
        raise SchedulerError("sbatch refused the job: Requested node configuration is not available")
    with pytest.raises(SchedulerError):
        restarts.follow_restarting(_site(), _job(_site()), lib.rec(9), 2, submit=refuse, follow=lib.follow,
                                   info=lambda m: None)
    chain = restarts.read_chain(tmp_path / "9")
    assert chain[0]["decision"].startswith("restart 1 refused: sbatch refused the job: Requested node")


def test_an_environment_default_without_wait_is_ignored_with_a_warning(cli, tmp_path, monkeypatch):
    """HPCRING_MAX_RESTARTS in a login shell must not break plain submissions: the job is submitted,
    with a warning that nothing restarts it (only --max-restarts itself insists on --wait)."""
    script = tmp_path / "t.py"
    script.write_text("")
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path / "jobs"))
    monkeypatch.setenv("HPCRING_MAX_RESTARTS", "2")
    r = cli("submit", str(script), "--site", "local")
    assert r.exit_code == 0, r.output
    assert "Submitted job" in r.output
    assert "warning: max_restarts 2 (env HPCRING_MAX_RESTARTS) applies to `submit --wait` on a single job only" \
        in r.output


@pytest.mark.parametrize("site_name", ["devcluster", "devcluster-lsf"])
def test_spares_used_up_inside_the_allocation_then_resubmission_leaves_every_blamed_node_out(
        tmp_path, monkeypatch, site_name):
    """--spare-nodes 1 --max-restarts 3 --wait: the allocation's step loop replaced node2 by the
    spare node3, then lost node3 with no spare left, and the job ended. The follower counts that
    restart, resubmits once with node2 and node3 left out (Slurm --exclude, LSF select[hname!=]),
    restart count 2 for the ranks, 1 step restart left for the new allocation; when the restarts
    inside used the budget up, nothing is resubmitted."""
    from hpcring.config.jobspec import plan_step_restarts
    from hpcring.steps_record import STEPS_FILE
    site = _site(site_name)
    for limit, inside_steps, resubmitted in ((3, 2, True), (2, 3, False)):
        job = _job(site)
        job.spare_nodes = 1
        plan_step_restarts(site, job, limit, environ={})
        assert job.step_restarts == limit and job.alloc_nodes == 3
        lib = _FakeLib(tmp_path / f"{limit}", [False, True])
        (tmp_path / f"{limit}").mkdir()
        jobs = []

        def submit(site_, job_, template, lib=lib, jobs=jobs):
            jobs.append(job_)
            return lib.submit(site_, job_, template)
        first = lib.rec(100)
        hosts = [["node1", "node2"], ["node1", "node3"], ["node1"]]
        blamed = [{"node2": "lost (task 1 killed; srun)"}, {"node3": "lost (task 1 killed; srun)"}, {}]
        (Path(first.folder) / STEPS_FILE).write_text(json.dumps({"allocation": ["node1", "node2", "node3"], "steps": [
            {"step": k, "hosts": hosts[k], "blamed": blamed[k], "end": "FAILED", "size": len(hosts[k])}
            for k in range(inside_steps)]}))
        monkeypatch.setattr(restarts, "verdict", lambda rec, oc: Verdict(True, "rank 1 (node3) lost", ("node3",)))
        said = []
        restarts.follow_restarting(site, job, first, limit, submit=submit, follow=lib.follow, info=said.append)
        if not resubmitted:
            assert jobs == [] and f"{limit} restart(s) were already made" in said[-1], said
            continue
        assert len(jobs) == 1 and jobs[0].exclude == ["node2", "node3"], [j.exclude for j in jobs]
        assert jobs[0].env["HPCRING_RESTART_COUNT"] == "2" and jobs[0].step_restarts == 1
        assert "restart 1 of at most 3 (excluding node2,node3)" in said[0], said
        text = render_script(site, jobs[0], COMMAND, "/jobs/%j", python="/usr/bin/python3")
        assert ("#SBATCH --exclude=node2,node3\n" in text if site.config.scheduler == "slurm"
                else "select[hname!=node2 && hname!=node3]" in text), text

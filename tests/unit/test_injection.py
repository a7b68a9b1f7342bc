"""Shell injection through site values and job folders.

Every text field of the site-config schema (generated from the pydantic models: a new field is covered
the day it is added) gets, on a Slurm, an LSF and a local site: a line break, which must be refused at
validation with file:line key; and shell text (quotes, $(...), backquotes, ;), which must be refused
the same way or reach the job script quoted. "Quoted" is checked by running the script exactly as
submit renders it, with the launchers (srun, jsrun) and the interpreter replaced by stubs that record
their words: the injected `touch` must never run, and the ranks must get their command word for word.
A job folder with spaces and quotes runs end to end on the local backend (and on the dev cluster
when it is up).
"""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from hpcring import submit as submit_mod
from hpcring.config.jobspec import resolve_job
from hpcring.config.site import load_site
from hpcring.errors import ConfigError
from hpcring.schedulers import local as local_mod, lsf as lsf_mod, slurm as slurm_mod
from helpers.injection import WEIRD_DIR
from helpers.site_fields import Field, applies, schema_fields, write_site, yaml_text

ROOT = Path(__file__).resolve().parents[2]
SCHEDULERS = ("slurm", "lsf", "local")
TEXT_FIELDS = [f for f in schema_fields() if f.kind in ("str", "key")]
SHELL_BY_DESIGN = {("setup", 0)}       # site setup lines are shell the site's admins write
EXECUTORS = {"local": local_mod.Executor, "slurm": slurm_mod.Executor, "lsf": lsf_mod.LsfExecutor}
RANK_MODULE = {"local": "submitit.core._submit", "slurm": "submitit.core._submit",
               "lsf": "hpcring.schedulers.lsf_task"}
CASES = [(f, s) for f in TEXT_FIELDS for s in SCHEDULERS if applies(f, s)]
IDS = [f"{f.dotted}-{s}" for f, s in CASES]

_STUB_LAUNCHER = """#!/bin/bash
printf '%s\\0' "$@" > "$REC/launcher"
env -0 > "$REC/env"
"""
# the local backend's local_run starts each rank with `bash -c "exec " + " ".join(words after --)`;
# the stub interpreter does the same, with printf in the rank's place recording its words
_STUB_PYTHON = """#!/bin/bash
printf '%s\\0' "$@" > "$REC/python"
env -0 > "$REC/env"
while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done
shift
exec bash -c "exec printf '%s\\\\0' $*" > "$REC/rank"
"""


def _words(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1] if path.exists() else []


class Sandbox:
    """A folder with stub launchers and interpreter, where a rendered job script runs harmlessly."""

    def __init__(self, root: Path) -> None:
        self.root, self.bin, self.rec, self.work = root, root / "bin", root / "rec", root / "work"
        for d in (self.bin, self.rec, self.work):
            d.mkdir(parents=True, exist_ok=True)
        for name in ("srun", "jsrun", "blaunch", "mpirun"):
            self._stub(name, _STUB_LAUNCHER)
        self.python = str(self._stub("python", _STUB_PYTHON))
        self.marker = root / "INJECTED"
        (root / "hosts").write_text("batch\nn1\nn2\n")

    def _stub(self, name: str, text: str) -> Path:
        p = self.bin / name
        p.write_text(text)
        p.chmod(0o755)
        return p

    def run(self, script_text: str) -> subprocess.CompletedProcess:
        script = self.root / "job.sh"
        script.write_text(script_text)
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "REC": str(self.rec), "HOME": str(self.root),
               "TMPDIR": str(self.root), "LSB_JOBID": "7", "LSB_DJOB_HOSTFILE": str(self.root / "hosts")}
        return subprocess.run(["bash", str(script)], cwd=self.work, env=env, capture_output=True,
                              text=True, timeout=60)

    def rank_words(self, scheduler: str) -> list[str]:
        """The words each rank would run: the local stub's record, else the launcher line's last five."""
        if scheduler == "local":
            return _words(self.rec / "rank")
        return _words(self.rec / "launcher")[-5:]

    def env(self) -> dict[str, str]:
        return dict(kv.split("=", 1) for kv in _words(self.rec / "env") if "=" in kv)


def render_as_submitted(site, job, python: str) -> tuple[str, str]:
    """The job script exactly as ``submit`` hands it over: the executor's own rank command and
    submission text, for the folder ``submit`` picks (without creating anything)."""
    folder = submit_mod.job_root(job) / "%j"
    ex = object.__new__(EXECUTORS[site.config.scheduler])
    ex.folder, ex.python, ex._site, ex._job, ex._template = folder, python, site, job, None
    return ex._make_submission_file_text(ex._submitit_command_str, "uid"), str(folder)


def _directive_words(text: str, prefix: str, skip: tuple[str, ...] = ()) -> list[list[str]]:
    """#SBATCH / #BSUB lines as the scheduler reads them (quotes honoured); sched_args pass as written."""
    out = []
    for line in text.splitlines():
        if line.startswith(prefix + " ") and not any(line == f"{prefix} {s}" for s in skip):
            out.append(shlex.split(line[len(prefix) + 1:]))
    return out


def _refusal_names(exc: ConfigError, site: Path, field: Field, lines: set[int]) -> None:
    msg = str(exc)
    want = ".".join(str(p) for p in (field.path[:-1] if field.kind == "key" else field.path))
    named = []
    for hit in (p.split(f"{site}:", 1)[1] for p in msg.splitlines() if f"{site}:" in p):
        line, _, rest = hit.partition(" ")
        key = rest.split(": ", 1)[0]
        if int(line) in lines and (key == want or key.startswith(want + ".") or want.startswith(key + ".")):
            named.append(key)
    assert named and all(k.split(".")[0] == want.split(".")[0] for k in named), f"{want}: {msg}"


def _load(tmp: Path, field: Field, scheduler: str, value: str, sandbox: Sandbox):
    """Write the site with ``value`` in ``field`` (the stub as its interpreter), and load it."""
    also = {} if field.path == ("python",) else {("python",): sandbox.python}
    if field.kind == "key" and field.path[0] == "partitions":
        also[("defaults", "partition")] = value       # so the partition's name reaches the script
    site_file, lines = write_site(tmp, scheduler, field, yaml_text(value), also=also)
    return site_file, lines


@pytest.mark.parametrize("field,scheduler", CASES, ids=IDS)
def test_line_break_in_a_site_value_is_refused(tmp_path, field, scheduler):
    box = Sandbox(tmp_path)
    site_file, lines = _load(tmp_path, field, scheduler, f"x\ntouch {box.marker}", box)
    with pytest.raises(ConfigError) as exc:
        load_site(str(site_file), {})
    _refusal_names(exc.value, site_file, field, lines)


@pytest.mark.parametrize("field,scheduler", [c for c in CASES if c[0].path not in SHELL_BY_DESIGN],
                         ids=[i for c, i in zip(CASES, IDS) if c[0].path not in SHELL_BY_DESIGN])
def test_shell_text_in_a_site_value_never_runs(tmp_path, monkeypatch, field, scheduler):
    box = Sandbox(tmp_path)
    payload = f"a b'c\"d $(touch {box.marker})`touch {box.marker}`;touch {box.marker};#"
    site_file, lines = _load(tmp_path, field, scheduler, payload, box)
    try:
        site = load_site(str(site_file), {})
    except ConfigError as exc:            # refused: it must say where
        _refusal_names(exc, site_file, field, lines)
        return
    monkeypatch.chdir(box.work)
    script = box.work / "train.py"
    script.write_text("pass\n")
    job = resolve_job(site, str(script), [], {}, environ={})
    python = site.config.python or box.python
    text, folder = render_as_submitted(site, job, python)
    r = box.run(text)
    assert not box.marker.exists(), f"{field} ran the injected command:\n{text}"
    assert r.returncode == 0, r.stderr + text
    assert box.rank_words(scheduler) == [python, "-u", "-m", RANK_MODULE[scheduler], folder], text
    if field.path[:2] == ("launcher", "args") and scheduler != "local":   # local starts no launcher
        assert payload in _words(box.rec / "launcher")
    if field.path[0] == "env" and field.kind == "str":
        assert box.env()["K"] == payload
    prefix = {"slurm": "#SBATCH", "lsf": "#BSUB"}.get(scheduler)
    if prefix:  # every directive but the sched_args (passed as written) is balanced shell words
        _directive_words(text, prefix, skip=tuple(site.config.sched_args))




@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_job_dir_with_spaces_and_quotes_renders_on_every_backend(tmp_path, monkeypatch, scheduler):
    box = Sandbox(tmp_path)
    monkeypatch.chdir(box.work)
    field = next(f for f in schema_fields() if f.path == ("python",))
    site_file, _ = write_site(tmp_path, scheduler, field, yaml_text(box.python))
    site = load_site(str(site_file), {})
    jd = tmp_path / WEIRD_DIR.format(marker=box.marker)
    job = resolve_job(site, str(box.work / "train.py"), [], {}, environ={"HPCRING_JOB_DIR": str(jd)})
    text, folder = render_as_submitted(site, job, box.python)
    assert folder == f"{jd}/%j"
    r = box.run(text)
    assert not box.marker.exists() and r.returncode == 0, r.stderr + text
    assert box.rank_words(scheduler) == [box.python, "-u", "-m", RANK_MODULE[scheduler], folder], text
    if scheduler == "local":
        words = _words(box.rec / "python")
        assert words[words.index("--folder") + 1] == folder, text
    if scheduler == "slurm":
        words = _directive_words(text, "#SBATCH", skip=tuple(site.config.sched_args))
        assert [f"--output={folder}/%j_0_log.out"] in words, text
        assert f"--output={folder}/%j_%t_log.out" in _words(box.rec / "launcher")
    if scheduler == "lsf":
        words = _directive_words(text, "#BSUB", skip=tuple(site.config.sched_args))
        assert ["-o", f"{jd}/%J/%J_batch.out"] in words, text
        assert box.env()["HPCRING_LOG_PATTERN"] == f"{folder}/%j_%t_log"


# -- a scheduler argument that replaces the site's warning signal is named ---------------------------

@pytest.mark.parametrize("site_name,args,named", [
    # Slurm: another signal is merged (both reach the ranks) and said so, not a replacement
    ("devcluster", ["--signal=SIGUSR1@60"], []),
    ("devcluster", ["--signal USR1@30"], []),
    ("devcluster", ["--signal=B:USR1@30"], ["slurm.signal 'USR2@60' with 'B:USR1@30'"]),  # theirs, kept
    ("devcluster-lsf", ["-wa USR1", "-wt 10"], ["lsf.warning_signal 'USR2' with 'USR1'",
                                                "lsf.warning_time '1' with '10'"]),
    ("devcluster", ["--signal=SIGUSR2@60", "--comment=x"], []),     # the same signal: nothing to say
    ("local", ["--signal=USR1@60"], []),                            # no scheduler to keep either
])
def test_a_flag_replacing_the_site_signal_is_warned_about(capsys, site_name, args, named):
    from hpcring.schedulers.render import render_script
    site = load_site(site_name, {})
    job = resolve_job(site, "train.py", [], {"nodes": 1}, environ={}, sched_args=args)
    render_script(site, job, "CMD", "/jobs/%j")
    err = capsys.readouterr().err
    assert err.count("warning: --sched-arg") == len(named), err
    merged = site_name == "devcluster" and "USR1" in args[0] and "B:" not in args[0]
    assert ("Slurm keeps one --signal per job" in err) == merged, err
    for text in named:
        assert text in err and str(site.path) in err, err

"""Containers: the words each runtime gets (argv tests: pyxis, Apptainer/Singularity and podman
cannot be installed here, Charliecloud also runs for real in test_container_*.py), the job script
as bash parses it, precedence of --container-* > HPCRING_CONTAINER_* > site, and bad input from
generated values of every new flag, variable and site key: one clear error, nothing submitted."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hpcring.config.jobspec import resolve_job
from hpcring.config.site import load_site
from hpcring.errors import ConfigError, UsageError
from hpcring.schedulers.render import render_script
from hpcring.config import container as cc
from hpcring.schedulers import container as ct, lsf, slurm
from hpcring.schedulers.launch_words import LaunchRequest, Shell

ROOT = Path(__file__).resolve().parents[2]
CMD = ("/venv/bin/python", "-u", "-m", "submitit.core._submit", "/jobs/7")
IMG = "/images/a b$(x)"   # never valid (white space), used only through ContainerRun directly


def _run(runtime, **kw):
    return cc.ContainerRun(runtime, kw.pop("image", "/img/train.sif"), **kw)


# -- the words per runtime ----------------------------------------------------------------------

def test_apptainer_words():
    c = _run("apptainer", mounts=("/data:/data:ro", "/scratch"), workdir="/w", flags=("--writable-tmpfs",))
    assert ct.prefix(c, gpus=True) == ("apptainer", "exec", "--nv", "--bind", "/data:/data:ro", "--bind",
                                       "/scratch:/scratch", "--pwd", "/w", "--writable-tmpfs", "/img/train.sif")
    assert ct.prefix(c)[:3] == ("apptainer", "exec", "--bind")     # no GPUs: no --nv
    assert ct.prefix(_run("singularity"))[:2] == ("singularity", "exec")
    assert ct.srun_options(c) == ()


def test_charliecloud_words():
    c = _run("charliecloud", image="/var/cache/img", mounts=("/data:/d:ro", "/srv"), workdir="/srv/w")
    # ch-run takes no mount options; "--" ends its own options
    assert ct.prefix(c, gpus=True) == ("ch-run", "-b", "/data:/d", "-b", "/srv:/srv", "-c", "/srv/w",
                                       "/var/cache/img", "--")


def test_podman_words_pass_the_fabric_and_launcher_env():
    c = _run("podman", image="docker.io/library/debian:12", mounts=("/data",), workdir="/w")
    words = ct.prefix(c, gpus=True)
    assert words[:8] == ("podman", "run", "--rm", "--network", "host", "--ipc", "host", "--device")
    assert words[8] == "nvidia.com/gpu=all"
    envs = {words[i + 1] for i, w in enumerate(words) if w == "--env"}
    for want in ("NCCL_*", "GLOO_*", "OMPI_*", "UCX_*", "HPCRING_*", "SLURM_*", "LSB_*", "SUBMITIT_*"):
        assert want in envs
    assert "HPCRING_SECRET_FILE" not in " ".join(words) or "HPCRING_*" in envs   # a name, never the secret
    assert words[-5:] == ("--volume", "/data:/data", "--workdir", "/w", "docker.io/library/debian:12")
    assert "--device" not in ct.prefix(c)


def test_pyxis_is_srun_options():
    c = _run("pyxis", image="nvcr.io#nvidia/pytorch:24.05-py3", mounts=("/a:/b:ro", "/jobs"), workdir="/ws",
             flags=("--container-remap-root",))
    assert ct.prefix(c) == ()
    assert ct.srun_options(c) == ("--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
                                  "--container-mounts=/a:/b:ro,/jobs:/jobs", "--container-workdir=/ws",
                                  "--container-remap-root")


def test_with_bind_skips_what_a_mount_already_covers():
    c = _run("charliecloud", mounts=("/srv", "/data:/x"))
    assert c.with_bind("/srv/jobs").mounts == ("/srv", "/data:/x")     # nested in an identity bind
    assert c.with_bind("/x").mounts == ("/srv", "/data:/x")            # the destination is taken
    assert c.with_bind("/data/jobs").mounts == ("/srv", "/data:/x", "/data/jobs")


# -- the launcher lines -------------------------------------------------------------------------

def _site(tmp_path, base: str, container: str, name="s"):
    text = (ROOT / "site_configs" / base).read_text() + container
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return load_site(str(p), {})


def test_slurm_line_puts_pyxis_before_the_command_and_others_as_a_prefix(tmp_path):
    site = _site(tmp_path, "devcluster.yaml", "container: {runtime: pyxis, image: 'a#b:1'}\n")
    req = LaunchRequest(2, 1, CMD, container=site and _run("pyxis", image="a#b:1"), size_step=True)
    argv = slurm.launch_argv(site.config, req).argv
    i = argv.index("--container-image=a#b:1")
    assert argv[i + 1:] == list(CMD) and argv[0] == "srun"
    req = LaunchRequest(2, 1, CMD, container=_run("charliecloud", image="/img"))
    argv = slurm.launch_argv(site.config, req).argv
    assert argv[-len(CMD) - 3:] == ["ch-run", "/img", "--", *CMD]


def test_lsf_blaunch_quotes_the_prefix_once_more(tmp_path):
    site = _site(tmp_path, "devcluster-lsf.yaml", "container: {runtime: apptainer}\n")
    c = _run("apptainer", image="/i/x y.sif")
    words = lsf.launch_argv(site.config, LaunchRequest(2, 1, CMD, container=c, hostfile="/h")).argv
    # blaunch joins its words and hands them to a shell on each host: each word arrives whole
    joined = " ".join(words[words.index("/h") + 1:])
    assert shlex.split(joined)[:3] == ["apptainer", "exec", "/i/x y.sif"]


def test_pyxis_needs_srun(tmp_path):
    with pytest.raises(ConfigError, match="container.runtime: pyxis is a plugin of Slurm's srun"):
        _site(tmp_path, "devcluster-lsf.yaml", "container: {runtime: pyxis, image: x}\n")


def test_charliecloud_mount_options_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"container.mounts.1: mount '/b:/b:ro': Charliecloud's ch-run -b takes no"):
        _site(tmp_path, "devcluster.yaml", "container: {runtime: charliecloud, image: /i, mounts: [/a, '/b:/b:ro']}\n")
    site = _site(tmp_path, "devcluster.yaml", "container: {runtime: charliecloud, image: /i}\n")
    with pytest.raises(UsageError, match="--container-mounts: mount '/c:/c:ro'"):
        cc.resolve(site.config.container, mounts=["/c:/c:ro"], environ={})


@pytest.mark.parametrize("runtime,flag", [("apptainer", "--cleanenv"), ("singularity", "-e"),
                                          ("apptainer", "--containall"), ("charliecloud", "--unset-env=*")])
def test_flags_that_empty_the_environment_are_refused(tmp_path, runtime, flag):
    with pytest.raises(ConfigError, match=r"container.flags.0: .*empty environment.*HPCRING_SECRET_FILE"):
        _site(tmp_path, "devcluster.yaml", f"container: {{runtime: {runtime}, image: /i, flags: ['{flag}']}}\n")


def _bash_words(script: str, first: str) -> list[str]:
    """The words of the job script's line that starts with ``first``, as bash hands them over."""
    lines = script.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(first + " "))
    line = "printf '%s\\n' " + "\n".join(lines[start:])[len(first) + 1:]
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    return [first] + out.stdout.split("\n")[:-1]


HOSTILE = "/img/x$(touch${IFS}/tmp/hpcring-pwned)`id`;'\"#.sif"


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer", "charliecloud", "podman"])
def test_job_script_hands_each_word_over_unchanged(tmp_path, runtime):
    mounts = ["/da'ta:/d$(x)", "/jobs;rm:/j`y`:ro"] if runtime != "charliecloud" else ["/da'ta:/d$(x)"]
    box = {"runtime": runtime, "image": HOSTILE, "mounts": mounts, "flags": ["--x=$(y)"]}
    site = _site(tmp_path, "devcluster.yaml", f"container: {json.dumps(box)}\n")   # JSON is YAML
    job = resolve_job(site, "train.py", [], {"nodes": 2}, environ={})
    text = render_script(site, job, "/venv/bin/python -u -m submitit.core._submit /jobs/%j", "/jobs/%j",
                         python="/venv/bin/python")
    words = _bash_words(text, "srun")
    c = job.container.with_bind("/jobs")
    tail = words[words.index("--mpi=pmix") + 1:]
    assert tail == [*ct.srun_options(c), *ct.prefix(c), "/venv/bin/python", "-u", "-m",
                    "submitit.core._submit", "/jobs/%j"]
    assert not Path("/tmp/hpcring-pwned").exists()


def test_local_backend_script_runs_the_prefix(tmp_path):
    site = _site(tmp_path, "local.yaml", "container: {runtime: charliecloud, image: /img}\n")
    job = resolve_job(site, "train.py", [], {}, environ={})
    text = render_script(site, job, "python -u -m submitit.core._submit /j/%j", "/j/%j")
    line = next(ln for ln in text.splitlines() if ln.startswith("  --folder"))
    cmd = shlex.split(line)[-1]      # local_run's command, one word of shell text
    assert shlex.split(cmd) == ["ch-run", "-b", "/j:/j", "/img", "--", "python", "-u", "-m",
                                "submitit.core._submit", "/j/%j"]


# -- precedence ---------------------------------------------------------------------------------

SITE_BOX = "container: {runtime: apptainer, image: /site.sif, mounts: ['/data:/data', '/x:/in']}\n"


def test_precedence_cli_env_site(tmp_path):
    site = _site(tmp_path, "devcluster.yaml", SITE_BOX)
    cfg = site.config.container
    assert cc.resolve(cfg, environ={}).image == "/site.sif"
    assert cc.resolve(cfg, environ={cc.ENV_IMAGE: "/env.sif"}).image == "/env.sif"
    assert cc.resolve(cfg, "/cli.sif", environ={cc.ENV_IMAGE: "/env.sif"}).image == "/cli.sif"
    got = cc.resolve(cfg, mounts=["/y:/in:ro,/z"], environ={cc.ENV_MOUNTS: "/e"})
    assert got.mounts == ("/data:/data", "/y:/in:ro", "/z")      # same destination: the flag's wins
    assert cc.resolve(cfg, environ={cc.ENV_MOUNTS: "/e:/e2"}).mounts == ("/data:/data", "/x:/in", "/e:/e2")
    assert cc.resolve(cfg, "/cli.sif", no_container=True, environ={}) is None
    assert cc.resolve(cfg, environ={cc.ENV_NONE: "1"}) is None
    assert cc.resolve(cfg, no_container=False, environ={cc.ENV_NONE: "1"}).image == "/site.sif"   # CLI wins
    assert cc.resolve(None, environ={}) is None


def test_image_without_a_runtime_is_an_error(tmp_path):
    site = _site(tmp_path, "devcluster.yaml", "")
    with pytest.raises(UsageError, match="--container-image '/x.sif': site s has no container section"):
        cc.resolve(site.config.container, "/x.sif", environ={}, site_name="s")
    with pytest.raises(UsageError, match=r"\$HPCRING_CONTAINER_IMAGE '/x.sif'"):
        cc.resolve(None, environ={cc.ENV_IMAGE: "/x.sif"}, site_name="s")
    with pytest.raises(UsageError, match="no container image"):
        cc.resolve(None, mounts=["/a"], environ={}, site_name="s")


def test_render_shows_the_flags(cli, tmp_path):
    site = tmp_path / "s.yaml"
    site.write_text((ROOT / "site_configs" / "devcluster.yaml").read_text() + SITE_BOX)
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    r = cli("render", str(script), "--site", str(site), "--container-image", "/c.sif", "--container-mounts", "/m:/m", env={"HPCRING_CONTAINER_IMAGE": "/e.sif"})
    assert r.exit_code == 0, r.output
    assert "--bind /m:/m" in r.output and " /c.sif \\" in r.output and "/e.sif" not in r.output
    r = cli("render", str(script), "--site", str(site), "--no-container")
    assert r.exit_code == 0 and "apptainer" not in r.output


# -- generated bad input ------------------------------------------------------------------------

_CONTROL = st.sampled_from([chr(c) for c in (*range(0x20), 0x7F, 0x85, 0x2028)])
_word = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=",:"), min_size=1, max_size=10)
_bad_images = st.one_of(
    st.tuples(_word, _CONTROL, _word).map("".join),                        # a control character
    st.tuples(_word, st.sampled_from([" ", "\t"]), _word).map("".join),    # two words
    _word.map(lambda w: "-" + w),                                          # read as an option
    st.just(""), st.just("   "))
_bad_mounts = st.one_of(
    st.sampled_from(["", ",", " , "]),                                     # no mount at all
    _word.filter(lambda w: not w.startswith("/")),                         # relative source
    _word.map(lambda w: f"/a:{w}").filter(lambda m: not m.split(":")[1].startswith("/")),  # relative destination
    st.tuples(_word, _word, _word).map(lambda t: f"/{t[0]}:/{t[1]}:/o:{t[2]}"),  # too many ':'
    st.tuples(_word, st.sampled_from([" ", "\t"]), _word).map(lambda t: f"/{t[0]}{t[1]}{t[2]}"),
    _word.map(lambda w: f"/a:/b:{w}!"),                                    # options not one word
    st.tuples(_word, _CONTROL).map(lambda t: f"/{t[0]}{t[1]}"))


def _no_submit(cli, tmp_path, args, env):
    """`hpcring submit` with ``args`` and ``env`` must fail with one clear message and start nothing."""
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))     # hypothesis reuses tmp_path across examples
    site = tmp_path / "s.yaml"
    site.write_text((ROOT / "site_configs" / "local.yaml").read_text() + SITE_BOX)
    (tmp_path / "t.py").write_text("pass\n")
    state = tmp_path / "state"
    r = cli("submit", str(tmp_path / "t.py"), "--site", str(site), *args, env={"HPCRING_STATE_DIR": str(state), "HPCRING_JOB_DIR": str(tmp_path / "jobs"), **env})
    assert r.exit_code not in (0, None), r.output
    assert "Traceback" not in r.output and "\x1b" not in r.output, r.output
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").glob("[0-9]*")), "a job started"
    return r.output


def _no_run(cli, tmp_path, args):
    """`hpcring run` with ``args`` must fail before starting a rank (``true`` would exit 0)."""
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))
    site = tmp_path / "s.yaml"
    site.write_text((ROOT / "site_configs" / "local.yaml").read_text() + SITE_BOX)
    r = cli("run", "--site", str(site), *args, "--", "true")
    assert r.exit_code not in (0, None), r.output
    assert "Traceback" not in r.output and "\x1b" not in r.output, r.output
    return r.output


_FAST = settings(max_examples=int(os.environ.get("HPCRING_SITE_FIELD_EXAMPLES", "5")) * 4, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@_FAST
@given(_bad_images)
def test_bad_container_image_flag_and_variable(cli, tmp_path, image):
    out = _no_submit(cli, tmp_path, ["--container-image", image], {})
    assert "--container-image" in out, out
    assert "--container-image" in _no_run(cli, tmp_path, ["--container-image", image])
    if "\x00" not in image and image:      # an empty variable counts as unset
        out = _no_submit(cli, tmp_path, [], {"HPCRING_CONTAINER_IMAGE": image})
        assert "HPCRING_CONTAINER_IMAGE" in out, out


@_FAST
@given(_bad_mounts)
def test_bad_container_mounts_flag_and_variable(cli, tmp_path, mount):
    out = _no_submit(cli, tmp_path, ["--container-mounts", mount], {})
    assert "--container-mounts" in out, out
    assert "--container-mounts" in _no_run(cli, tmp_path, ["--container-mounts", mount])
    if "\x00" not in mount and mount.strip(" ,"):    # an empty variable counts as unset
        out = _no_submit(cli, tmp_path, [], {"HPCRING_CONTAINER_MOUNTS": mount})
        assert "HPCRING_CONTAINER_MOUNTS" in out, out


@_FAST
@given(st.one_of(_bad_mounts.map(lambda m: ("mounts", [m])), _bad_images.map(lambda i: ("image", i)),
                 _word.filter(lambda w: not w.startswith("/")).map(lambda w: ("workdir", w)),
                 _word.filter(lambda w: not w.startswith("-")).map(lambda w: ("flags", [w])),
                 st.sampled_from(["docker", "enroot", "Pyxis", ""]).map(lambda r: ("runtime", r))))
def test_bad_site_container_values(tmp_path, kv):
    key, value = kv
    box = {"runtime": "apptainer", "image": "/ok.sif", key: value}
    site = tmp_path / "bad.yaml"
    site.write_text((ROOT / "site_configs" / "local.yaml").read_text() + "container: " + json.dumps(box) + "\n")
    with pytest.raises(ConfigError) as exc:
        load_site(str(site), {})
    assert f"container.{key}" in str(exc.value), str(exc.value)


def test_bad_no_container_variable(cli, tmp_path):
    out = _no_submit(cli, tmp_path, [], {"HPCRING_NO_CONTAINER": "maybe"})
    assert "HPCRING_NO_CONTAINER" in out, out


def test_verbose_names_where_the_image_and_mounts_came_from(cli, tmp_path):
    site = tmp_path / "s.yaml"
    site.write_text((ROOT / "site_configs" / "devcluster.yaml").read_text() + SITE_BOX)
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    r = cli("render", str(script), "--site", str(site), "-v", env={"HPCRING_CONTAINER_MOUNTS": "/e:/e"})
    assert r.exit_code == 0, r.output
    assert re.search(r"container +apptainer /site.sif +<- site devcluster", r.output), r.output
    assert re.search(r"mounts +/data:/data,/x:/in,/e:/e +<- env HPCRING_CONTAINER_MOUNTS \+ site devcluster",
                     r.output), r.output


def test_hpcring_run_ranks_use_the_sites_python_inside_an_image(tmp_path, monkeypatch):
    """hpcring run's rank entry (rank_exec) runs in the image: with the site's interpreter there
    (hpcring installed in the image), this one on the host."""
    from hpcring import allocation
    started = []

    def fake_start(rank_cmd, env, nodes, per_node):
        started.append(rank_cmd)
        return []
    monkeypatch.setattr(allocation, "_start_local", fake_start)
    monkeypatch.setattr(allocation, "_wait_all", lambda procs, diag=None: [0])
    monkeypatch.setattr(allocation, "_verdict", lambda *a, **k: 0)
    site = _site(tmp_path, "local.yaml", "python: /opt/img/bin/python\n"
                 "container: {runtime: charliecloud, image: /img}\n")
    box = cc.resolve(site.config.container, environ={})
    allocation.run(["true"], site, 1, 1, environ={}, container=box)
    allocation.run(["true"], site, 1, 1, environ={}, container=None)
    inside, host = started
    assert inside[0] == "ch-run" and inside[inside.index("--") + 1] == "/opt/img/bin/python", inside
    assert inside[inside.index("-c") + 1] == os.getcwd()          # ranks start where run was started
    assert host[0] == sys.executable


def test_hpcring_run_with_pyxis_outside_slurm_is_refused(cli, tmp_path):
    site = tmp_path / "p.yaml"
    site.write_text((ROOT / "site_configs" / "slurm-pyxis.yaml").read_text().replace("/lustre/jobs/hpcring",
                                                                                      str(tmp_path / "j")))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LSB_"))}
    r = cli("run", "--site", str(site), "--", "true", env=env)
    assert r.exit_code not in (0, None) and "pyxis is a plugin of Slurm's srun" in r.output, r.output
    # --no-container: on the host (this machine has no ib0, so the ranks fail there, past this check)
    r = cli("run", "--site", str(site), "--no-container", "--tasks-per-node", "1", "--", "true", env=env)
    assert "pyxis" not in r.output, r.output

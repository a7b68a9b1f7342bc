"""Golden files of the rendered job script for every bundled site (HPCRING_UPDATE_GOLDEN=1 rewrites)."""
import os
from pathlib import Path

import pytest

from hpcring.config.jobspec import resolve_job
from hpcring.config.site import available_sites, load_site
from hpcring.errors import TemplateError
from hpcring.schedulers.render import render_script

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
BUNDLED = sorted(n for n, _, origin in available_sites({}) if origin == "bundled")
COMMAND = "/usr/bin/python3 -u -m submitit.core._submit /jobs/%j"


def _job(site_name: str):
    site = load_site(site_name, {})
    nodes = min(2, next(iter(site.config.partitions.values())).max_nodes or 2) if site.config.partitions else 2
    job = resolve_job(site, "train.py", ["--lr", "0.1"], {"nodes": nodes, "name": "golden"}, environ={},
                      sched_args=["--comment=golden"])
    return site, job


@pytest.mark.parametrize("site_name", BUNDLED)
def test_golden(site_name):
    site, job = _job(site_name)
    text = render_script(site, job, COMMAND, "/jobs/%j", python="/usr/bin/python3")
    path = GOLDEN / f"{site_name}.sh"
    if os.environ.get("HPCRING_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with HPCRING_UPDATE_GOLDEN=1"
    assert text == path.read_text()


def test_gres_vs_gpus_per_node_and_exclusive():
    site, job = _job("slurm-roce")
    text = render_script(site, job, COMMAND, "/jobs/%j")
    assert "#SBATCH --gres=gpu:8" in text and "--gpus-per-node" not in text
    assert "#SBATCH --exclusive" in text and "--mpi=pmi2" in text
    site, job = _job("slurm-infiniband")
    text = render_script(site, job, COMMAND, "/jobs/%j")
    assert "#SBATCH --gpus-per-node=4" in text and "#SBATCH --qos" not in text
    assert "export NCCL_IB_HCA==mlx5_0:1,mlx5_1:1" in text
    assert "#SBATCH --comment=golden" in text and "#SBATCH --signal=USR2@90" in text


def test_lsf_jsrun_resource_sets():
    site, job = _job("lsf-summit")
    text = render_script(site, job, COMMAND, "/jobs/%j")
    assert "#BSUB -nnodes 2" in text and "#BSUB -o /jobs/%J/%J_batch.out" in text
    assert "jsrun -n 12 -r 6 -a 1 -c 7 -g 1 -b packed:7" in text
    assert "#BSUB -W 2:00" in text and "#BSUB -P ABC123" in text


def test_strict_undefined_in_user_template(tmp_path):
    t = tmp_path / "mine.sh.j2"
    t.write_text("#!/bin/bash\n{{ job.nodes }} {{ no_such_thing }}\n")
    site, job = _job("slurm-tcp")
    with pytest.raises(TemplateError, match="no_such_thing"):
        render_script(site, job, COMMAND, "/jobs/%j", template=t)
    with pytest.raises(TemplateError, match="does not exist"):
        render_script(site, job, COMMAND, "/jobs/%j", template=tmp_path / "nope.j2")


def test_site_own_template_relative_to_site_file(tmp_path):
    (tmp_path / "t.j2").write_text("#!/bin/bash\n# {{ site.name }} {{ job.ntasks }}\n{{ command }}\n")
    (tmp_path / "s.yaml").write_text("name: own\nscheduler: slurm\ntemplate: t.j2\nlauncher: {kind: srun}\n")
    site = load_site(str(tmp_path / "s.yaml"))
    job = resolve_job(site, "x.py", [], {"nodes": 3}, environ={})
    assert render_script(site, job, "CMD", "/f") == "#!/bin/bash\n# own 3\nCMD\n"


def _signals(sched_args):
    site = load_site("devcluster", {})       # slurm.signal USR2@60
    job = resolve_job(site, "train.py", [], {"nodes": 2, "name": "sig"}, environ={}, sched_args=sched_args)
    return render_script(site, job, COMMAND, "/jobs/%j", python="/usr/bin/python3")


def test_a_second_warning_signal_is_forwarded_by_the_batch_shell(capsys):
    """Lightning's --signal=SIGUSR1@90 beside the site's USR2@60: one B: directive at the earlier
    time, a trap that hands the ranks hpcring's signal first, then the script's; srun in the
    background so that the trap runs while it does; srun's own exit code is the job's."""
    import subprocess
    text = _signals(["--signal=SIGUSR1@90", "--comment=x"])
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH --signal")]
    assert directives == ["#SBATCH --signal=B:USR1@90"]
    assert "#SBATCH --comment=x" in text
    assert 'for s in USR2 USR1; do scancel --signal="$s" "$SLURM_JOB_ID"; done' in text
    assert "trap hpcring_warn USR1" in text and "export SUBMITIT_PREEMPT_SIGNAL=USR2" in text
    assert "Slurm keeps one --signal per job" in capsys.readouterr().err
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


@pytest.mark.parametrize("args,directive", [
    ([], "#SBATCH --signal=USR2@60"),                               # the site's alone: Slurm delivers
    (["--signal=USR2@120"], "#SBATCH --signal=USR2@120"),            # the same signal: the earlier time
    (["--signal=B:USR1@90"], "#SBATCH --signal=B:USR1@90"),          # the user's own B: choice is kept
])
def test_one_signal_needs_no_forwarding(args, directive):
    text = _signals(args)
    assert [line for line in text.splitlines() if line.startswith("#SBATCH --signal")][-1] == directive
    assert "hpcring_warn" not in text and " &\n" not in text


def test_the_forwarding_loop_keeps_the_launchers_exit_code():
    """The wait loop of the forwarding script: a trapped signal interrupts `wait`, the loop waits
    again, and the job exits with the launcher's own code (here a stand-in for srun)."""
    import subprocess
    text = _signals(["--signal=SIGUSR1@90"])
    loop = text[text.index("hpcring_launch=$!"):]
    script = ("trap 'echo trapped' USR1\n(sleep 1; exit 7) &\n" + loop)
    p = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    import time
    time.sleep(0.3)
    p.send_signal(10)                 # SIGUSR1 while the launcher runs
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 7 and "trapped" in out

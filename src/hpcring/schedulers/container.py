"""The words that start a rank inside the job's container (:class:`hpcring.config.container.ContainerRun`)
for each runtime: pyxis adds options to srun (``--container-image`` & co.); the other runtimes put
a prefix before the rank's command (``apptainer exec``, ``ch-run``, ``podman run``), so the same
words serve Slurm, LSF and the local backend.
"""
from __future__ import annotations

from hpcring.config.container import ContainerRun, mount_pair

# what podman hands the rank from the host (its `--env PREFIX*` form): the launcher's rank
# variables, the fabric's (NCCL, Gloo, Open MPI, UCX), hpcring's and submitit's. apptainer,
# ch-run and pyxis pass the whole environment on their own.
PODMAN_ENV = ("HPCRING_*", "SUBMITIT_*", "SLURM_*", "SLURMD_*", "PMIX_*", "PMI_*", "LSB_*", "LSF_*",
              "JSM_*", "OMPI_*", "PRTE_*", "UCX_*", "NCCL_*", "GLOO_*", "CUDA_*", "NVIDIA_*", "TORCH_*",
              "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              "PYTHONPATH", "PYTHONUNBUFFERED", "HOME", "USER", "TMPDIR")


def srun_options(c: ContainerRun | None) -> tuple[str, ...]:
    """pyxis: the srun options that put every task of the step into the image (enroot passes the
    task's whole environment, so nothing else is needed)."""
    if c is None or c.runtime != "pyxis":
        return ()
    out = [f"--container-image={c.image}"]
    if c.mounts:
        out.append("--container-mounts=" + ",".join(mount_pair(m) for m in c.mounts))
    if c.workdir:
        out.append(f"--container-workdir={c.workdir}")
    return (*out, *c.flags)


def prefix(c: ContainerRun | None, gpus: bool = False) -> tuple[str, ...]:
    """The words before the rank's command (empty without a container and for pyxis)."""
    if c is None or c.runtime == "pyxis":
        return ()
    if c.runtime in ("apptainer", "singularity"):
        words = [c.runtime, "exec"] + (["--nv"] if gpus else [])
        for m in c.mounts:
            words += ["--bind", mount_pair(m)]
        if c.workdir:
            words += ["--pwd", c.workdir]
        return (*words, *c.flags, c.image)
    if c.runtime == "charliecloud":
        # ch-run keeps the environment; -b binds (ch-run takes no mount options); -c the work dir
        words = ["ch-run"]
        for m in c.mounts:     # options are refused earlier (site check, resolve)
            words += ["-b", ":".join(mount_pair(m).split(":")[:2])]
        if c.workdir:
            words += ["-c", c.workdir]
        return (*words, *c.flags, c.image, "--")
    if c.runtime == "podman":
        words = ["podman", "run", "--rm", "--network", "host", "--ipc", "host"]
        if gpus:   # NVIDIA's CDI spec (nvidia-ctk cdi generate) names the GPUs
            words += ["--device", "nvidia.com/gpu=all"]
        for e in PODMAN_ENV:
            words += ["--env", e]
        for m in c.mounts:
            words += ["--volume", mount_pair(m)]
        if c.workdir:
            words += ["--workdir", c.workdir]
        return (*words, *c.flags, c.image)
    raise ValueError(f"container runtime {c.runtime!r} unknown")

"""What a job's container is: the site's ``container:`` section, ``--container-image``,
``--container-mounts``, ``--no-container`` and their HPCRING_* variables, checked and merged by
precedence into one :class:`ContainerRun` (the words that start a rank inside it are the
schedulers' business: :mod:`hpcring.schedulers.container`). docs/containers.md says how hpcring
itself gets into the image.

The job folder (which holds the per-job secret file) is always bind-mounted at its own path, so
HPCRING_SECRET_FILE names the same file inside: the secret never travels on a command line.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Mapping

from hpcring.config.text import text_problem
from hpcring.errors import UsageError

RUNTIMES = ("pyxis", "apptainer", "singularity", "charliecloud", "podman")
ENV_IMAGE, ENV_MOUNTS, ENV_NONE = "HPCRING_CONTAINER_IMAGE", "HPCRING_CONTAINER_MOUNTS", "HPCRING_NO_CONTAINER"
_OPTS = re.compile(r"[A-Za-z0-9_+=.-]+")



def mount_problem(entry: str) -> str | None:
    """Why ``entry`` is not a mount ``SRC[:DST[:OPTIONS]]`` every runtime takes, None if it is.
    Absolute paths (a relative one means another folder on each node); no ``,`` (pyxis's
    separator) or white space; options one word such as ``ro``."""
    parts = entry.split(":")
    if len(parts) > 3:
        return f"{entry!r} has {len(parts) - 1} ':'; write SRC[:DST[:OPTIONS]], e.g. /data:/data:ro"
    if "," in entry or any(c.isspace() for c in entry):
        return f"{entry!r} holds a ',' or white space; give one mount per entry (paths without spaces)"
    for what, p in zip(("source", "destination"), parts[:2]):
        if not p.startswith("/"):
            return f"{entry!r}: the {what} {p!r} is not an absolute path; write SRC[:DST[:OPTIONS]], e.g. /data:/data:ro"
    if len(parts) == 3 and not _OPTS.fullmatch(parts[2]):
        return f"{entry!r}: options {parts[2]!r} are not one word such as ro or rw"
    return None


def image_problem(image: str) -> str | None:
    """Why ``image`` cannot name an image, None if it can (it is one quoted word on the line)."""
    if not image.strip():
        return "is empty"
    if image.startswith("-"):
        return f"{image!r} starts with '-': the runtime would read it as an option"
    if any(c.isspace() for c in image):
        return f"{image!r} holds white space; an image is one word (a path, a .sif/.sqsh file or a registry name)"
    return None


@dataclass(frozen=True)
class ContainerRun:
    """The container every rank of one job (or ``hpcring run``) starts in."""

    runtime: str
    image: str
    mounts: tuple[str, ...] = ()
    workdir: str | None = None
    flags: tuple[str, ...] = ()
    sources: tuple[tuple[str, str], ...] = ()   # (setting, where it came from) for --verbose

    def with_bind(self, path: str) -> "ContainerRun":
        """This container with ``path`` bound at its own path (the job folder, a run folder), unless a
        mount already puts something there."""
        for m in self.mounts:
            src, dst = mount_pair(m).split(":")[:2]
            # taken, or already inside a folder bound at its own path (nested binds also need a
            # mount point in the image for Charliecloud)
            if dst == path or (src == dst and path.startswith(dst.rstrip("/") + "/")):
                return self
        return replace(self, mounts=self.mounts + (path,))


def _dst(mount: str) -> str:
    parts = mount.split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def mount_pair(mount: str) -> str:
    """SRC:DST[:OPTS] with DST written out (podman reads a lone path as a named volume)."""
    parts = mount.split(":")
    return ":".join([parts[0], parts[1] if len(parts) > 1 else parts[0], *parts[2:]])


def _split_mounts(text: str, where: str) -> tuple[str, ...]:
    out = tuple(m for m in text.split(",") if m)    # no strip(): it would hide white space and NEL
    for m in out:
        why = mount_problem(m)
        if why:
            raise UsageError(f"{where}: mount {why}",
                             hint="give mounts as SRC[:DST[:OPTIONS]], comma-separated, absolute paths")
    return out


def _truthy(text: str, where: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise UsageError(f"{where}: {text!r} is not a boolean", hint="write 1 or 0")


def resolve(site_container, image: str | None = None, mounts: list[str] | None = None,
            no_container: bool | None = None, environ: Mapping[str, str] | None = None,
            site_name: str = "site") -> ContainerRun | None:
    """The job's container, by precedence (CLI > HPCRING_* > site ``container:``), or None.

    ``site_container``: the site's validated ``container`` section (None without one). The image
    comes from ``--container-image``, else HPCRING_CONTAINER_IMAGE, else the site; without an image
    ranks run on the host. ``--container-mounts`` (else HPCRING_CONTAINER_MOUNTS) adds to the site's
    mounts, replacing a site mount of the same destination. ``--no-container`` (else
    HPCRING_NO_CONTAINER=1) runs on the host whatever the rest says. Raises UsageError.
    """
    env = os.environ if environ is None else environ

    def _ct(text: str) -> None:
        why = text_problem(text)
        if why:
            raise ValueError(why)
    if no_container is None and env.get(ENV_NONE, "") != "":
        no_container = _truthy(env[ENV_NONE], f"${ENV_NONE}")
    sources = []
    if image is not None:
        where, src = "--container-image", "cli"
    elif env.get(ENV_IMAGE):
        image, where, src = env[ENV_IMAGE], f"${ENV_IMAGE}", f"env {ENV_IMAGE}"
    elif site_container is not None and site_container.image:
        image, where, src = site_container.image, f"site {site_name} container.image", f"site {site_name}"
    else:
        where = src = ""
    if image is not None:
        try:
            _ct(image)
        except ValueError as exc:
            raise UsageError(f"{where}: image {exc}", hint="give one image: a path or a registry name") from None
        why = image_problem(image)
        if why:
            raise UsageError(f"{where}: image {why}", hint="give one image: a path or a registry name")
    extra: tuple[str, ...] = ()
    for i, m in enumerate(mounts or []):
        try:
            _ct(m)
        except ValueError as exc:
            raise UsageError(f"--container-mounts #{i + 1}: {exc}", hint="one line, no control characters") from None
        got = _split_mounts(m, f"--container-mounts #{i + 1}")
        if not got:
            raise UsageError(f"--container-mounts #{i + 1} {m!r} names no mount",
                             hint="give SRC[:DST[:OPTIONS]], comma-separated, or leave the flag out")
        extra += got
    if not mounts and env.get(ENV_MOUNTS):
        try:
            _ct(env[ENV_MOUNTS])
        except ValueError as exc:
            raise UsageError(f"${ENV_MOUNTS}: {exc}", hint="one line, no control characters") from None
        extra = _split_mounts(env[ENV_MOUNTS], f"${ENV_MOUNTS}")
    if no_container:
        return None
    if image is None:
        if extra:
            raise UsageError(f"container mounts {', '.join(extra)} given but no container image "
                             f"(site {site_name} has none)",
                             hint="add --container-image IMAGE, or set container.image in the site config")
        return None
    if site_container is None:
        raise UsageError(f"{where} {image!r}: site {site_name} has no container section, so no runtime "
                         "(pyxis, apptainer, singularity, charliecloud or podman) to start it with",
                         hint="add `container: {runtime: ...}` to the site config (docs/containers.md)")
    for m in extra:
        if site_container.runtime == "charliecloud" and m.count(":") == 2:
            raise UsageError(f"{'--container-mounts' if mounts else '$' + ENV_MOUNTS}: mount {m!r}: Charliecloud's "
                             "ch-run -b takes no mount options", hint="write SRC[:DST]")
    new_dsts = {_dst(m) for m in extra}
    site_mounts = tuple(m for m in site_container.mounts if _dst(m) not in new_dsts)
    sources.append(("container.image", src))
    if extra:
        sources.append(("container.mounts", "cli" if mounts else f"env {ENV_MOUNTS}"))
    return ContainerRun(site_container.runtime, image, site_mounts + extra, site_container.workdir,
                        tuple(site_container.flags), tuple(sources))

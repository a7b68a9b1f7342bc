"""A Debian root tree holding another Slurm release's programs, built once and kept.

debootstrap makes a minimal tree of the release's Debian suite; apt inside it installs the Slurm
packages. The programs need the tree's glibc, not the machine's, so each one's program
interpreter and library path are set (patchelf, run inside the tree) to the tree's loader and
libraries: run from the machine they then load only the tree's libraries, and a job step they
exec runs on the machine's userland. A marker written last makes a complete tree reusable.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hpcring.errors import DevClusterError

from . import names as n
from .system import output, run

DEBOOTSTRAP_DEADLINE_S = 900.0  # measured 20 s here (minbase, trixie, deb.debian.org)
APT_DEADLINE_S = 900.0  # measured 15 s for the Slurm packages


def tree_info(rel: n.Release) -> dict | None:
    """The marker of a complete tree (version, programs), or None when there is none."""
    try:
        info = json.loads(rel.tree_marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not str(info.get("version", "")).startswith(rel.version + "."):
        return None
    if not isinstance(info.get("programs"), list):
        return None
    return info


def in_tree(root: Path, path: str) -> Path:
    """``path`` as seen inside the tree, with symlinks resolved there (Debian's alternatives are
    absolute links, which followed from the machine would land on its own 22.05 programs)."""
    cur = path
    for _ in range(40):
        host = root / cur.lstrip("/")
        if not host.is_symlink():
            return host
        target = os.readlink(host)
        cur = target if target.startswith("/") else os.path.normpath(os.path.join(os.path.dirname(cur), target))
    raise DevClusterError(f"too many symbolic links resolving {path} inside {root}",
                          hint=f"remove {root} and run `up` again to rebuild the tree")


def programs_from_listing(listing: str) -> list[str]:
    """The programs (under /usr/bin, /usr/sbin) in a ``dpkg -L`` listing, sorted, once each."""
    return sorted({line.strip() for line in listing.splitlines()
                   if line.startswith(("/usr/bin/", "/usr/sbin/")) and line.strip().count("/") == 3})


def patchelf_argv(rel: n.Release, program: str) -> list[str]:
    """argv (run inside the tree) that points ``program`` at the tree's loader and libraries.

    The paths are the machine's view of the tree: the programs run from the machine, not chrooted.
    DT_RPATH (not RUNPATH) so that the plugins Slurm dlopens resolve their libraries there too."""
    lib = rel.root / n.TREE_LIB_DIR
    return ["chroot", str(rel.root), "patchelf", "--set-interpreter", str(rel.root / n.TREE_LOADER),
            "--force-rpath", "--set-rpath", f"{lib / 'slurm-wlm'}:{lib}", program]


def ensure_tree(rel: n.Release, actions: list[str]) -> dict:
    """Build the tree unless a complete one is there; returns its marker (version, programs)."""
    info = tree_info(rel)
    if info:
        return info
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise DevClusterError(f"Slurm {rel.version} needs a Debian {rel.suite} root tree, and "
                              "debootstrap is not installed", hint="apt-get install debootstrap")
    root = rel.root
    if root.exists():  # a tree without its marker was cut short: start again
        shutil.rmtree(root)
    rel.home.mkdir(parents=True, exist_ok=True)
    where = f"building the Debian {rel.suite} tree for Slurm {rel.version} in {root}"
    hint = (f"check that {n.DEBIAN_MIRROR} is reachable (apt-get update works); the next "
            "`up --slurm {0}` starts the tree again".format(rel.version))
    run([debootstrap, "--variant=minbase", rel.suite, str(root), n.DEBIAN_MIRROR],
        what=where + " (debootstrap)", timeout=DEBOOTSTRAP_DEADLINE_S, hint=hint)
    # Package scripts must not start daemons inside the tree.
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["chroot", str(root), "apt-get", "update", "-q"], what=where + " (apt-get update)",
        timeout=APT_DEADLINE_S, hint=hint, env=env)
    run(["chroot", str(root), "apt-get", "install", "-y", "-q", "--no-install-recommends",
         *rel.packages, *rel.tools], what=where + " (apt-get install)", timeout=APT_DEADLINE_S,
        hint=hint, env=env)
    listing = run(["chroot", str(root), "dpkg", "-L", *rel.packages], what=where + " (dpkg -L)").stdout
    programs = programs_from_listing(listing)
    for p in programs:
        real = "/" + str(in_tree(root, p).relative_to(root))
        run(patchelf_argv(rel, real), what=f"{where}: patching {real}")
    relocate_pmix(rel)
    version = _version(rel)
    if not version.startswith(rel.version + "."):
        raise DevClusterError(f"{where}: the tree's slurmd says {version!r}, not {rel.version}.x",
                              hint=f"Debian {rel.suite} changed its Slurm; remove {root} and "
                              "update names.RELEASES")
    info = {"version": version, "suite": rel.suite, "programs": programs}
    rel.tree_marker.write_text(json.dumps(info, indent=1) + "\n")
    actions.append(f"built the Debian {rel.suite} tree with Slurm {version} in {root}")
    return info


def _version(rel: n.Release) -> str:
    """``24.11.5`` from the tree's ``slurmd -V`` (run from the machine, as the cluster will)."""
    out = output([str(in_tree(rel.root, "/usr/sbin/slurmd")), "-V"], timeout=10) or ""
    return out.strip().split()[-1] if out.strip() else ""


def relocate_pmix(rel: n.Release) -> list[Path]:
    """Point the tree's PMIx and Slurm's pmix plugin at the tree's PMIx (through ``rel.pmix_link``)
    instead of the machine's, which is another PMIx major version. The path is replaced in the
    files by one of the same length; returns the files changed."""
    old, new = str(n.PMIX_LIB_DIR).encode(), str(rel.pmix_link).encode()
    if len(new) != len(old) or len(rel.pmix_link.name) != 2:
        raise DevClusterError(f"{rel.home} is too long for the PMIx path {rel.pmix_link} "
                              f"(it must be {len(old)} characters)",
                              hint="choose a shorter home for the release in names.RELEASES")
    lib = rel.root / n.TREE_LIB_DIR
    tree_pmix = rel.root / str(n.PMIX_LIB_DIR).lstrip("/")
    if rel.pmix_link.is_symlink() or rel.pmix_link.exists():
        rel.pmix_link.unlink()
    rel.pmix_link.parent.mkdir(parents=True, exist_ok=True)
    rel.pmix_link.symlink_to(tree_pmix)
    changed = []
    candidates = [*lib.glob("slurm-wlm/mpi_pmix*.so"), *tree_pmix.glob("libpmix.so*"), *tree_pmix.glob("pmix/*.so")]
    for f in candidates:
        if f.is_symlink():
            continue
        data = f.read_bytes()
        if old in data:
            f.write_bytes(data.replace(old, new))
            changed.append(f)
    return changed

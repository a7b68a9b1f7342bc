"""The world of a second Slurm release: a network and a mount namespace of its own.

Inside, the dev cluster's fixed paths are bound to the release's own files and the tree's Slurm
over the machine's, so `hpcring devcluster` and the tests run there unchanged (docs/devcluster.md).
"""
from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hpcring.errors import DevClusterError

from . import configs, hosts
from . import names as n
from .prereqs import check_root
from .tree import ensure_tree, in_tree
from .system import is_nsfs_mount, mount_of, ns_inode, ok, pids_in_ns, run, terminate

KINDS = ("net", "mnt")
OPTION = {"net": "net", "mnt": "mount"}  # unshare's and nsenter's option per kind
LOCK_DEADLINE_S = 180.0


def release(version: str) -> n.Release:
    """The release named ``version``; a clear error naming the choices otherwise."""
    rel = n.RELEASES.get(version)
    if rel is None:
        choices = ", ".join([n.HOST_RELEASE, *n.RELEASES])
        raise DevClusterError(f"no dev cluster Slurm release {version!r}",
                              hint=f"choose one of {choices} (--slurm or ${n.RELEASE_ENV})")
    return rel


def chosen(option: str | None) -> str:
    """The release a command means: ``--slurm``, else $HPCRING_DEVCLUSTER_SLURM, else 22.05."""
    return option or os.environ.get(n.RELEASE_ENV) or n.HOST_RELEASE


def runs_here(version: str) -> bool:
    """True when ``version`` is the machine's release or the world this process is already in."""
    return version == n.HOST_RELEASE or os.environ.get(n.WORLD_ENV) == version


@contextmanager
def lock(rel: n.Release) -> Iterator[None]:
    """One `up`/`down` of this release's world at a time (waits up to 3 min for another)."""
    rel.home.mkdir(parents=True, exist_ok=True)
    with open(rel.lock_file, "w") as f:
        deadline = time.monotonic() + LOCK_DEADLINE_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DevClusterError(f"another `hpcring devcluster` command holds {rel.lock_file} for 3 min",
                                          hint=f"wait for it, or find it with `fuser -v {rel.lock_file}`") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def enter_argv(rel: n.Release) -> list[str]:
    """argv prefix that runs a command inside the world (its network and mounts), in the current
    directory (entering a mount namespace alone would start it in /)."""
    return ["nsenter", *(f"--{OPTION[k]}={rel.world_ns(k)}" for k in KINDS), f"--wd={os.getcwd()}", "--"]


def world_env(rel: n.Release) -> dict[str, str]:
    return dict(os.environ, **{n.WORLD_ENV: rel.version, n.RELEASE_ENV: rel.version})


def world_pids(rel: n.Release) -> list[int]:
    """Processes in the world's own network namespace (its daemons; the nodes' are the cluster's)."""
    inode = ns_inode(rel.world_ns("net"))
    return pids_in_ns("net", inode) if inode and is_nsfs_mount(rel.world_ns("net")) else []


def world_ok(rel: n.Release) -> bool:
    """Both namespaces are bound and the release's Slurm is in place inside."""
    if not all(is_nsfs_mount(rel.world_ns(k)) for k in KINDS):
        return False
    probe = ["sh", "-c", f"grep -q ' {n.SLURM_LIB_DIR} ' /proc/self/mountinfo"]
    return ok(enter_argv(rel) + probe, timeout=10)


def setup_script(rel: n.Release, programs: list[str]) -> str:
    """The shell script, run once inside a new world, that binds the release's files in place.

    Copies of the 22.05 cluster's namespace mounts come along into the new mount namespace; they
    are dropped first so they do not keep its namespaces alive after its own `down`."""
    q = shlex.quote
    lines = ["set -e", "ip link set lo up",
             # The machine's login side has an eth0 (tests name it for mpirun's out-of-band
             # network); the world's gets one too, a veth whose peer is up, with an address of its own.
             f"ip link add {n.WORLD_IFACE} type veth peer name {n.WORLD_IFACE}-peer",
             f"ip addr add {n.WORLD_IFACE_ADDR} dev {n.WORLD_IFACE}",
             f"ip link set {n.WORLD_IFACE}-peer up", f"ip link set {n.WORLD_IFACE} up",
             "for m in $(findmnt -rn -o TARGET | grep -E '^(%s/|%s)' | sort -r); do umount -l \"$m\"; done"
             % (n.NETNS_DIR, n.NS_DIR)]
    for target, source in {**rel.bind_dirs(), **rel.bind_files()}.items():
        if target == n.NETNS_DIR:
            lines.append(f"mkdir -p {q(str(target))}")
        lines.append(f"mount --bind {q(str(source))} {q(str(target))}")
    lines.append(f"mount --bind {q(str(rel.root / n.TREE_LIB_DIR / 'slurm-wlm'))} {q(str(n.SLURM_LIB_DIR))}")
    for p in programs:
        # the machine's real file (its alternatives' links resolved): a mount covers that file
        lines.append(f"if [ -e {q(p)} ]; then mount --bind {q(str(in_tree(rel.root, p)))} \"$(readlink -f {q(p)})\"; fi")
    return "\n".join(lines) + "\n"


def _own_files(rel: n.Release) -> None:
    for d in rel.bind_dirs().values():
        d.mkdir(parents=True, exist_ok=True)
    # The world's /etc/hosts starts as the machine's without the 22.05 block (its own `up` adds
    # the same block to this copy); its resolver is the nodes' one, which fails at once.
    hosts_copy = rel.bind_files()[n.HOSTS_FILE]
    if not hosts_copy.exists():
        hosts_copy.write_text(hosts.without_block(n.HOSTS_FILE.read_text()))
    rel.bind_files()[Path("/etc/resolv.conf")].write_text(configs.resolv_conf())


def ensure_world(rel: n.Release, programs: list[str], actions: list[str]) -> None:
    """Create the world unless it is there and answers; the caller holds :func:`lock`."""
    if world_ok(rel):
        return
    remove_world(rel)
    _own_files(rel)
    rel.ns_dir.mkdir(parents=True, exist_ok=True)
    m = mount_of(rel.ns_dir)
    if m is None:
        run(["mount", "--bind", str(rel.ns_dir), str(rel.ns_dir)], what=f"bind-mounting {rel.ns_dir}")
        m = mount_of(rel.ns_dir)
    if m is None or "shared:" in m["optional"] or "master:" in m["optional"]:
        run(["mount", "--make-private", str(rel.ns_dir)], what=f"making {rel.ns_dir} a private mount")
    for k in KINDS:
        rel.world_ns(k).touch()
    # The namespace files keep the world alive with no process in it.
    run(["taskset", "-c", str(n.WORLD_CPU), "unshare", *(f"--{OPTION[k]}={rel.world_ns(k)}" for k in KINDS),
         "--propagation", "private", "--", "true"],
        what=f"creating the Slurm {rel.version} world (namespaces in {rel.ns_dir})", hint="needs root")
    try:
        run(enter_argv(rel) + ["sh", "-c", setup_script(rel, programs)],
            what=f"binding Slurm {rel.version}'s files inside its world")
    except DevClusterError:
        remove_world(rel)
        raise
    actions.append(f"created the Slurm {rel.version} world (network and mount namespaces in {rel.ns_dir})")


def remove_world(rel: n.Release) -> list[int]:
    """End the processes left in the world's network namespace and unbind its namespaces (its
    nodes' namespaces, bound only inside its mount namespace, go with it); PIDs still alive."""
    left = terminate(world_pids(rel), grace=10)
    for k in KINDS:
        f = rel.world_ns(k)
        while mount_of(f):
            if not ok(["umount", str(f)]):
                ok(["umount", "-l", str(f)])
                break
    return left


def run_inside(rel: n.Release, argv: list[str], timeout: float) -> int:
    """Run ``argv`` inside the world (output straight through); its exit status."""
    try:
        return subprocess.run(enter_argv(rel) + argv, env=world_env(rel), timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        raise DevClusterError(f"`{shlex.join(argv)}` inside the Slurm {rel.version} world did not finish "
                              f"within {timeout:.0f} s", hint=f"see the logs in {rel.home / 'log'}") from None


def cli_argv(*args: str) -> list[str]:
    """This hpcring's CLI with ``args``, as a command inside a world."""
    return [sys.executable, "-m", "hpcring", *args]


def prepare(rel: n.Release) -> list[str]:
    """Build the release's tree (once) and its world (when missing); what had to be done."""
    check_root()
    actions: list[str] = []
    with lock(rel):
        info = ensure_tree(rel, actions)
        ensure_world(rel, info["programs"], actions)
    return actions


def take_down(rel: n.Release) -> None:
    """After the cluster inside is down: end the world (every process left in it)."""
    check_root()
    with lock(rel):
        left = remove_world(rel)
    if left:
        raise DevClusterError(f"processes of the Slurm {rel.version} world still alive after SIGKILL: {left}",
                              hint="see `ps -o pid,cmd -p " + ",".join(map(str, left)) + "`")

"""Bridge, network namespaces, veth pairs and the per-node mount/UTS namespaces.

Each function checks before it acts, so running it again is cheap and repairs what is missing.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from hpcring.errors import DevClusterError

from . import configs, names as n
from .system import is_nsfs_mount, mount_of, ns_inode, ok, output, run


def _ip_json(args: list[str]) -> list[dict]:
    out = output(["ip", "-j", *args])
    if not out:
        return []
    try:
        return json.loads(out)
    except ValueError:
        return []


def root_links() -> dict[str, dict]:
    return {link["ifname"]: link for link in _ip_json(["-d", "link", "show"])}


def ns_addrs(i: int) -> dict[str, dict]:
    if not n.netns_path(i).exists():
        return {}
    return {link["ifname"]: link for link in _ip_json(["-n", n.netns_name(i), "addr", "show"])}


def _has_addr(link: dict | None, addr: str) -> bool:
    if not link:
        return False
    return any(
        a.get("family") == "inet" and a.get("local") == addr and a.get("prefixlen") == n.PREFIX_LEN
        for a in link.get("addr_info", [])
    )


def _is_up(link: dict | None) -> bool:
    return bool(link) and "UP" in link.get("flags", [])


# ---------------------------------------------------------------------------- bridge


def bridge_ok(links: dict[str, dict] | None = None) -> bool:
    links = root_links() if links is None else links
    br = links.get(n.BRIDGE)
    if not br or not _is_up(br):
        return False
    addrs = _ip_json(["addr", "show", "dev", n.BRIDGE])
    return bool(addrs) and _has_addr(addrs[0], n.BRIDGE_ADDR)


def ensure_bridge() -> None:
    links = root_links()
    if bridge_ok(links):
        return
    if n.BRIDGE not in links:
        run(["ip", "link", "add", n.BRIDGE, "type", "bridge", "forward_delay", "0", "stp_state", "0"],
            what=f"creating bridge {n.BRIDGE}")
    run(["ip", "addr", "replace", f"{n.BRIDGE_ADDR}/{n.PREFIX_LEN}", "dev", n.BRIDGE],
        what=f"giving {n.BRIDGE} the address {n.BRIDGE_ADDR}/{n.PREFIX_LEN}")
    run(["ip", "link", "set", n.BRIDGE, "up"], what=f"bringing {n.BRIDGE} up")


def remove_bridge() -> None:
    if n.BRIDGE in root_links():
        run(["ip", "link", "del", n.BRIDGE], what=f"deleting bridge {n.BRIDGE}", check=False)


# ---------------------------------------------------------------------------- network namespaces


def netns_ok(i: int) -> bool:
    return is_nsfs_mount(n.netns_path(i))


def ensure_netns(i: int) -> None:
    path = n.netns_path(i)
    if netns_ok(i):
        return
    if path.exists():  # a stale file left by a failed `ip netns add`
        if mount_of(path):
            run(["umount", "-l", str(path)], what=f"unmounting stale {path}", check=False)
        path.unlink(missing_ok=True)
    run(["ip", "netns", "add", n.netns_name(i)], what=f"creating network namespace {path}")


def remove_netns(i: int) -> None:
    path = n.netns_path(i)
    if path.exists():
        if not ok(["ip", "netns", "del", n.netns_name(i)]):
            if mount_of(path):
                ok(["umount", "-l", str(path)])
            path.unlink(missing_ok=True)


def existing_node_netns() -> list[int]:
    """Indices of /run/netns/node<i> namespaces (ours by name)."""
    try:
        entries = os.listdir(n.NETNS_DIR)
    except OSError:
        return []
    return sorted(int(e[4:]) for e in entries if re.fullmatch(r"node\d+", e))


def existing_our_links() -> list[str]:
    return [name for name in root_links() if re.fullmatch(r"hpc[vd]-node\d+", name)]


# ---------------------------------------------------------------------------- node links


def node_net_problems(i: int, dead_interface: bool, links: dict[str, dict] | None = None) -> list[str]:
    """What is wrong with node i's network ([] when all is as it should be)."""
    links = root_links() if links is None else links
    name = n.node_name(i)
    if not netns_ok(i):
        return [f"{name}: network namespace {n.netns_path(i)} missing"]
    problems = []
    inner = ns_addrs(i)
    veth = links.get(n.veth_root(i))
    if not veth or not _is_up(veth) or veth.get("master") != n.BRIDGE:
        problems.append(f"{name}: {n.veth_root(i)} missing, down or not on {n.BRIDGE}")
    if not _has_addr(inner.get(n.NODE_IFACE), n.node_addr(i)) or not _is_up(inner.get(n.NODE_IFACE)):
        problems.append(f"{name}: {n.NODE_IFACE} missing, down or without {n.node_addr(i)}")
    if not _is_up(inner.get("lo")):
        problems.append(f"{name}: lo down")
    routes = _ip_json(["-n", n.netns_name(i), "route", "show", "default"])
    if not any(r.get("gateway") == n.BRIDGE_ADDR for r in routes):
        problems.append(f"{name}: no default route via {n.BRIDGE_ADDR}")
    dead = links.get(n.dead_root(i))
    if dead_interface:
        if not _has_addr(inner.get(n.DEAD_IFACE), n.dead_addr(i)) or not _is_up(inner.get(n.DEAD_IFACE)):
            problems.append(f"{name}: {n.DEAD_IFACE} missing, down or without {n.dead_addr(i)}")
        if not dead or dead.get("master"):
            problems.append(f"{name}: {n.dead_root(i)} missing or bridged")
    elif dead or n.DEAD_IFACE in inner:
        problems.append(f"{name}: {n.DEAD_IFACE} present but not wanted")
    return problems


def _set_sysctl(path: str, value: str) -> None:
    try:
        Path(path).write_text(value)
    except OSError:
        pass


def ensure_node_net(i: int, dead_interface: bool) -> None:
    ensure_netns(i)
    links = root_links()
    if not node_net_problems(i, dead_interface, links):
        return
    ns = n.netns_name(i)
    inner = ns_addrs(i)
    veth, dead = n.veth_root(i), n.dead_root(i)
    where = f"node {n.node_name(i)} (netns {n.netns_path(i)})"

    # eth0 <-> hpcv-node<i> on the bridge: rebuild the pair when anything about it is off.
    veth_link = links.get(veth)
    eth0 = inner.get(n.NODE_IFACE)
    if not (veth_link and eth0 and veth_link.get("master") == n.BRIDGE and _is_up(veth_link)
            and _is_up(eth0) and _has_addr(eth0, n.node_addr(i))):
        if veth_link:
            run(["ip", "link", "del", veth], what=f"{where}: deleting {veth}", check=False)
        if n.NODE_IFACE in ns_addrs(i):
            run(["ip", "-n", ns, "link", "del", n.NODE_IFACE], what=f"{where}: deleting eth0", check=False)
        run(["ip", "link", "add", veth, "type", "veth", "peer", "name", n.NODE_IFACE, "netns", ns],
            what=f"{where}: creating veth pair {veth} <-> {n.NODE_IFACE}")
        run(["ip", "link", "set", veth, "master", n.BRIDGE], what=f"{where}: attaching {veth} to {n.BRIDGE}")
        run(["ip", "link", "set", veth, "up"], what=f"{where}: bringing {veth} up")
        run(["ip", "-n", ns, "addr", "add", f"{n.node_addr(i)}/{n.PREFIX_LEN}", "dev", n.NODE_IFACE],
            what=f"{where}: giving eth0 {n.node_addr(i)}")
        run(["ip", "-n", ns, "link", "set", n.NODE_IFACE, "up"], what=f"{where}: bringing eth0 up")
    run(["ip", "-n", ns, "link", "set", "lo", "up"], what=f"{where}: bringing lo up")
    run(["ip", "-n", ns, "route", "replace", "default", "via", n.BRIDGE_ADDR, "dev", n.NODE_IFACE],
        what=f"{where}: default route via {n.BRIDGE_ADDR}")

    # dead0 <-> hpcd-node<i>: the root end is up (so dead0 has carrier and looks healthy) but is on
    # no bridge, has no address and answers no ARP, so nothing sent over dead0 arrives anywhere.
    inner = ns_addrs(i)
    dead_link = links.get(dead)
    dead0 = inner.get(n.DEAD_IFACE)
    if dead_interface:
        if not (dead_link and not dead_link.get("master") and dead0 and _is_up(dead0)
                and _has_addr(dead0, n.dead_addr(i))):
            if dead_link:
                run(["ip", "link", "del", dead], what=f"{where}: deleting {dead}", check=False)
            if dead0:
                run(["ip", "-n", ns, "link", "del", n.DEAD_IFACE], what=f"{where}: deleting dead0", check=False)
            run(["ip", "link", "add", dead, "type", "veth", "peer", "name", n.DEAD_IFACE, "netns", ns],
                what=f"{where}: creating veth pair {dead} <-> {n.DEAD_IFACE}")
            _set_sysctl(f"/proc/sys/net/ipv6/conf/{dead}/disable_ipv6", "1")
            run(["ip", "link", "set", dead, "arp", "off", "up"], what=f"{where}: setting up {dead}")
            run(["ip", "-n", ns, "addr", "add", f"{n.dead_addr(i)}/{n.PREFIX_LEN}", "dev", n.DEAD_IFACE],
                what=f"{where}: giving dead0 {n.dead_addr(i)}")
            run(["ip", "-n", ns, "link", "set", n.DEAD_IFACE, "up"], what=f"{where}: bringing dead0 up")
    else:
        if dead_link:
            run(["ip", "link", "del", dead], what=f"{where}: deleting {dead}", check=False)
        if n.DEAD_IFACE in ns_addrs(i):
            run(["ip", "-n", ns, "link", "del", n.DEAD_IFACE], what=f"{where}: deleting dead0", check=False)

    left = node_net_problems(i, dead_interface)
    if left:
        raise DevClusterError(
            f"network of {n.node_name(i)} still wrong after repair: " + "; ".join(left),
            hint=f"inspect with `ip -n {ns} addr` and `ip -d link show {veth}`; "
            "`hpcring devcluster down` then `up` rebuilds everything",
        )


def remove_node_links(i: int) -> None:
    links = root_links()
    for name in (n.veth_root(i), n.dead_root(i)):
        if name in links:
            ok(["ip", "link", "del", name])


# ---------------------------------------------------------------------------- mount/UTS namespaces


def ensure_ns_dir() -> None:
    """NS_DIR must be a private mount for persistent mount namespaces to be bound there."""
    n.NS_DIR.mkdir(parents=True, exist_ok=True)
    m = mount_of(n.NS_DIR)
    if m is None:
        run(["mount", "--bind", str(n.NS_DIR), str(n.NS_DIR)], what=f"bind-mounting {n.NS_DIR}")
        m = mount_of(n.NS_DIR)
    if m is None or "shared:" in m["optional"] or "master:" in m["optional"]:
        run(["mount", "--make-private", str(n.NS_DIR)], what=f"making {n.NS_DIR} a private mount")


def node_ns_files_ok(i: int) -> bool:
    """Node i's mount and UTS namespaces are bound at their files (nsenter can enter them)."""
    return is_nsfs_mount(n.mnt_ns_file(i)) and is_nsfs_mount(n.uts_ns_file(i))


def node_ns_ok(i: int) -> bool:
    """Mount and UTS namespaces exist, /tmp in them is the node's own, hostname is the node name."""
    mnt, uts = n.mnt_ns_file(i), n.uts_ns_file(i)
    if not node_ns_files_ok(i):
        return False
    script = (f'test "$(hostname)" = {n.node_name(i)} && mountpoint -q /tmp && mountpoint -q /dev/shm '
              f'&& mountpoint -q {n.HOST_TMP_VIEW}')
    return ok(["nsenter", f"--mount={mnt}", f"--uts={uts}", "--", "sh", "-c", script], timeout=10)


def remove_node_ns(i: int) -> None:
    for f in (n.mnt_ns_file(i), n.uts_ns_file(i)):
        while mount_of(f):
            if not ok(["umount", str(f)]):
                ok(["umount", "-l", str(f)])
                break
        f.unlink(missing_ok=True)


def _world_cpu_pin() -> list[str]:
    """Inside a second release's world, new mount namespaces are made on the world's CPU.

    The kernel refuses to bind a mount namespace that does not look newer (by id) than the
    binder's own, and its ids are handed out per CPU: a node made on another CPU than the world
    got an older-looking id (all 10 tries failed with EINVAL on one CPU, none on the other)."""
    return ["taskset", "-c", str(n.WORLD_CPU)] if os.environ.get(n.WORLD_ENV) else []


def ensure_node_ns(i: int) -> bool:
    """Create node i's mount+UTS namespaces if needed; True when they were (re)created."""
    if node_ns_ok(i):
        return False
    remove_node_ns(i)
    ensure_ns_dir()
    tmp = n.node_tmp(i)
    tmp.mkdir(parents=True, exist_ok=True)
    os.chmod(tmp, 0o1777)
    mnt, uts = n.mnt_ns_file(i), n.uts_ns_file(i)
    mnt.touch()
    uts.touch()
    # Inside: the node's own /tmp (bind of a per-node dir), its own /dev/shm (fresh tmpfs), and
    # the node name as hostname. Everything else is the machine's filesystem, shared by all nodes.
    n.HOST_TMP_VIEW.mkdir(parents=True, exist_ok=True)
    # The machine's /tmp stays reachable inside the node at HOST_TMP_VIEW (before /tmp is covered),
    # so --share can expose a checkout under /tmp (CI clones there) at the same path in every node.
    script = (
        f"mount --bind /tmp {n.HOST_TMP_VIEW} && "
        f"mount --bind {tmp} /tmp && "
        "mount -t tmpfs -o mode=1777,size=2g,nosuid,nodev tmpfs-" + n.node_name(i) + " /dev/shm && "
        f"hostname {n.node_name(i)}"
    )
    try:
        run([*_world_cpu_pin(), "unshare", f"--mount={mnt}", f"--uts={uts}", "--propagation", "private",
             "--", "sh", "-c", script],
            what=f"creating mount/UTS namespaces of {n.node_name(i)} ({mnt}, {uts})",
            hint="needs root and util-linux >= 2.31 (unshare --mount=FILE)")
    except DevClusterError:
        remove_node_ns(i)
        raise
    if not node_ns_ok(i):
        remove_node_ns(i)
        raise DevClusterError(
            f"mount/UTS namespaces of {n.node_name(i)} were created but /tmp, /dev/shm or hostname "
            "inside them is not as expected",
            hint=f"try by hand: nsenter --mount={mnt} --uts={uts} -- sh -c 'hostname; findmnt /tmp'",
        )
    return True


def ensure_resolver(i: int) -> bool:
    """Bind the dev cluster's resolv.conf over /etc/resolv.conf in node i's mount namespace (True
    when it was bound now). Idempotent, and done in place: slurmd keeps running."""
    n.RESOLV_CONF.write_text(configs.resolv_conf())
    if not os.path.exists("/etc/resolv.conf"):
        return False          # glibc then asks 127.0.0.1 by itself: the same prompt failure
    script = (f"grep -qF '{n.RESOLV_MARKER}' /etc/resolv.conf || "
              f"{{ mount --bind '{n.RESOLV_CONF}' /etc/resolv.conf && echo bound; }}")
    proc = run(["nsenter", f"--mount={n.mnt_ns_file(i)}", "--", "sh", "-c", script],
               what=f"binding the node resolver into {n.node_name(i)}")
    return "bound" in proc.stdout.split()


def ensure_shares(i: int, paths: list[str]) -> list[str]:
    """Make each machine path under /tmp visible at the same path inside node i; returns those added.

    Real clusters share home and project directories between the login node and compute nodes;
    here everything but /tmp is shared already, so only paths under /tmp need this.
    """
    added = []
    for p in paths:
        real = os.path.realpath(p)
        if not real.startswith("/tmp/"):
            continue
        rel = real[len("/tmp/"):]
        src = f"{n.HOST_TMP_VIEW}/{rel}"
        # A share whose directory was deleted and re-created (a new clone) is re-bound. "bound" on
        # stdout tells a new bind from one already there, so a repeated `up` reports nothing.
        script = (f"mkdir -p '{real}' && if mountpoint -q '{real}' && "
                  f"[ \"$(stat -c %d:%i '{real}')\" != \"$(stat -c %d:%i '{src}')\" ]; then umount -l '{real}'; fi; "
                  f"mountpoint -q '{real}' || {{ mount --bind '{src}' '{real}' && echo bound; }}")
        proc = run(["nsenter", f"--mount={n.mnt_ns_file(i)}", "--", "sh", "-c", script],
                   what=f"sharing {real} with {n.node_name(i)}",
                   hint="the path must exist on this machine; shares apply to paths under /tmp only")
        if "bound" in proc.stdout.split():
            added.append(real)
    return added


def remove_node(i: int) -> None:
    """Remove node i's links, mount/UTS namespaces and network namespace (end its processes first)."""
    remove_node_links(i)
    remove_node_ns(i)
    remove_netns(i)


def exec_argv(i: int) -> list[str]:
    """argv prefix that runs a command inside node i (network, mount and UTS namespaces)."""
    return [
        "nsenter",
        f"--net={n.netns_path(i)}",
        f"--mount={n.mnt_ns_file(i)}",
        f"--uts={n.uts_ns_file(i)}",
        "--",
    ]


def ns_inodes(i: int) -> dict[str, int | None]:
    return {
        "net": ns_inode(n.netns_path(i)),
        "mnt": ns_inode(n.mnt_ns_file(i)),
        "uts": ns_inode(n.uts_ns_file(i)),
    }


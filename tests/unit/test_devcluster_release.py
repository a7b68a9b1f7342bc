"""The dev cluster's second Slurm release: the root tree, the world it runs in, the release choice."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hpcring.devcluster import hosts, names as n, system, tree, world
from hpcring.errors import DevClusterError


@pytest.fixture
def rel(tmp_path: Path) -> n.Release:
    return n.Release("24.11", "trixie", tmp_path / "home")


def test_release_choice_option_then_variable_then_machine(monkeypatch):
    monkeypatch.delenv(n.RELEASE_ENV, raising=False)
    assert world.chosen(None) == n.HOST_RELEASE == "22.05"
    monkeypatch.setenv(n.RELEASE_ENV, "24.11")
    assert world.chosen(None) == "24.11"
    assert world.chosen("22.05") == "22.05"  # the option wins over the variable


def test_runs_here_only_for_the_machine_release_or_the_world_we_are_in(monkeypatch):
    monkeypatch.delenv(n.WORLD_ENV, raising=False)
    assert world.runs_here("22.05")
    assert not world.runs_here("24.11")
    monkeypatch.setenv(n.WORLD_ENV, "24.11")
    assert world.runs_here("24.11")  # inside its world the commands act on it directly


def test_unknown_release_names_the_choices():
    with pytest.raises(DevClusterError) as e:
        world.release("23.02")
    assert "23.02" in str(e.value) and "22.05, 24.11" in (e.value.hint or "")
    assert world.release("24.11").suite == "trixie"


def test_cli_refuses_an_unknown_release_before_touching_anything(cli):
    for args in (["devcluster", "up", "--slurm", "25.05"], ["devcluster", "status", "--slurm", "25.05"],
                 ["devcluster", "down", "--slurm", "25.05"]):
        r = cli(*args, env={n.WORLD_ENV: None}, no_traceback=True)
        assert r.exit_code != 0, (args, r.output)
        assert "no dev cluster Slurm release '25.05'" in r.output, r.output


def test_login_without_a_command_is_a_usage_error(cli):
    r = cli("devcluster", "login", "--slurm", "24.11", "--", no_traceback=True)
    assert r.exit_code == 2 and ("Missing argument" in r.output or "no command given" in r.output), r.output


def test_in_tree_resolves_absolute_links_inside_the_tree(tmp_path):
    root = tmp_path / "root"
    (root / "usr/sbin").mkdir(parents=True)
    (root / "etc/alternatives").mkdir(parents=True)
    (root / "usr/sbin/slurmd-wlm").write_text("elf")
    os.symlink("/etc/alternatives/slurmd", root / "usr/sbin/slurmd")  # Debian's alternatives
    os.symlink("/usr/sbin/slurmd-wlm", root / "etc/alternatives/slurmd")
    os.symlink("slurmd-wlm", root / "usr/sbin/rel")
    assert tree.in_tree(root, "/usr/sbin/slurmd") == root / "usr/sbin/slurmd-wlm"
    assert tree.in_tree(root, "/usr/sbin/rel") == root / "usr/sbin/slurmd-wlm"
    assert tree.in_tree(root, "/usr/sbin/slurmd-wlm") == root / "usr/sbin/slurmd-wlm"
    os.symlink("/usr/sbin/loop", root / "usr/sbin/loop")
    with pytest.raises(DevClusterError, match="too many symbolic links"):
        tree.in_tree(root, "/usr/sbin/loop")


def test_programs_from_listing_keeps_only_programs():
    listing = "\n".join(["/.", "/usr", "/usr/bin", "/usr/bin/srun", "/usr/bin/sinfo", "/usr/sbin/slurmd-wlm",
                         "/usr/share/doc/slurm-client/copyright", "/usr/bin/srun", "/usr/lib/x86_64-linux-gnu/x.so"])
    assert tree.programs_from_listing(listing) == ["/usr/bin/sinfo", "/usr/bin/srun", "/usr/sbin/slurmd-wlm"]


def test_patchelf_points_programs_at_the_trees_loader_and_libraries(rel):
    argv = tree.patchelf_argv(rel, "/usr/sbin/slurmd-wlm")
    assert argv[:3] == ["chroot", str(rel.root), "patchelf"]
    assert argv[argv.index("--set-interpreter") + 1] == str(rel.root / n.TREE_LOADER)
    assert "--force-rpath" in argv  # DT_RPATH also serves the plugins Slurm dlopens
    lib = rel.root / n.TREE_LIB_DIR
    assert argv[argv.index("--set-rpath") + 1] == f"{lib}/slurm-wlm:{lib}"


def test_tree_marker_needs_the_release_version_and_programs(rel):
    assert tree.tree_info(rel) is None
    rel.root.mkdir(parents=True)
    rel.tree_marker.write_text(json.dumps({"version": "22.05.8", "programs": []}))
    assert tree.tree_info(rel) is None  # a tree of another release is not this one's
    rel.tree_marker.write_text("{not json")
    assert tree.tree_info(rel) is None
    rel.tree_marker.write_text(json.dumps({"version": "24.11.5", "programs": ["/usr/bin/srun"]}))
    assert tree.tree_info(rel) == {"version": "24.11.5", "programs": ["/usr/bin/srun"]}


def test_complete_tree_is_reused_without_debootstrap(rel, monkeypatch):
    rel.root.mkdir(parents=True)
    rel.tree_marker.write_text(json.dumps({"version": "24.11.5", "programs": []}))
    monkeypatch.setattr(tree, "run", lambda *a, **k: pytest.fail("a complete tree must not be rebuilt"))
    actions: list[str] = []
    assert tree.ensure_tree(rel, actions)["version"] == "24.11.5" and actions == []


def test_missing_debootstrap_is_a_clear_error(rel, monkeypatch):
    monkeypatch.setattr(tree.shutil, "which", lambda name: None)
    with pytest.raises(DevClusterError) as e:
        tree.ensure_tree(rel, [])
    assert "debootstrap is not installed" in str(e.value) and "apt-get install debootstrap" in e.value.hint
    assert not rel.root.exists()


def test_failed_debootstrap_names_the_mirror_and_leaves_no_marker(rel, monkeypatch):
    monkeypatch.setattr(tree.shutil, "which", lambda name: "/bin/false")
    with pytest.raises(DevClusterError) as e:
        tree.ensure_tree(rel, [])
    assert "debootstrap" in str(e.value) and n.DEBIAN_MIRROR in e.value.hint
    assert tree.tree_info(rel) is None


def test_world_setup_binds_every_own_path_and_drops_the_other_clusters_namespaces(rel):
    script = world.setup_script(rel, ["/usr/bin/srun", "/usr/sbin/slurmd"])
    lines = script.splitlines()
    assert lines[0] == "set -e" and "ip link set lo up" in lines
    assert f"ip addr add {n.WORLD_IFACE_ADDR} dev eth0" in lines  # a login side with an eth0, as here
    drop = next(i for i, line in enumerate(lines) if "umount -l" in line)
    first_bind = next(i for i, line in enumerate(lines) if line.startswith("mount --bind"))
    assert drop < first_bind  # the copies go before the binds cover their paths
    for target, source in {**rel.bind_dirs(), **rel.bind_files()}.items():
        assert f"mount --bind {source} {target}" in lines
    assert f"mount --bind {rel.root / n.TREE_LIB_DIR / 'slurm-wlm'} {n.SLURM_LIB_DIR}" in lines
    assert any(str(rel.root / "usr/bin/srun") in line and "readlink -f /usr/bin/srun" in line for line in lines)
    # every fixed path the cluster writes is its own inside the world
    for path in (n.STATE_DIR, n.LOG_DIR, n.SLURM_CONF_DIR, n.MUNGE_KEY.parent, n.MUNGE_RUN_DIR, n.NETNS_DIR, n.SHARED_DIR,
                 n.HOSTS_FILE):
        assert path in {**rel.bind_dirs(), **rel.bind_files()}


def test_enter_argv_keeps_the_working_directory(rel, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = world.enter_argv(rel)
    assert argv[0] == "nsenter" and argv[-1] == "--"
    assert f"--net={rel.world_ns('net')}" in argv and f"--mount={rel.world_ns('mnt')}" in argv
    assert f"--wd={tmp_path}" in argv


def test_status_of_a_world_that_is_not_there(cli, monkeypatch, tmp_path):
    monkeypatch.setitem(n.RELEASES, "24.11", n.Release("24.11", "trixie", tmp_path / "none"))
    r = cli("devcluster", "status", "--slurm", "24.11", "--json", env={n.WORLD_ENV: None})
    assert r.exit_code == 1
    st = json.loads(r.output)
    assert st["state"] == "down" and st["release"] == "24.11" and "up --slurm 24.11" in st["problems"][0]


def test_hosts_without_block_keeps_the_rest():
    text = f"127.0.0.1 localhost\n{n.HOSTS_BEGIN}\n10.99.0.1\tnode1\n{n.HOSTS_END}\n::1 localhost\n"
    assert hosts.without_block(text) == "127.0.0.1 localhost\n::1 localhost\n"


def test_processes_are_ours_only_in_our_network_namespaces(monkeypatch, tmp_path):
    monkeypatch.setattr(system, "NETNS_DIR", tmp_path / "netns")  # no node namespaces
    own = system.ns_inode("/proc/self/ns/net")
    assert system.our_net_inodes() == {own}
    monkeypatch.setattr(system, "all_pids", lambda: [os.getpid(), os.getppid()])
    monkeypatch.setattr(system, "pid_is", lambda pid, names: True)
    inodes = {os.getppid(): own}
    monkeypatch.setattr(system, "ns_inode", lambda p: inodes.get(int(p.split("/")[2])) if p.startswith("/proc/")
                        and p.split("/")[2].isdigit() else own)
    assert system.pids_by_exe(["slurmd"]) == [os.getppid()]
    inodes[os.getppid()] = own + 1  # the same program in another cluster's network namespace
    assert system.pids_by_exe(["slurmd"]) == []


def test_pmix_path_is_replaced_by_a_link_of_the_same_length(tmp_path, monkeypatch):
    rel = n.Release("24.11", "trixie", tmp_path / "h")
    machine_pmix = "/usr/lib/" + "p" * (len(str(rel.home)) + 3 - len("/usr/lib/"))
    monkeypatch.setattr(n, "PMIX_LIB_DIR", Path(machine_pmix))
    assert len(str(rel.pmix_link)) == len(machine_pmix)
    plugin = rel.root / n.TREE_LIB_DIR / "slurm-wlm" / "mpi_pmix_v5.so"
    tree_pmix = rel.root / machine_pmix.lstrip("/")
    libpmix = tree_pmix / "libpmix.so.2.13.7"
    for f in (plugin, libpmix):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"\0ELF" + machine_pmix.encode() + b"\0" + machine_pmix.encode() + b"/pmix\0")
    (tree_pmix / "libpmix.so.2").symlink_to("libpmix.so.2.13.7")
    assert sorted(tree.relocate_pmix(rel)) == sorted([plugin, libpmix])
    for f in (plugin, libpmix):
        data = f.read_bytes()
        assert machine_pmix.encode() not in data and data.count(str(rel.pmix_link).encode()) == 2
    assert rel.pmix_link.resolve() == tree_pmix.resolve()
    assert tree.relocate_pmix(rel) == []  # a second run finds nothing left to change


def test_pmix_link_too_long_is_a_clear_error(tmp_path):
    rel = n.Release("24.11", "trixie", tmp_path / ("long" * 20))
    with pytest.raises(DevClusterError, match="too long for the PMIx path"):
        tree.relocate_pmix(rel)

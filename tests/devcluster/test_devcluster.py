"""Integration tests against the running dev cluster (`hpcring devcluster up`, as root).

They never bring the cluster up or down; when it is down they are skipped.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest


SHARED = Path("/srv/hpcring")


def _status() -> dict:
    try:
        from hpcring.devcluster import cluster
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"hpcring.devcluster not importable: {e}")
    return cluster.status()


@pytest.fixture(scope="module")
def cluster_status() -> dict:
    if os.geteuid() != 0:
        pytest.skip("dev cluster tests need root (they enter node namespaces)")
    if shutil.which("srun") is None:
        pytest.skip("Slurm client commands not installed (scripts/install-system-deps.sh)")
    st = _status()
    if st["state"] == "down":
        pytest.skip("dev cluster is down: start it with `hpcring devcluster up` (as root)")
    return st


@pytest.fixture(autouse=True)
def _require_cluster(cluster_status: dict) -> None:
    """Every test here needs the cluster; skipped (with the reason above) when it is down."""


@pytest.fixture(scope="module")
def nnodes(cluster_status: dict) -> int:
    return int(cluster_status["nodes_configured"])


@pytest.fixture()
def need3(nnodes: int) -> None:
    if nnodes < 3:
        pytest.skip(f"needs a 3-node dev cluster, this one has {nnodes}")


@pytest.fixture()
def shared_dir():
    d = SHARED / f"test-devcluster-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run(argv: list[str], timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    if check:
        assert p.returncode == 0, f"{argv} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def srun(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    return run(["srun", "--time=2", *args], timeout=timeout, check=check)


def exec_in(node: str, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    from hpcring.devcluster.cluster import node_exec_argv

    return run(node_exec_argv(node) + argv, timeout=timeout, check=False)


# ---------------------------------------------------------------------------------------------


def test_status_reports_up(cluster_status: dict) -> None:
    assert cluster_status["state"] == "up", f"cluster degraded: {cluster_status['problems']}"
    assert all(r["slurmd_alive"] for r in cluster_status["nodes"])


def test_sinfo_shows_all_nodes_idle(nnodes: int) -> None:
    deadline = time.monotonic() + 90   # jobs of earlier tests may still be completing
    while True:
        out = run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %T"]).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        assert sorted(states) == sorted(f"node{i}" for i in range(1, nnodes + 1)), out
        if set(states.values()) == {"idle"} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert set(states.values()) == {"idle"}, out


def test_srun_hostname_once_per_node(need3: None) -> None:
    out = srun("-N3", "--ntasks-per-node=1", "hostname").stdout
    assert sorted(out.split()) == ["node1", "node2", "node3"], out


def test_each_task_has_its_own_address(need3: None) -> None:
    script = 'echo "$(hostname) $SLURM_NODEID $(ip -4 -o addr show dev eth0 | awk \'{print $4}\')"'
    out = srun("-N3", "--ntasks-per-node=1", "sh", "-c", script).stdout
    rows = sorted(line.split() for line in out.splitlines() if line.strip())
    assert len(rows) == 3, out
    for host, _nodeid, addr in rows:
        i = int(host.removeprefix("node"))
        assert addr == f"10.99.0.{i}/24", f"{host} has eth0 {addr}"
    assert len({addr for _, _, addr in rows}) == 3


def test_private_tmp_per_node(nnodes: int) -> None:
    if nnodes < 2:
        pytest.skip("needs at least 2 nodes")
    name = f"/tmp/hpcring-devcluster-test-{uuid.uuid4().hex}"
    try:
        srun("-N1", "-w", "node1", "sh", "-c", f"echo node1 > {name}")
        on_node1 = srun("-N1", "-w", "node1", "cat", name, check=False)
        on_node2 = srun("-N1", "-w", "node2", "test", "-e", name, check=False)
        assert on_node1.returncode == 0 and on_node1.stdout.strip() == "node1", on_node1.stderr
        assert on_node2.returncode != 0, f"{name} written on node1 is visible on node2"
        assert not Path(name).exists(), f"{name} written on node1 is visible in the root namespace /tmp"
    finally:
        srun("-N1", "-w", "node1", "rm", "-f", name, check=False)


def test_shared_dir_visible_on_all_nodes(nnodes: int, shared_dir: Path) -> None:
    out = srun(f"-N{nnodes}", "--ntasks-per-node=1", "sh", "-c",
               f'touch {shared_dir}/$(hostname) && ls {shared_dir} | wc -l').stdout
    assert sorted(p.name for p in shared_dir.iterdir()) == sorted(f"node{i}" for i in range(1, nnodes + 1))
    assert out.split()[-1] != "0"


def test_sbatch_job_completed_in_sacct(shared_dir: Path) -> None:
    job_id = run(["sbatch", "--parsable", "--time=2", "-o", str(shared_dir / "out-%j.txt"),
                  "--wrap", "hostname; echo done"]).stdout.strip().split(";")[0]
    assert job_id.isdigit(), job_id
    state = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State"], check=False).stdout.strip()
        state = out.splitlines()[0] if out else ""
        if state and state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
            break
        time.sleep(1)
    assert state == "COMPLETED", f"job {job_id} state in sacct: {state!r}"
    text = (shared_dir / f"out-{job_id}.txt").read_text()
    assert text.split()[-1] == "done" and text.split()[0].startswith("node"), text


def test_srun_mpi_pmix_trivial(nnodes: int) -> None:
    if nnodes < 2:
        pytest.skip("needs at least 2 nodes")
    out = srun("--mpi=pmix", "-N2", "-n2", "sh", "-c", 'echo "$(hostname) $PMIX_RANK"').stdout
    rows = sorted(line.split() for line in out.splitlines() if line.strip())
    assert [r[1] for r in rows] == ["0", "1"], out
    assert len({r[0] for r in rows}) == 2, f"both ranks on one node: {out}"


def test_srun_mpi_pmix_open_mpi_allreduce(nnodes: int, shared_dir: Path) -> None:
    """A real Open MPI program wired up through Slurm's PMIx plugin across two nodes."""
    if nnodes < 2:
        pytest.skip("needs at least 2 nodes")
    if shutil.which("mpicc") is None:
        pytest.skip("mpicc not installed (libopenmpi-dev)")
    src = shared_dir / "hello.c"
    src.write_text(
        "#include <mpi.h>\n#include <stdio.h>\n"
        "int main(int c, char **v) { int r, s, x, sum = 0; MPI_Init(&c, &v);\n"
        "  MPI_Comm_rank(MPI_COMM_WORLD, &r); MPI_Comm_size(MPI_COMM_WORLD, &s); x = r + 1;\n"
        "  MPI_Allreduce(&x, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);\n"
        '  printf("rank %d size %d sum %d\\n", r, s, sum); MPI_Finalize(); return 0; }\n'
    )
    run(["mpicc", "-o", str(shared_dir / "hello"), str(src)])
    # dead0 routes nowhere: Open MPI must be told which network to use (that is what dead0 is for).
    env = dict(os.environ, OMPI_MCA_btl_tcp_if_include="10.99.0.0/24",
               OMPI_MCA_oob_tcp_if_include="10.99.0.0/24", OMPI_MCA_btl="self,tcp")
    p = run(["srun", "--time=2", "--mpi=pmix", "-N2", "-n2", str(shared_dir / "hello")],
            timeout=90, env=env)
    assert sorted(p.stdout.splitlines()) == ["rank 0 size 2 sum 3", "rank 1 size 2 sum 3"], p.stdout


def test_exec_enters_node_namespaces(nnodes: int) -> None:
    for i in range(1, nnodes + 1):
        p = exec_in(f"node{i}", ["sh", "-c", "hostname; ip -4 -o addr show dev eth0"])
        assert p.returncode == 0, p.stderr
        lines = p.stdout.splitlines()
        assert lines[0] == f"node{i}"
        assert f"10.99.0.{i}/24" in lines[1]


CONNECT = r"""
import socket, sys
addr, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((addr, port), timeout=4).close()
except OSError as e:
    print(f"FAIL {e!r}")
else:
    print("OK")
"""


def test_dead_interface_routes_nowhere(cluster_status: dict, nnodes: int) -> None:
    if nnodes < 2:
        pytest.skip("needs at least 2 nodes")
    if not cluster_status["dead_interface"]:
        pytest.skip("cluster brought up with --no-dead-interface")
    for i in range(1, nnodes + 1):
        j = i % nnodes + 1  # another node; its slurmd listens on all its addresses (port 6818)
        dead = exec_in(f"node{i}", ["ip", "-o", "link", "show", "dev", "dead0"])
        assert dead.returncode == 0 and "UP" in dead.stdout, f"node{i} dead0 not up: {dead.stdout}{dead.stderr}"
        good = exec_in(f"node{i}", [sys.executable, "-c", CONNECT, f"10.99.0.{j}", "6818"])
        bad = exec_in(f"node{i}", [sys.executable, "-c", CONNECT, f"10.98.0.{j}", "6818"])
        assert good.stdout.strip() == "OK", f"node{i} -> node{j} over eth0: {good.stdout}{good.stderr}"
        assert bad.stdout.startswith("FAIL"), f"node{i} -> node{j} over dead0 did not fail: {bad.stdout}{bad.stderr}"


_LOOKUPS = r"""
import json, socket, sys, time
out = []
for kind, what in json.loads(sys.argv[1]):
    t = time.monotonic()
    try:
        if kind == "rev":
            sa = (what, 0, 0, 0) if ":" in what else (what, 0)
            got = socket.getnameinfo(sa, socket.NI_NAMEREQD)[0]
        else:
            got = socket.getaddrinfo(what, None, socket.AF_INET)[0][4][0]
    except OSError as e:
        got = "ERR " + str(e)
    out.append([kind, what, got, time.monotonic() - t])
print(json.dumps(out))
"""


def test_every_address_resolves_at_once_and_unknown_names_fail_at_once(cluster_status: dict, nnodes: int) -> None:
    """Forward and reverse lookups of every address the dev cluster creates (nodes, the machine's
    bridge end, the dead0 fault addresses) answer from every node and from the machine well under
    a second; an unknown name fails at once inside a node (it used to wait 10 s on a nameserver
    no namespace can reach, and torch's rendezvous waited with it)."""
    import json

    from hpcring.devcluster import names as n
    want = {n.node_addr(i): n.node_name(i) for i in range(1, nnodes + 1)}
    want[n.BRIDGE_ADDR] = n.BRIDGE_HOSTNAME
    if cluster_status.get("dead_interface", True):
        want.update({n.dead_addr(i): n.dead_name(i) for i in range(1, nnodes + 1)})
    # ::ffff:a.b.c.d is how a dual-stack listener (torch's store) sees each of them
    queries = [["rev", a] for a in want] + [["rev", "::ffff:" + a] for a in want]
    queries += [["fwd", name] for name in want.values()]
    bound = 2.0                       # generous for a loaded 2-core host; the stall was 10 s
    places = [("the machine", [sys.executable, "-c", _LOOKUPS])]
    places += [(f"node{i}", ["python3", "-c", _LOOKUPS]) for i in range(1, nnodes + 1)]
    for where, argv in places:
        q = queries + ([["fwd", "no-such-host-hpcring.invalid"]] if where != "the machine" else [])
        argv = argv + [json.dumps(q)]
        r = run(argv, timeout=60, check=False) if where == "the machine" else exec_in(where, argv, timeout=60)
        assert r.returncode == 0, r.stderr
        for kind, what, got, took in json.loads(r.stdout):
            assert took < bound, f"{where}: {kind} lookup of {what} took {took:.1f} s ({got})"
            if what == "no-such-host-hpcring.invalid":
                assert got.startswith("ERR"), got
            elif kind == "rev":
                assert got == want[what.removeprefix("::ffff:")], (where, what, got)
            else:
                assert {v: k for k, v in want.items()}[what] == got, (where, what, got)

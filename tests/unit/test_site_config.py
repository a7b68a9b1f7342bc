"""Site-config validation: every error class is reported with file, line and key path."""
from pathlib import Path

import pytest

from hpcring.config.fabric import fabric_env
from hpcring.config.site import available_sites, load_site, parse_site_file, resolve_site_ref
from hpcring.errors import ConfigError, SiteNotFoundError

GOOD = """\
name: t
scheduler: slurm
partitions:
  gpu: {max_time: "01:00:00", max_nodes: 4, gpus_per_node: 4}
defaults:
  partition: gpu
launcher:
  kind: srun
  mpi: pmix
fabric:
  kind: infiniband
  bootstrap_interfaces: ["=ib0"]
  hcas: ["mlx5_0:1", "mlx5_1:1"]
"""


def problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_site_file(path)
    return ei.value.problems


def test_good_config_parses(site_file):
    cfg = parse_site_file(site_file(GOOD))
    assert cfg.partitions["gpu"].max_nodes == 4
    assert cfg.launcher.mpi == "pmix"


def test_unknown_key_with_did_you_mean_and_line(site_file):
    p = site_file(GOOD.replace("  mpi: pmix", "  mpi: pmix\n  agrs: [x]"))
    (msg,) = problems(p)
    assert f"{p}:10 launcher.agrs" in msg
    assert "did you mean 'args'" in msg


def test_unknown_key_in_partition_mapping(site_file):
    p = site_file(GOOD.replace("max_nodes: 4", "max_node: 4"))
    (msg,) = problems(p)
    assert "partitions.gpu.max_node" in msg and "did you mean 'max_nodes'" in msg and ":4 " in msg


def test_wrong_type(site_file):
    p = site_file(GOOD.replace("max_nodes: 4", "max_nodes: many"))
    (msg,) = problems(p)
    assert "partitions.gpu.max_nodes" in msg and "'many'" in msg


def test_wrong_enum_value(site_file):
    p = site_file(GOOD.replace("kind: srun", "kind: sbatch"))
    (msg,) = problems(p)
    assert f"{p}:8 launcher.kind" in msg and "sbatch" in msg


def test_missing_required_key(site_file):
    p = site_file(GOOD.replace("scheduler: slurm\n", ""))
    assert any("scheduler: required key is missing" in m for m in problems(p))


def test_roce_without_gid_index_is_impossible(site_file):
    p = site_file(GOOD.replace("kind: infiniband", "kind: roce"))
    (msg,) = problems(p)
    assert "fabric.gid_index" in msg and "RoCE needs a GID index" in msg


def test_every_problem_reported_at_once(site_file):
    text = GOOD.replace("kind: srun", "kind: sbatch").replace("max_nodes: 4", "max_nodes: -1") \
        .replace("name: t\n", "name: t\ncolour: blue\n")
    msgs = problems(site_file(text))
    assert len(msgs) == 3
    assert any("colour" in m for m in msgs) and any("launcher.kind" in m for m in msgs) \
        and any("max_nodes" in m for m in msgs)


def test_cross_field_rules(site_file):
    text = GOOD.replace("partition: gpu", "partition: gpus").replace("  mpi: pmix", "  mpi: pmix") \
        .replace("kind: srun", "kind: jsrun")
    msgs = problems(site_file(text))
    joined = "\n".join(msgs)
    assert "defaults.partition" in joined and "did you mean 'gpu'" in joined
    assert "launcher.kind" in joined and "does not run under scheduler 'slurm'" in joined
    assert "launcher.mpi" in joined


def test_bad_hca_and_tcp_with_hcas(site_file):
    msgs = problems(site_file(GOOD.replace("kind: infiniband", "kind: tcp").replace('"mlx5_1:1"', '"mlx5 1"')))
    joined = "\n".join(msgs)
    assert "fabric.hcas" in joined and "mlx5 1" in joined


def test_yaml_syntax_error_names_line(site_file):
    p = site_file("name: t\nscheduler: [slurm\n")
    with pytest.raises(ConfigError) as ei:
        parse_site_file(p)
    assert str(p) in str(ei.value) and "not valid YAML" in str(ei.value)


def test_not_a_mapping(site_file):
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_site_file(site_file("- a\n- b\n"))


def test_bundled_sites_all_valid():
    names = {n for n, _, origin in available_sites() if origin == "bundled"}
    assert {"local", "devcluster", "slurm-infiniband", "slurm-roce", "slurm-tcp", "lsf-summit"} <= names
    for n in names:
        load_site(n)


def test_lookup_precedence(tmp_path, monkeypatch):
    user = tmp_path / "sites"
    user.mkdir()
    (user / "devcluster.yaml").write_text("name: mine\nscheduler: local\nlauncher: {kind: local}\n")
    monkeypatch.setenv("HPCRING_SITE_DIRS", str(user))
    assert load_site("devcluster").config.name == "mine"          # user dir shadows bundled
    assert load_site("slurm-tcp").origin == "bundled"
    monkeypatch.setenv("HPCRING_SITE", "slurm-roce")
    assert load_site(None).name == "slurm-roce"                   # environment when no flag
    assert load_site("local").name == "local"                     # flag beats environment


def test_unknown_site_suggests(monkeypatch):
    with pytest.raises(SiteNotFoundError, match="did you mean 'devcluster'"):
        resolve_site_ref("devclustr")
    with pytest.raises(SiteNotFoundError, match="does not exist"):
        resolve_site_ref("/nonexistent/site.yaml")


@pytest.mark.parametrize("name,expected", [
    ("slurm-infiniband", {"NCCL_SOCKET_IFNAME": "=ib0", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1",
                          "GLOO_SOCKET_IFNAME": "ib0", "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1",
                          "OMPI_MCA_oob_tcp_if_include": "ib0"}),
    ("slurm-roce", {"NCCL_IB_GID_INDEX": "3", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_3:1",
                    "OMPI_MCA_btl_tcp_if_include": "bond0"}),
    ("slurm-tcp", {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "^docker,lo,virbr"}),
])
def test_fabric_env(name, expected):
    env = fabric_env(load_site(name).config.fabric)
    for k, v in expected.items():
        assert env[k] == v, k
    if name == "slurm-tcp":  # an exclude list names no interface Gloo/Open MPI could use
        assert "GLOO_SOCKET_IFNAME" not in env and "OMPI_MCA_btl_tcp_if_include" not in env
        assert "NCCL_IB_HCA" not in env
    if name != "slurm-roce":
        assert "NCCL_IB_GID_INDEX" not in env
    assert not any(k.startswith("HPCRING_RING_") for k in env)      # unset: the ring's defaults


def test_fabric_ring_keys_become_env_and_are_checked():
    from hpcring.config.schema import Fabric
    env = fabric_env(Fabric(kind="tcp", ring_streams=4, ring_threads=2, ring_shm=False))
    assert (env["HPCRING_RING_STREAMS"], env["HPCRING_RING_THREADS"], env["HPCRING_RING_SHM"]) == ("4", "2", "0")
    with pytest.raises(ValueError, match="ring_streams"):
        Fabric(kind="tcp", ring_streams=0)

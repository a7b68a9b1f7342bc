"""Precedence CLI > environment > site > defaults, and limits checked before the scheduler."""
import pytest

from hpcring.config.jobspec import resolve_job
from hpcring.config.site import load_site
from hpcring.errors import UsageError


def test_precedence_cli_env_site_default():
    site = load_site("slurm-infiniband")
    env = {"HPCRING_PARTITION": "gpu-debug", "HPCRING_TIME": "00:20:00", "HPCRING_NODES": "2"}
    job = resolve_job(site, "train.py", [], {"nodes": 1}, environ=env)
    assert (job.nodes, job.sources["nodes"]) == (1, "cli")
    assert (job.partition, job.sources["partition"]) == ("gpu-debug", "env HPCRING_PARTITION")
    assert (job.time_min, job.sources["time"]) == (20, "env HPCRING_TIME")
    assert (job.cpus_per_task, job.sources["cpus_per_task"]) == (16, "site slurm-infiniband")
    assert job.qos == "debug"                              # from the chosen partition
    assert job.tasks_per_node == 4 and job.gpus_per_node == 4  # one rank per GPU by default
    assert job.sources["constraint"] == "default"


@pytest.mark.parametrize("cli,msg", [
    ({"nodes": 65}, "exceeds partition 'gpu' max_nodes 64"),
    ({"time": "3-00:00:00"}, "exceeds partition 'gpu' max_time"),
    ({"gpus_per_node": 8}, "has 4 GPUs per node"),
    ({"partition": "gpux"}, "partition 'gpux'"),
    ({"nodes": "two"}, "--nodes: nodes must be a whole number"),
    ({"nodes": 0}, "at least 1"),
    ({"time": "1:2:3:4"}, "not a time"),
    ({"tasks_per_node": 8, "cpus_per_task": 16}, "need 128 CPUs per node"),
])
def test_limits_and_bad_values(cli, msg):
    with pytest.raises(UsageError, match=msg.replace("(", r"\(").replace("'", "'")):
        resolve_job(load_site("slurm-infiniband"), "t.py", [], cli, environ={})


def test_bad_environment_value_names_variable():
    with pytest.raises(UsageError, match=r"\$HPCRING_NODES"):
        resolve_job(load_site("local"), "t.py", [], {}, environ={"HPCRING_NODES": "x"})


@pytest.mark.parametrize("text,minutes", [("30", 30), ("90", 90), ("01:30:00", 90), ("1-00:00:00", 1440),
                                          ("10:30", 11), ("0:00:30", 1)])
def test_time_formats(text, minutes):
    job = resolve_job(load_site("local"), "t.py", [], {"time": text}, environ={})
    assert job.time_min == minutes

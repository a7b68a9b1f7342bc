"""A Hydra app whose multirun points run as hpcring jobs, every point on all the ranks of its job.

    python examples/hydra_app/app.py -m x=1,2,3,4                       # 4 jobs, 2 ranks each, 2 at once
    python examples/hydra_app/app.py -m x=1,2,3,4 hydra.launcher.site=devcluster hydra.launcher.nodes=2
    python examples/hydra_app/app.py -m x=1,2,3,4 fail_on=3             # point x=3 fails; the others finish
    hpcring run --tasks-per-node 2 -- python examples/hydra_app/app.py x=2   # one run (no -m): here, 2 ranks

conf/config.yaml picks the launcher (`hydra/launcher=hpcring`) and sets its keys. Each rank
allreduces ``x * (rank + 1)`` through hpcring's communicator; rank 0 writes ``result.json`` into
the point's output directory and the task returns the sum, which Hydra gets back as the point's
JobReturn. Without ``-m`` Hydra runs the task in this process, which is no job: start it on
ranks with ``hpcring run`` (else ``hpcring.init()`` says it has no per-job secret). See
docs/python-api.md (Hydra).
"""
import json
import logging
import time

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import hpcring

log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    session = hpcring.init()            # the point's job is bootstrapped already: its session
    started = time.time()
    time.sleep(cfg.sleep)
    if cfg.fail_on is not None and cfg.x == cfg.fail_on and session.rank == session.size - 1:
        raise ValueError(f"x={cfg.x} is refused on rank {session.rank}")
    total = float(session.communicator().allreduce(np.array([cfg.x * (session.rank + 1)], dtype=np.float64))[0])
    log.info("x=%s: rank %d of %d on %s: sum %g", cfg.x, session.rank, session.size, session.host, total)
    if session.rank == 0:
        hydra_cfg = HydraConfig.get()
        out = {"x": cfg.x, "sum": total, "size": session.size, "host": session.host,
               "job_id": OmegaConf.select(hydra_cfg, "job.id", default=None),    # a multirun's: hpcring's job id
               "num": OmegaConf.select(hydra_cfg, "job.num", default=None), "started": started, "ended": time.time()}
        with open(f"{hydra_cfg.runtime.output_dir}/result.json", "w") as fh:
            json.dump(out, fh)
    return total


if __name__ == "__main__":
    main()

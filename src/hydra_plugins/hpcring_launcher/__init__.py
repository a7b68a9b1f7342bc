"""Hydra launcher plugin ``hydra/launcher=hpcring``: each point of a multirun is an hpcring job
(all its nodes and ranks), the sweep one job array submitted through ``hpcring.Executor``.

``config.py``: the structured config (its keys from hpcring's option table), registered in
Hydra's ConfigStore; ``hpcring_launcher.py``: the Launcher. See docs/python-api.md (Hydra) and
examples/hydra_app/.
"""

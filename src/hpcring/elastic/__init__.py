"""Elastic training: a job whose workers may die or join while it runs (Horovod Elastic's model).

The pieces, framework-free (``hpcring.torch.elastic`` puts Horovod's API on them):

* :mod:`~hpcring.elastic.driver`: serves the rendezvous store outside every worker and starts
  workers locally (``python -m hpcring.elastic.driver --np 3 --min-np 2 -- python train.py``);
* :mod:`~hpcring.elastic.coordinator` and :mod:`~hpcring.elastic.membership`: who is in each
  round (rank order, min/max, newcomers, deaths, the reset limit);
* :mod:`~hpcring.elastic.member`: a worker's side (join a round, heartbeat, aborts, notifications);
* :mod:`~hpcring.elastic.session`: one round as a session with its own ring communicator.
"""

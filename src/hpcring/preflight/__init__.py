"""The preflight gang check: before the user's script, one task per node decides which nodes are bad.

Run as one task per node inside the allocation (the job script's step loop does this)::

    srun --nodes=K --ntasks-per-node=1 --nodelist=h1,h2,... \\
        python -m hpcring.preflight --out DIR --expect-nodes h1,h2,... [--deadline 30] [--min-gbps X] [--gpus N]

then, in the batch script, :func:`read_verdict` ``(DIR, expected_hosts) ->`` :class:`Verdict`
(or ``python -m hpcring.preflight --verdict --out DIR --expect-nodes ...``).

Rendezvous is the shared job folder, not hpcring's store (whose host could be the bad node):
each task writes ``DIR/<host>.json`` (signed with the job secret, atomically; see
:mod:`hpcring.preflight.record`) twice: first where it listens, then everything it measured.
Use a fresh DIR for every run.

What one task does, every wait bounded by ``--deadline`` D (default 30 s) from its start:

1. choose the interface as hpcring's rendezvous does (``--ifname`` / ``--ifname-for HOST=SPEC``,
   else HPCRING_IFNAME, else the site's fabric, else automatic: bootstrap/netif_choice), open an
   authenticated probe listener (bootstrap/auth's HMAC handshake, before any byte is read) on each
   candidate address, and write its first file;
2. in a child process (:mod:`hpcring.preflight.local`; importing torch in a thread starved the
   listener into timeouts, and a child stuck in CUDA can be killed at the deadline): the versions
   (python, hpcring, torch, Open MPI's ``ompi_info``; with ``--gpus N`` torch is imported and NCCL's
   version is torch's, without GPUs torch's installed version is read, not imported: seconds of
   CPU saved) and, with ``--gpus N``, the GPU check (device count == N, a 256x256 float32 GEMM per
   device against the CPU's; skipped without a CUDA torch);
3. wait for its targets' first files (until ``D - max(3 * connect timeout + 1.5, D/4)``), probe
   each target (connect + handshake with the connect timeout min(3, D/10) s; a target's
   candidates in its order, the first that authenticates counts; a failure is tried once more
   when time allows). Connects are not bound to the source address, as the ring's are not: a node
   whose chosen address is dead may still reach others, but nobody reaches it. Then time the ring link to the next node of ``--expect-nodes`` (at most
   32 MiB or 0.2 s, until the receiver's acknowledgement);
4. write its final file and stay listening until every node that tests it is done (or never
   showed up), at most until D - 0.5 s. Exit 0 when its part is done, whatever it found.

Whom a node probes: up to 16 nodes, every other node (all pairs, N*(N-1) probes). Above 16, all
pairs would cost N^2: each node probes its ring neighbours (i-1, i+1) and 3 other nodes drawn by
a generator seeded with the host list (every node computes the same graph, so each knows who
tests it): about 5 probes per node at any size, each node tested by at least two.
Each node polls only its targets' and testers' files (every 0.1 s, 0.5 s above 64 nodes).

Healthy, a task takes about its Python start (plus the torch import with ``--gpus``); a node that never
starts costs the others until their join limit (about 0.75 D); a dead interface costs the
connect timeout (min(3, D/10) s). The blame rules are in :mod:`hpcring.preflight.verdict`.
"""
from __future__ import annotations

from hpcring.preflight.task import FULL_MESH_MAX, RANDOM_PEERS, Options, probe_graph, run_task
from hpcring.preflight.verdict import Verdict, judge, read_verdict

__all__ = ["FULL_MESH_MAX", "RANDOM_PEERS", "Options", "Verdict", "judge", "probe_graph", "read_verdict",
           "run_task"]

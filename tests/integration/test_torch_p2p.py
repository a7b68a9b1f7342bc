"""Point-to-point on the ``hpcring`` torch backend: send/recv, isend/irecv, batch_isend_irecv,
recv from any source and torch.distributed.pipelining (GPipe, 1F1B), every result equal to the
same calls on gloo, on the ring (hpcring run) and on MPI (plain mpirun); a receive whose sender
never sends is reported by the pair, tag and size, within the deadline + 30 s.
`hpcring run` starts local ranks running tests/workers/torch_p2p_worker.py."""
from __future__ import annotations

import importlib.util
import re
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "workers" / "torch_p2p_worker.py")


def run_job(tmp_path, *args, ranks, env=None, timeout=300):
    from helpers.jobs import run_local
    return run_local(WORKER, tmp_path, *args, ranks=ranks, env=env, timeout=timeout)


def ok_lines(out: str, what: str, ranks: int, backend: str) -> None:
    for r in range(ranks):
        assert re.search(rf"rank {r}: {what} OK \(\d+ results equal to gloo\) on {backend}", out), out[-4000:]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_send_recv_batches_any_source_and_every_dtype_match_gloo(tmp_path, ranks):
    p = run_job(tmp_path, "p2p", ranks=ranks)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    ok_lines(p.stdout, "p2p", ranks, "ring")


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_pipelining_gpipe_and_1f1b_match_gloo(tmp_path, ranks):
    p = run_job(tmp_path, "pipeline", ranks=ranks)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    ok_lines(p.stdout, "pipeline", ranks, "ring")


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None,
                    reason="mpi4py or mpirun is not installed")
@pytest.mark.parametrize("mode", ["p2p", "pipeline"])
def test_point_to_point_on_the_mpi_backend_under_plain_mpirun(tmp_path, mode):
    from helpers.jobs import run_mpirun
    p = run_mpirun(WORKER, tmp_path, mode, ranks=3)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    ok_lines(p.stdout, mode, 3, "mpi")


@pytest.mark.parametrize("where", ["world", "group"])
def test_a_receive_whose_sender_never_sends_is_named_by_pair_tag_and_size(tmp_path, where):
    from helpers.jobs import hang_report
    p = run_job(tmp_path, "hang", "1", where, ranks=3, env={"HPCRING_TIMEOUT": "5", "HPCRING_DIAG_GRACE": "3"})
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "hang finished" not in out
    rep = hang_report(tmp_path)
    assert rep["headline"] == "p2p#1 (rank 1 -> rank 2, tag 7): rank 1 (local0) never sent it", rep["headline"]
    assert rep["categories"].get("missing") == [1] and rep["categories"].get("joined") == [2], rep
    err = rep["trigger"]["error"]
    assert err.startswith("rank 2 (local0) waited for recv from rank 1 (local0), tag 7, 4 MiB: "), err
    assert "within the 5 s deadline" in err, err
    assert "torch_p2p_worker.py" in rep["details"]["1"], rep["details"]
    for r in range(3):                       # every rank says why it exits
        assert f"hpcring: rank {r} (local0)" in out and "exiting with code 1" in out, out[-3000:]
    fault = float(re.search(r"FAULT recv at (\S+)", out).group(1))
    assert time.time() - fault < 5 + 30      # deadline + 30 s

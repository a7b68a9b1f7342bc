"""hpcring.torch (the Horovod API) on CUDA tensors, one rank on a real GPU (``-m gpu``; skipped
without torch CUDA, cupy and a visible GPU). The Horovod path has its own engine and fusion
buffers, so it is checked on its own rather than through test_device_buffers.py: the backend must
be NCCL, results must come back as CUDA tensors on the caller's device, and a DistributedOptimizer
step must equal plain SGD (world of one)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpcring.collectives import nccl_lib as NL

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent("""
    import torch
    import hpcring.torch as hvd
    hvd.init()
    assert hvd.size() == 1 and hvd.nccl_built(), hvd.size()
    from hpcring.torch import state
    assert state.engine().comm.backend.name == "nccl", state.engine().comm.backend.name
    dev = torch.device("cuda", 0)
    x = torch.arange(1000, dtype=torch.float32, device=dev)
    y = hvd.allreduce(x, op=hvd.Sum)
    assert y.is_cuda and y.device == dev and torch.equal(y, x), y
    h = hvd.allreduce_async_(x.clone(), op=hvd.Average)
    z = hvd.synchronize(h)
    assert z.is_cuda and torch.equal(z, x)
    g = hvd.allgather(torch.ones(3, 2, device=dev, dtype=torch.float16))
    assert g.is_cuda and g.shape == (3, 2) and g.dtype == torch.float16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(dev)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(dev)
    ref.load_state_dict(model.state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = torch.randn(16, 8, device=dev), torch.randn(16, 2, device=dev)
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(data[0]), data[1]).backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max().item()
    print("OK horovod gpu")
""")


@pytest.mark.gpu
@pytest.mark.skipif(not NL.gpu_available(), reason="no NVIDIA GPU/cupy")
def test_horovod_api_on_cuda_tensors_runs_on_nccl():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))   # keep extra wheels
    env = dict(os.environ, PYTHONPATH=path, HPCRING_TIMEOUT="60")
    p = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK horovod gpu" in p.stdout, p.stdout + p.stderr

#!/usr/bin/env bash
# hpcring's GPU checks, on a machine with an NVIDIA GPU, CuPy + NCCL and CUDA torch but no network
# (the GPU test machine: ../shared/notes/gpu-machine.md). One stage per call, each well under ten
# minutes:
#   bash scripts/gpu-check.sh tests      # pytest -m gpu: device buffers, NCCL backend (groups, send/recv), Horovod API
#   bash scripts/gpu-check.sh overhead [ARGS]  # benchmarks/nccl_overhead.py ARGS: hpcring vs raw NCCL per call
#   bash scripts/gpu-check.sh ddp [ARGS] # benchmarks/ddp_step.py: ResNet-18 step, DDP nccl vs hpcring (--profile MODE)
#   bash scripts/gpu-check.sh ring       # 16 cores: ring vs gloo (vs Open MPI when mpirun exists), 2/4/8 ranks
# Wheels the machine lacks come from .whl/ (scripts/gpu-wheels.sh); the compiled core is built in
# place. Output goes to the terminal and, when $OUT is set, to $OUT/<stage>.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stage=${1:-tests}
SITE=/tmp/hpcring-wheels
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl || exit 1
fi
if ! "$PY" setup.py -q build_ext --inplace >/tmp/hpcring-build.log 2>&1; then
    tail -30 /tmp/hpcring-build.log >&2; echo "gpu-check: building native/ failed" >&2; exit 1
fi
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
log=/dev/null
[ -n "${OUT:-}" ] && mkdir -p "$OUT" && log="$OUT/$stage.txt"
{
    echo "# gpu-check $stage on $(hostname): $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
    "$PY" -c "import torch, cupy; from cupy.cuda import nccl; print('# torch', torch.__version__, 'cupy', cupy.__version__, 'nccl', nccl.get_version())"
    case "$stage" in
    tests)    "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/unit/test_device_buffers.py \
                  tests/unit/test_nccl_backend.py tests/unit/test_horovod_gpu.py tests/unit/test_p2p_transport.py \
                  tests/unit/test_nccl_shrink.py ;;
    overhead) "$PY" benchmarks/nccl_overhead.py "${@:2}" ;;
    ddp)      "$PY" benchmarks/ddp_step.py -n 1 --model resnet18 "${@:2}" ;;
    ring)     "$PY" benchmarks/compare_devcluster.py --skip ring,mpi,gloo,link --one-host-ranks 2,4,8 \
                  --one-host-sizes 16M,64M,256M ;;
    *)        echo "gpu-check: unknown stage '$stage' (tests, overhead, ddp, ring)" >&2; exit 2 ;;
    esac
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"

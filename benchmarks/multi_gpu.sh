#!/usr/bin/env bash
# Real TSP over NCCL: throughput and memory of TSP and its baselines with real communication (correctness on the
# same GPUs: python -m pytest tests/test_multi_gpu.py). See benchmarks/MULTI_GPU.md.
#
#   bash benchmarks/multi_gpu.sh [NGPUS] [options of python -m benchmarks.multi_gpu ...]
#
# NGPUS defaults to every visible GPU. Each configuration runs under a fresh torchrun --standalone
# --nproc-per-node NGPUS. NVLink multicast stays off: the variables below are exported here and forced again by
# benchmarks.multi_gpu into every subprocess.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif command -v python >/dev/null 2>&1; then
    py=python
else
    py=python3
fi

nproc_args=()
if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then
    nproc_args=(--nproc "$1")
    shift
fi

exec "$py" -m benchmarks.multi_gpu "${nproc_args[@]}" "$@"

#!/usr/bin/env bash
# Real TSP over NCCL in one call: (a) correctness against the single-GPU reference, then (b) throughput and
# memory of TSP and its baselines with real communication. See benchmarks/MULTI_GPU.md.
#
#   bash benchmarks/multi_gpu.sh [NGPUS] [options of benchmarks/multi_gpu.py ...]
#
# NGPUS defaults to every visible GPU. Each part runs under torchrun --standalone --nproc-per-node NGPUS (one
# fresh torchrun per configuration). NVLink multicast stays off: the variables below are exported here and
# forced again by multi_gpu.py into every subprocess.
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

exec "$py" benchmarks/multi_gpu.py "${nproc_args[@]}" "$@"

#!/usr/bin/env bash
# Multi-node TSP training with torchrun (no SLURM needed): run this script once on every node.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash recipes/torchrun.sh             # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash recipes/torchrun.sh             # on node1
#   bash recipes/torchrun.sh                                                   # one node, all its GPUs
#   CONFIG=recipes/llama3-8b.yaml bash recipes/torchrun.sh --trainer.max_steps 100
#
# torchrun starts one process per GPU and Lightning reads its environment (TorchElasticEnvironment, which wins
# over SLURM detection, so this also works inside an salloc/srun allocation with one task per node:
#   srun --ntasks-per-node=1 bash recipes/torchrun.sh  with MASTER_ADDR=$(scontrol show hostnames | head -n1)).
# tsp_size = GPUs per node: each node holds whole TSP groups; the nodes are data-parallel replicas.
# trainer.num_nodes and trainer.devices must equal --nnodes and --nproc-per-node (passed below).
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-recipes/paper-7b-128k.yaml}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-.venv/bin/python}

if [ "${GPUS_PER_NODE:-0}" -lt 1 ]; then
  echo "no GPU found: set GPUS_PER_NODE" >&2
  exit 1
fi

export PYTHONFAULTHANDLER=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# A static rendezvous (--node-rank + --master-addr); for elastic/fault-tolerant jobs use --rdzv-backend=c10d.
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$GPUS_PER_NODE" \
    --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
    -m lightning_tsp.cli fit --config "$CONFIG" \
    --trainer.num_nodes="$NNODES" \
    --trainer.devices="$GPUS_PER_NODE" \
    --trainer.strategy.tsp_size="$GPUS_PER_NODE" \
    "$@"

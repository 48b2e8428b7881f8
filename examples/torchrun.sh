#!/usr/bin/env bash
# One node, or one node of several (run this on every node with the same MASTER_ADDR):
#   MODEL=moe-2b FLAVOUR=scalevec DATA_PATH=/data/c4_text_document \
#   TOKENIZER_MODEL=/data/spm32k.model bash examples/torchrun.sh
#   multi-node: NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0 host> bash examples/torchrun.sh
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/models.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron's TP/SP comm-compute overlap needs it
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
mkdir -p "$RUN_DIR"

exec torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "$ENTRY" "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PRECISION_ARGS[@]}" \
  "$@"

#!/usr/bin/env bash
# Model and parallelism flags of the paper's reference models, for both launchers.
# Sourced by torchrun.sh and slurm.sbatch:   MODEL=dense-0.12b|dense-1b|moe-2b|tiny
#                                             FLAVOUR=scalevec|megatron-lm
# Sets MODEL_ARGS, PARALLEL_ARGS, TRAIN_ARGS, PRECISION_ARGS and ENTRY.
#
# Llama-style: RMSNorm, SwiGLU, RoPE, no biases, 32k SentencePiece vocabulary, tied embeddings.
#   dense-0.12b: 12 layers, hidden 768, 12 heads (MHA), FFN 2048       -> 110M params (85M non-emb.)
#   dense-1b:    24 layers, hidden 2048, 16 heads, GQA 4 groups, FFN 5632 -> 1.15B params
#   moe-2b:      24 layers, hidden 1024, 16 heads, GQA 4 groups, every layer MoE with
#                32 experts of FFN 768, top-4 routing -> 1.91B total, 0.32B active per token
# Parallelism (8 GPUs per node assumed; data parallel over everything that is left):
#   dense-0.12b: TP=1 PP=1. The model fits one GPU many times over; pure data parallelism with
#                the distributed optimizer (ZeRO-1) is the fastest layout at any node count.
#   dense-1b:    TP=2 + sequence parallel, PP=1. TP stays inside a node (NVLink); TP=2 halves
#                activation memory at 4k tokens and keeps GEMMs large; PP would only add bubbles.
#   moe-2b:      TP=1, EP=8 (4 experts per GPU), PP=1. Expert parallelism inside a node keeps the
#                all-to-all token dispatch on NVLink; across nodes experts are data-parallel
#                (expert-DP), dense parts data-parallel over every GPU.
# Scale vectors: the strategy is the paper's unified one (hg+dnp+or+iwd). Our trainer takes
# --scalevec; Megatron-LM takes the MEGATRON_SCALEVEC environment variable (see README.md).
set -euo pipefail

MODEL=${MODEL:-dense-0.12b}
FLAVOUR=${FLAVOUR:-scalevec}
if [ "$MODEL" != tiny ]; then
  DATA_PATH=${DATA_PATH:?set DATA_PATH to an indexed dataset prefix (tools/preprocess_data.py)}
  TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a SentencePiece .model}
fi
RUN_DIR=${RUN_DIR:-runs/${MODEL}-${FLAVOUR}}
FP8=${FP8:-0}   # 1: FP8 (Megatron-LM flavour with Transformer Engine on Hopper/Blackwell only)

SEQ=4096
case "$MODEL" in
  dense-0.12b)
    SIZE=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 2048)
    SEQ=2048; GBS=256; MBS=16; LR=3e-3; MIN_LR=3e-4; ITERS=20000
    PAR=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1)
    SPEC=scalevec_dense ;;
  dense-1b)
    SIZE=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --num-query-groups 4
          --ffn-hidden-size 5632)
    GBS=512; MBS=4; LR=1.5e-3; MIN_LR=1.5e-4; ITERS=50000
    PAR=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel)
    SPEC=scalevec_dense ;;
  moe-2b)
    SIZE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --num-query-groups 4
          --ffn-hidden-size 4096 --num-experts 32 --moe-ffn-hidden-size 768 --moe-router-topk 4
          --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2)
    GBS=512; MBS=4; LR=2e-3; MIN_LR=2e-4; ITERS=50000
    PAR=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
         --expert-model-parallel-size 8)
    SPEC=scalevec_moe ;;
  tiny)  # CPU smoke test of the launchers (mock data, gloo); what tests/training/test_launch.py runs
    SIZE=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2
          --ffn-hidden-size 64 --vocab-size 64)
    SEQ=16; GBS=8; MBS=2; LR=1e-2; MIN_LR=1e-3; ITERS=${ITERS:-8}
    PAR=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1)
    SPEC=scalevec_dense ;;
  *) echo "MODEL must be dense-0.12b, dense-1b, moe-2b or tiny (got $MODEL)" >&2; exit 2 ;;
esac

if [ "$MODEL" = tiny ]; then
  COMMON_TRAIN=(--seq-length "$SEQ" --micro-batch-size "$MBS" --global-batch-size "$GBS"
    --train-iters "$ITERS" --lr "$LR" --min-lr "$MIN_LR" --mock-data --log-interval 1
    --eval-interval 0 --save "$RUN_DIR/checkpoints" --save-interval 4 --no-plot)
else
COMMON_TRAIN=(--seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS"
  --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --init-method-std 0.02 --seed 1234
  --data-path "$DATA_PATH" --split 99,1,0 --tokenizer-model "$TOKENIZER_MODEL"
  --log-interval 10 --eval-interval 1000 --eval-iters 10
  --save "$RUN_DIR/checkpoints" --save-interval 1000
  --tensorboard-dir "$RUN_DIR/tensorboard" --use-distributed-optimizer --bf16)
fi

if [ "$FLAVOUR" = scalevec ]; then
  # This repository's trainer: RMSNorm/SwiGLU/RoPE/no bias are built in; --spec picks the preset.
  ENTRY=${ENTRY:-pretrain_gpt.py}
  MODEL_ARGS=(--spec "$SPEC" --scalevec unified "${SIZE[@]}")
  TRAIN_ARGS=("${COMMON_TRAIN[@]}" --overlap-grad-reduce --distributed-backend nccl)
  [ "$MODEL" = tiny ] && TRAIN_ARGS=("${COMMON_TRAIN[@]}" --distributed-backend gloo)
  # our --load must name an existing checkpoint directory: resume only when there is one
  [ -d "$RUN_DIR/checkpoints" ] && TRAIN_ARGS+=(--load "$RUN_DIR/checkpoints")
  PRECISION_ARGS=()
  # Megatron-LM's FP8 flags: the same delayed scaling as the megatron-lm flavour below
  [ "$FP8" = 1 ] && PRECISION_ARGS=(--transformer-impl transformer_engine --fp8-format hybrid
    --fp8-amax-history-len 1024 --fp8-amax-compute-algo max)
elif [ "$FLAVOUR" = megatron-lm ]; then
  # Megatron-LM core_v0.16.1 pretrain_gpt.py. --spec replaces its layer spec entirely, so the
  # Llama features are given as flags that our block spec reads from the config.
  ENTRY=${ENTRY:-${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM core_v0.16.1 checkout}/pretrain_gpt.py}
  MODEL_ARGS=(--spec megatron_scalevec.megatron_lm_spec "$SPEC" "${SIZE[@]}"
    --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope
    --attention-dropout 0.0 --hidden-dropout 0.0)
  if [[ " ${SIZE[*]} " == *" --num-query-groups "* ]]; then
    MODEL_ARGS+=(--group-query-attention)
  fi
  TRAIN_ARGS=("${COMMON_TRAIN[@]}" --tokenizer-type SentencePieceTokenizer
    --overlap-grad-reduce --overlap-param-gather --distributed-backend nccl
    --ckpt-format torch_dist --load "$RUN_DIR/checkpoints")
  PRECISION_ARGS=()
  if [ "$FP8" = 1 ]; then
    # FP8 needs Transformer Engine linears (see README: "FP8 and the block spec").
    PRECISION_ARGS=(--transformer-impl transformer_engine --fp8-format hybrid
      --fp8-amax-history-len 1024 --fp8-amax-compute-algo max)
  fi
else
  echo "FLAVOUR must be scalevec or megatron-lm (got $FLAVOUR)" >&2; exit 2
fi
PARALLEL_ARGS=("${PAR[@]}")

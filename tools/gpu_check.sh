#!/usr/bin/env bash
# GPU check: one prepared run of at most 8 minutes on one H200 (Python 3.12, torch 2.11 CUDA 13,
# no megatron-core or Transformer Engine preinstalled; TE is not used):
#   1. grouped-GEMM experts equal sequential experts on CUDA (bf16; tools/grouped_check.py);
#   2. the overhead table in bf16 on a 1B-class dense stack at 4k and 8k tokens per micro-batch,
#      each variant vs stock megatron-core and vs our `shared` (step time, saved activations,
#      total peak torch.cuda.max_memory_allocated over a 4-micro-batch step, and the GPU cost
#      ledger's bytes kept for backward a micro-batch and synchronizing CUDA calls a micro-batch,
#      counted with torch.cuda.set_sync_debug_mode: docs/benchmarks.md);
#   3. the same on a fine-grained MoE (64 experts of width 384, top-8), sequential and grouped
#      experts (rows VARIANT/grouped; stock has no grouped experts without TE);
#   4. only where Transformer Engine (with its extension) imports: the TE path (tools/te_check.py)
#      dense and MoE with TE grouped experts (unified with per-expert and with shared expert
#      vectors, hg+dp), stock TE spec / shared / unified, in bf16 and FP8: delayed scaling (amax
#      history 1024, max: what examples/models.sh launches), current scaling, and block scaling
#      where TE reports it. 20 optimizer steps of 4 micro-batches each (gradients accumulated,
#      set_is_first_microbatch() before each step's first, as megatron-core's schedule does):
#      step time and max_memory_allocated vs shared, the last step's loss and its relative
#      difference to the same variant's bf16 loss. TE cannot be carried to the lent device (its
#      core library is over the carry limit), so this part runs on any CUDA machine with TE
#      installed, and is skipped with one line elsewhere.
# megatron-core's cp312 wheel must be carried in .whl/ (device tool README: carry [".whl"]):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl megatron-core==0.16.1
# Run: bash tools/gpu_check.sh   (results in $OUT, default /tmp/out; record them in docs/RESULTS.md)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  echo "gpu_check: no megatron-core wheel in .whl/ (see the header of this script)" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'mcore', \
m.__version__)" | tee -a "$OUT/gpu.txt"

# 1. equality of the grouped experts on CUDA (bf16 GEMMs: tolerance 5e-2 relative).
timeout 100 python3 tools/grouped_check.py --device cuda --bf16 --experts 16 \
  2>&1 | tee "$OUT/grouped_check.txt"

VARIANTS="stock shared hg hg+dnp unified"
# Each table has time, saved activations and total peak memory (max_memory_allocated, a fresh
# process per variant) against stock and against our shared (benchmarks/overhead.py).
# 2. 1B-class dense layers (Llama-like: h=2048, 16 heads, 4 KV groups, ffn 5632), 4 of them,
#    at 4k and 8k tokens per micro-batch (the fold's share, docs/benchmarks.md).
for tokens in 4096 8192; do
  timeout 170 python3 tools/bench_overhead.py --device cuda --bf16 --num-layers 4 \
    --hidden-size 2048 --num-attention-heads 16 --num-query-groups 4 --ffn-hidden-size 5632 \
    --seq-length "$tokens" --micro-batch-size 1 --micro-batches 4 --vocab 32000 --warmup 3 \
    --repeats 10 --instances 1 --null --variants $VARIANTS --baseline shared 2>&1 \
    | tee "$OUT/bench_dense_$tokens.md"
done

# 3. fine-grained MoE: 64 experts, top-8, expert width 3072 / 8 = 384; grouped rows too.
timeout 170 python3 tools/bench_overhead.py --device cuda --bf16 --num-layers 4 \
  --hidden-size 1024 --num-attention-heads 16 --num-query-groups 4 --ffn-hidden-size 3072 \
  --num-experts 64 --topk 8 --grouped-gemm --seq-length 2048 --micro-batch-size 2 \
  --micro-batches 4 --vocab 32000 --warmup 3 --repeats 10 --instances 1 --variants $VARIANTS \
  --baseline shared 2>&1 | tee "$OUT/bench_moe.md"

# 4. the TE path, where TE is installed: dense, then MoE on TE grouped experts (TEGroupedMLP)
#    with every kind of expert vector: unified per expert and shared per layer, hg+dp.
#    Each in bf16, fp8-delayed, fp8-current and fp8-block (te_check.py's default --precisions).
if python3 -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
  timeout 600 python3 tools/te_check.py --steps 20 --micro-batches 4 \
    --variants stock shared unified 2>&1 | tee "$OUT/te_dense.md"
  timeout 600 python3 tools/te_check.py --steps 20 --micro-batches 4 --hidden-size 1024 \
    --ffn-hidden-size 3072 --num-experts 64 --topk 8 --grouped-gemm \
    --variants stock shared hg+dp unified 2>&1 | tee "$OUT/te_moe.md"
  timeout 300 python3 tools/te_check.py --steps 20 --micro-batches 4 --hidden-size 1024 \
    --ffn-hidden-size 3072 --num-experts 64 --topk 8 --grouped-gemm --expert-vectors shared \
    --variants unified 2>&1 | tee "$OUT/te_moe_shared_vectors.md"
else
  echo "gpu_check: Transformer Engine not importable here: TE path (part 4) skipped" \
    | tee "$OUT/te_skipped.txt"
fi

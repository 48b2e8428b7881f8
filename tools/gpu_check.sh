#!/usr/bin/env bash
# GPU check (one prepared script for a lent H200/H100; no Transformer Engine there):
#   1. the equality tests on CUDA tensors are not needed (they are device-free); instead
#   2. the overhead table in bf16 on a 1B-class layer stack, each variant vs stock megatron-core.
# Needs megatron-core's wheel carried in .whl/ (see the device tool's README):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# 1B-class dense stack (Llama-like: h=2048, 16 heads, 4 KV groups, ffn 5632), 4 layers, bf16.
python3 tools/bench_overhead.py --device cuda --bf16 --num-layers 4 --hidden-size 2048 \
  --num-attention-heads 16 --num-query-groups 4 --ffn-hidden-size 5632 --seq-length 2048 \
  --micro-batch-size 4 --vocab 32000 --warmup 5 --repeats 20 | tee "$OUT/bench_dense_gpu.md"
# MoE stack (64 experts of width 384, top-8 is the paper-like shape; top-2 here), bf16.
python3 tools/bench_overhead.py --device cuda --bf16 --num-layers 4 --hidden-size 1024 \
  --num-attention-heads 16 --num-query-groups 4 --ffn-hidden-size 768 --num-experts 16 \
  --topk 2 --seq-length 2048 --micro-batch-size 4 --vocab 32000 --warmup 5 --repeats 20 \
  --variants stock shared hg hg+dnp unified | tee "$OUT/bench_moe_gpu.md"

#!/usr/bin/env bash
# GPU check: one prepared device run of about 300 s on one H100 (80 GB), PyTorch preinstalled,
# no network, no Transformer Engine. Every part is independent: its output goes to
# $OUT/<part>.txt, its exit code to $OUT/exit_codes.txt, and the next part runs whatever it
# returned; each has a timeout, so the whole run is bounded (install 30 s + parts 270 s).
# Most valuable first:
#   1. dense 1B-class layers (Llama-like: h=2048, 16 heads, 4 KV groups, ffn 5632; 4 layers,
#      4k tokens a micro-batch, 4 micro-batches a step) in bf16: step time and total peak
#      torch.cuda.max_memory_allocated of stock megatron-core, our shared and unified, a null
#      row (shared built again: the noise floor), two instances each (benchmarks/overhead.py);
#   2. torch._scaled_mm (fast accumulation on and off) against the CPU stand-in's FP8
#      cast-and-matmul on the same operands: how far the tests' GEMM is from Hopper's (30 s,
#      tools/fp8_gemm_check.py);
#   3. a fine-grained MoE sized for 80 GB (64 experts of width 384, top-8, h=1024, 4 layers;
#      stock, shared, unified, sequential and grouped experts, one instance);
#   4. grouped-GEMM experts equal sequential experts on CUDA (tools/grouped_check.py);
#   5. only where Transformer Engine (with its extension) imports: tools/te_check.py, FP8 as
#      users run it (megatron-core DDP, main_grad, fused wgrad accumulation); skipped in one
#      line elsewhere (TE's core library is over the device's carry limit).
# megatron-core's cp312 wheel is carried in .whl/ (device tool README: carry [".whl"]):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl megatron-core==0.16.1
# Run: bash tools/gpu_check.sh   (results in $OUT, default /tmp/out; record them in docs/RESULTS.md)
# CPU (CI, tests/test_gpu_check.py): GPU_CHECK_DEVICE=cpu shrinks every part's sizes and skips
# the install when megatron-core already imports.
set -u
cd "$(dirname "$0")/.."
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
: > "$OUT/exit_codes.txt"

part() {  # part NAME SECONDS COMMAND...: run it, record its exit code, never stop the script
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name (at most ${limit} s)"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name $rc $((SECONDS - start))s" >> "$OUT/exit_codes.txt"
  grep -v -i "warn" "$OUT/$name.txt" | tail -n 30
  echo "== $name: exit $rc after $((SECONDS - start)) s"
}

install() {
  if python3 -c "import megatron.core" > /dev/null 2>&1; then
    echo "megatron-core already importable: nothing to install"
  elif ls .whl/megatron_core-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
  else
    echo "gpu_check: no megatron-core importable and no wheel in .whl/ (see this script's header)"
    return 2
  fi
}
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
part install 30 bash -c "$(declare -f install); install"
python3 - << 'EOF' | tee "$OUT/env.txt"
import torch
try:
    import megatron.core as m
    mcore = m.__version__
except Exception as err:  # noqa: BLE001
    mcore = f"not importable ({type(err).__name__})"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", gpu, "megatron-core", mcore)
EOF

if [ "$DEVICE" = cuda ]; then
  PREC=(--device cuda --bf16)
  DENSE=(--num-layers 4 --hidden-size 2048 --num-attention-heads 16 --num-query-groups 4
         --ffn-hidden-size 5632 --seq-length 4096 --micro-batch-size 1 --micro-batches 4
         --vocab 32000 --warmup 2 --repeats 6)
  MOE=(--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --num-query-groups 4
       --ffn-hidden-size 3072 --num-experts 64 --topk 8 --seq-length 2048 --micro-batch-size 2
       --micro-batches 4 --vocab 32000 --warmup 2 --repeats 5)
  GEMM=(--device cuda --seconds 30)
  NO_MEMORY=()
  GROUPED=(--device cuda --bf16 --experts 16)
  TIMES=(110 35 80 30)
else  # CI on CPU: the same commands, shapes shrunk
  export MEGATRON_SCALEVEC_FUSED_COMPILE=${MEGATRON_SCALEVEC_FUSED_COMPILE:-off}
  PREC=(--device cpu --threads 2)
  NO_MEMORY=(--no-memory)  # the MoE part: its memory children would double its time here
  DENSE=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2
         --ffn-hidden-size 128 --seq-length 32 --micro-batch-size 1 --micro-batches 2
         --vocab 128 --warmup 1 --repeats 1)
  MOE=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2
       --ffn-hidden-size 128 --num-experts 4 --topk 2 --seq-length 32 --micro-batch-size 1
       --micro-batches 2 --vocab 128 --warmup 1 --repeats 1)
  GEMM=(--device cpu --shapes 64x48x128 --seconds 10)
  GROUPED=(--device cpu --experts 4)
  TIMES=(240 60 240 120)
fi

part dense "${TIMES[0]}" python3 tools/bench_overhead.py "${PREC[@]}" "${DENSE[@]}" \
  --instances 2 --null --variants stock shared unified --baseline shared
part fp8_gemm "${TIMES[1]}" python3 tools/fp8_gemm_check.py "${GEMM[@]}"
part moe "${TIMES[2]}" python3 tools/bench_overhead.py "${PREC[@]}" "${MOE[@]}" \
  --grouped-gemm --instances 1 --variants stock shared unified --baseline shared "${NO_MEMORY[@]}"
part grouped "${TIMES[3]}" python3 tools/grouped_check.py "${GROUPED[@]}"
if python3 -c "import transformer_engine.pytorch" > /dev/null 2>&1; then
  part te_dense 300 python3 tools/te_check.py --steps 10 --micro-batches 4 \
    --variants stock shared unified
  part te_moe 300 python3 tools/te_check.py --steps 10 --micro-batches 4 --hidden-size 1024 \
    --ffn-hidden-size 3072 --num-experts 64 --topk 8 --grouped-gemm \
    --variants stock shared hg+dp unified
else
  echo "gpu_check: Transformer Engine not importable here: the TE part (5) skipped" \
    | tee "$OUT/te_skipped.txt"
fi
echo "== exit codes (part, code, seconds; 124: timed out)"
cat "$OUT/exit_codes.txt"

#!/usr/bin/env bash
# The GPU benchmark suite, one command on a fresh GPU machine (about 30 minutes on an H100/H200):
#   bash benchmarks/gpu.sh [--dry-run] [OUTDIR]
# Writes OUTDIR/{environment.txt,lm.md,resnet.md,memory.md,skip_sync.md,tests.txt,summary.md} and JSON beside
# them (OUTDIR defaults to out/gpu). --dry-run runs the same steps at tiny sizes on whatever device
# JAX finds (CPU in CI), without the test suite, to check the script itself.
# Protocol and how each table is read: benchmarks/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out=${1:-out/gpu}
mkdir -p "$out"
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
py=${PYTHON:-python3}

{
  date -u
  (nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi")
  $py -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
  grep -m1 "model name" /proc/cpuinfo || true
} | tee "$out/environment.txt"

if [ "$dry" = 1 ]; then
  lm=(--size tiny --rounds 1 --k 1 --variants f32,bf16,f16-dyn-cond,fp8-current,fp8-delayed)
  resnet=(--size tiny --rounds 1 --k 1 --variants f32,f16-dyn-cond)
  sync=(--steps 10 --rounds 1)
  memory_lm=(--size tiny --variants f32,bf16)
  memory_resnet=(--size tiny --variants f32,bf16)
  fsdp=(--size tiny --rounds 1 --k 1 --variants f32,bf16)
else
  lm=(--size small --rounds 15 --k 5)
  resnet=(--size 50 --rounds 10 --k 5 --variants f32-highest,f32,bf16,f16-dyn-cond,f16-dyn-select,f16-none)
  sync=(--steps 300 --rounds 5)
  memory_lm=(--size small --variants f32,bf16,bf16-noacc,f16-dyn-cond,fp8-current)
  memory_resnet=(--size 50 --variants f32,bf16,f16-dyn-cond)
  fsdp=(--size small --batch 16 --rounds 5 --k 3 --variants f32,bf16,fp8-gather)
fi

$py benchmarks/lm.py "${lm[@]}" --json "$out/lm.json" | tee "$out/lm.md"
$py benchmarks/resnet.py "${resnet[@]}" --json "$out/resnet.json" | tee "$out/resnet.md"
{
  $py benchmarks/lm.py --memory "${memory_lm[@]}" --json "$out/memory_lm.json"
  $py benchmarks/resnet.py --memory "${memory_resnet[@]}" --json "$out/memory_resnet.json"
} | tee "$out/memory.md"
$py benchmarks/skip_sync.py "${sync[@]}" --json "$out/skip_sync.json" | tee "$out/skip_sync.md"
# FSDP over the GPUs there are (on one GPU the collectives vanish from the compiled program; the lowered
# program still states their dtypes)
$py benchmarks/fsdp.py "${fsdp[@]}" --json "$out/fsdp.json" | tee "$out/fsdp.md"
if [ "$dry" = 0 ]; then
  # The suite once on the GPU (it expects 8 devices for the multi-device tests; failures are recorded).
  JAX_PLATFORMS=cuda,cpu $py -m pytest -q -p no:cacheprovider 2>&1 | tail -40 > "$out/tests.txt" || true
fi
cat "$out/environment.txt" "$out/lm.md" "$out/resnet.md" "$out/memory.md" "$out/skip_sync.md" "$out/fsdp.md" \
  > "$out/summary.md"
echo "wrote $out/summary.md"

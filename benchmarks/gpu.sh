#!/usr/bin/env bash
# One command for a GPU spell (one H100, the image's torch, no network; ~20 min):
#   bash benchmarks/gpu.sh
# 1. installs mixprec without dependencies (the image's torch stays), plus the test tools from
#    ./wheelhouse when that folder is there (scripts/gpu-wheelhouse.sh fills it beforehand);
# 2. runs the CUDA test subset: python -m pytest --device cuda -m cuda;
# 3. runs the benchmarks on CUDA, each under its own time limit;
# and writes benchmarks/results/*_cuda.md (tests_cuda.md: the test summary), each naming the
# device. A step that fails or runs out of time is recorded and the next one still runs.
# PYTHON (default: python) picks the interpreter; QUICK=1 cuts every benchmark to a smoke run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=benchmarks/results
mkdir -p "$OUT"
STATUS=()
start=$(date +%s)

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, record how it ended
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s, $(($(date +%s) - start))s elapsed)" >&2
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    STATUS+=("$name: exit $rc$([ $rc -eq 124 ] && echo ' (time limit)')")
    return 0
}

if [ -d wheelhouse ]; then
    "$PY" -m pip install -q --no-index --find-links wheelhouse \
        pytest pytest-timeout hypothesis numpy 2>&1 | tail -3
    # optional (their tests skip without them); the image's torch is pinned, never replaced
    pin=$(mktemp)
    "$PY" -c "import torch; print('torch==' + torch.__version__)" >"$pin"
    for extra in transformers torchao lightning; do
        "$PY" -m pip install -q --no-index --find-links wheelhouse -c "$pin" "$extra" \
            >/dev/null 2>&1 || echo "($extra not installed: its tests skip)" >&2
    done
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
"$PY" - <<'EOF' || exit 1
import torch

assert torch.cuda.is_available(), "benchmarks/gpu.sh needs a CUDA device"
print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, "
      f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
EOF
DEVICE_NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name())")
Q=${QUICK:-0}

# -- 1. the CUDA test subset (about 530 tests) --
step tests 420 "$PY" -m pytest --device cuda -m cuda -p no:cacheprovider -q -rfEs \
    --junitxml="$OUT/tests_cuda.xml" >"$OUT/tests_cuda.log" 2>&1
{
    echo "# CUDA test subset on $DEVICE_NAME"
    echo
    echo "Command: \`python -m pytest --device cuda -m cuda\` (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
    echo
    echo '```'
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests_cuda.log" | tail -60
    echo '```'
} >"$OUT/tests_cuda.md"

# -- 2. benchmarks (CUDA-event timing throughout); the limits add up to < 25 min with the tests --
if [ "$Q" = 1 ]; then S=3; else S=20; fi
# ViT-B/16-shaped: bf16 vs fp32 throughput, NAIVE/O2 peak memory (targets: bf16 >= 2.5x fp32,
# NAIVE/O2 peak <= 0.55x fp32)
step bench_vit 240 "$PY" -m mixprec.cli bench --device cuda --model vit --width 768 --depth 12 \
    --heads 12 --patch-size 16 --image-size 224 --batch 64 --steps "$S" --warmup 3 \
    --no-progress --out "$OUT"
# eager face and compiled step vs their raw-torch twins (targets: >= 0.97x and >= 1.0x)
step static_vit 300 "$PY" benchmarks/bench_static.py --device cuda --clock wall --sizes vit \
    --modes bf16,naive,fp8 --static-width 0 --steps $((S * 2)) --warmup 5 --tag vit_cuda \
    --out "$OUT"
step static_mlp 150 "$PY" benchmarks/bench_static.py --device cuda --clock wall --sizes mlp \
    --mlp-width 4096 --mlp-batch 2048 --modes bf16 --static-width 0 --steps $((S * 2)) \
    --warmup 5 --tag mlp_cuda --out "$OUT"
step bench_mlp 120 "$PY" benchmarks/bench_mlp.py --device cuda --width 8192 --batch 8192 \
    --steps "$S" --warmup 3 --opt-steps "$S" --out "$OUT"
# fp8 vs bf16 at 8192^2, GEMM-bound (target >= 1.25x), with and without fast accumulation
for accum in on off; do
    step "bench_fp8 fast_accum=$accum" 100 "$PY" benchmarks/bench_fp8.py --device cuda \
        --widths 4096 8192 --mlp-max-width 8192 --tokens 8192 --steps "$S" --warmup 3 \
        --fast-accum "$accum" --out "$OUT"
done

{
    echo "# benchmarks/gpu.sh on $DEVICE_NAME: $(($(date +%s) - start)) s"
    echo
    printf -- '- %s\n' "${STATUS[@]}"
} | tee "$OUT/gpu_run_cuda.md"

#!/usr/bin/env bash
# One prepared device check: zlc's CUDA executor on one H200 against PyTorch, in under 8 minutes.
#
# Before (on the CPU-only machine, the zlc venv active):
#     python bench/device_bench.py --prepare      # bundles for h200 + role maps -> bench/device_inputs/
# Then on the device machine (torch, numpy, cuda.bindings; no package registry, zlc not installed):
#     bash bench/device_check.sh                  # device run: carry ["bench/device_inputs"] (+ ".whl")
#
# Writes to $OUT (default bench/out): env.txt, device_bench.log, device_bench.md (the table),
# device_bench.json (every number). Exit status: 0 when every model's greedy tokens equal the fp32
# reference, 1 when one differs, 2 when the inputs or the GPU are missing, 124 on the time limit.
# What it measures and why the weights are generated on the device: bench/device_bench.py's docstring.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LIMIT_S=${LIMIT_S:-460}   # hard stop for the benchmark process (the whole script stays under 8 minutes)
BUDGET_S=${BUDGET_S:-380} # after this the benchmark skips optional work (torch.compile rows) and reports

if [ ! -f bench/device_inputs/index.json ]; then
    echo "bench/device_inputs/ is missing: run 'python bench/device_bench.py --prepare' on the CPU machine" \
         "and carry bench/device_inputs to this machine" | tee "$OUT/device_bench.log"
    exit 2
fi
# A cuda-bindings wheel carried in .whl/ (only where the image lacks the package).
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/zlc-site .whl/*.whl \
        && export PYTHONPATH=/tmp/zlc-site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv || true
    $PY - <<'EOF'
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO GPU VISIBLE")
try:
    import cuda.bindings as cb
    print("cuda.bindings", getattr(cb, "__version__", "?"))
except ImportError as e:
    print("cuda.bindings MISSING:", e)
try:
    import onnxruntime as ort
    print("onnxruntime", ort.__version__, ort.get_available_providers())
except ImportError:
    print("onnxruntime not installed")
EOF
    cat bench/device_inputs/index.json
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout --kill-after=10 "$LIMIT_S" $PY bench/device_bench.py --out "$OUT" --budget-s "$BUDGET_S" 2>&1 \
    | tee "$OUT/device_bench.log"
rc=${PIPESTATUS[0]}
echo "device_bench exit status $rc"
exit "$rc"

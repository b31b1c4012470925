#!/usr/bin/env bash
# The main job on the bundled example, from a fresh machine: set up the venv (.venv), export a tiny
# random-weight Llama to ONNX, verify zlc against ONNX Runtime (prefill + 32 decode steps through
# zlc's KV cache), show what raising did, and generate tokens with the CPU reference executor.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
venv=${ZLC_VENV:-.venv}
model=examples/tiny/out/tiny-llama.onnx

.ci/setup-venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"

if [ ! -f "$model" ]; then
    echo "+ python examples/tiny/make_tiny.py $model" >&2
    python examples/tiny/make_tiny.py "$model" >/dev/null
fi
echo "+ zlc verify $model" >&2
zlc verify "$model" --steps 32 --prompt-len 8
echo "+ zlc inspect $model --explain" >&2
zlc inspect "$model" --explain
echo "+ zlc run $model --prompt-ids 1,2,3,4 --max-new-tokens 16" >&2
zlc run "$model" --prompt-ids 1,2,3,4 --max-new-tokens 16

#!/usr/bin/env bash
# The main job on the bundled example, from a fresh machine: set up the venv (.venv), export a tiny
# random-weight Llama to ONNX, verify zlc against ONNX Runtime (prefill + 32 decode steps through
# zlc's KV cache), compile it into a megakernel bundle (the native CPU kernel, built by the system C
# compiler per ISA level, plus an sm_86 cubin for the a10 target), and generate tokens with the
# megakernel on this machine's cores (`--device auto`: the native kernel when there is no GPU).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
venv=${ZLC_VENV:-.venv}
out=examples/tiny/out
model=$out/tiny-llama.onnx
bundle=$out/tiny-llama.zlc

.ci/setup-venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"

if [ ! -f "$model" ]; then
    echo "+ python examples/tiny/make_tiny.py $model" >&2
    python examples/tiny/make_tiny.py "$model" >/dev/null
fi
echo "+ zlc verify $model" >&2
zlc verify "$model" --steps 32 --prompt-len 8
echo "+ zlc compile $model --target cpu --target a10 --max-seq 128 -o $bundle" >&2
zlc compile "$model" --target cpu --target a10 --max-seq 128 -o "$bundle"
echo "+ zlc run $bundle --prompt-ids 1,2,3,4 --max-new-tokens 16" >&2
zlc run "$bundle" --prompt-ids 1,2,3,4 --max-new-tokens 16

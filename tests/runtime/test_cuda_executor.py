"""The `cuda` executor (runtime/cuda.py) without a GPU: target selection, launch configuration and
parameter packing against a real bundle's manifest, the host side of the launch protocol over a
fake driver (host memory standing in for the device, a toy kernel standing in for the cubin), and
the errors a machine without a driver or GPU gets. One test launches the real cubin; it runs only
where a CUDA GPU is present and compares with the Triton-interpreter executor."""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zlc
from zlc import bundle as fmt
from zlc.errors import ZlcError
from zlc.runtime import cuda as zc
from zlc.runtime import cuda_driver as zd
from zlc.runtime import cuda_launch as zl
from zlc.runtime import trace as tr
from zlc.runtime.megakernel import MegakernelSession
from zlc.targets import get_target

TARGETS = ["a10", "h100", "a100"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, tiny_onnx: Path) -> Path:
    out = tmp_path_factory.mktemp("cuda") / "tiny.zlc"
    zlc.compile(tiny_onnx, targets=TARGETS, out=out, max_seq=64)
    return out


@pytest.fixture(scope="module")
def manifest(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / "manifest.json").read_text())


def _manifest(**arches: str) -> dict[str, Any]:
    """A manifest with GPU targets name -> arch (and the cpu target, which has no cubin)."""
    targets: dict[str, Any] = {"cpu": {"arch": "interpreter", "tiling": "cpu", "grid": 2}}
    for name, arch in arches.items():
        targets[name] = {"arch": arch, "tiling": "gpu", "grid": get_target(name).sms,
                         "cubin": f"kernels/{name}.cubin"}
    return {"targets": targets}


# ---- target selection ---------------------------------------------------------------------------


def test_arch_rules() -> None:
    assert zl.arch_cc("sm_86") == 86 and zl.arch_cc("sm_90a") == 90 and zl.arch_cc("interpreter") is None
    assert zl.cubin_runs_on("sm_86", 86)
    assert zl.cubin_runs_on("sm_80", 86) and zl.cubin_runs_on("sm_80", 89)  # newer minor, same major
    assert not zl.cubin_runs_on("sm_86", 80)  # never an older minor
    assert not zl.cubin_runs_on("sm_89", 90) and not zl.cubin_runs_on("sm_86", 90)  # never across majors
    assert zl.cubin_runs_on("sm_90", 90)
    assert not zl.cubin_runs_on("sm_90", 100)  # Triton builds sm_90a: Hopper only
    assert not zl.cubin_runs_on("interpreter", 86)


def test_select_target_prefers_exact_then_grid(manifest: dict[str, Any]) -> None:
    assert zl.select_target(manifest, 86) == "a10"
    assert zl.select_target(manifest, 80) == "a100"
    assert zl.select_target(manifest, 90) == "h100"
    assert zl.select_target(manifest, 87) == "a10"  # sm_86 runs on sm_87; exact sm_80 is not preferred
    assert zl.select_target(manifest, 89, sms=58) == "a10"  # L4: the newest compatible minor
    m = _manifest(a100="sm_80", a10="sm_86")
    assert zl.select_target(m, 86) == "a10"
    m = _manifest(h100="sm_90", h200="sm_90")
    assert zl.select_target(m, 90, sms=132) in ("h100", "h200")
    m["targets"]["h200"]["grid"] = 140
    assert zl.select_target(m, 90, sms=140) == "h200"


def test_select_target_error_names_gpu_cubins_and_target() -> None:
    m = _manifest(a10="sm_86", h100="sm_90")
    with pytest.raises(zl.CudaError) as e:
        zl.select_target(m, 80, device_name="NVIDIA A100-SXM4-80GB", sms=108)
    assert str(e.value) == ("this GPU is sm_80 (NVIDIA A100-SXM4-80GB); the bundle has cubins for sm_86 (a10), "
                            "sm_90 (h100); recompile with --target a100")
    with pytest.raises(zl.CudaError, match=r"sm_89 \(NVIDIA L4\).*--target l4"):
        zl.select_target(_manifest(h100="sm_90"), 89, device_name="NVIDIA L4", sms=58)
    with pytest.raises(zl.CudaError, match="no GPU cubins .*--target h200"):
        zl.select_target(_manifest(), 90, sms=132, device_name="NVIDIA H200")
    with pytest.raises(zl.CudaError, match="no compile target for sm_120"):
        zl.select_target(_manifest(h100="sm_90"), 120)


def test_select_target_error_on_real_bundle(manifest: dict[str, Any]) -> None:
    with pytest.raises(zl.CudaError) as e:
        zl.select_target(manifest, 75, device_name="Tesla T4", sms=40)
    msg = str(e.value)
    assert msg.startswith("this GPU is sm_75 (Tesla T4); the bundle has cubins for ")
    assert all(f"{manifest['targets'][t]['arch']} ({t})" in msg for t in TARGETS)


# ---- launch configuration and parameters ----------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_launch_config_matches_manifest(manifest: dict[str, Any], target: str) -> None:
    t = manifest["targets"][target]
    md = t["metadata"]
    cfg = zl.LaunchConfig.from_manifest(manifest, target)
    assert cfg.function == md["name"] == manifest["kernel"]["entry"]
    assert cfg.block == 32 * md["num_warps"]
    assert cfg.shared == md["shared"]
    assert cfg.needs_shared_opt_in == (md["shared"] > 48 * 1024)
    assert cfg.grid == t["grid"] == get_target(target).sms
    assert cfg.cubin == t["cubin"] and cfg.arch == t["arch"]
    assert cfg.global_scratch == zl.Scratch(md["global_scratch_size"], md["global_scratch_align"])
    assert cfg.profile_scratch == zl.Scratch(md["profile_scratch_size"], md["profile_scratch_align"])
    assert [p["name"] for p in cfg.params] == [p["name"] for p in t["params"]]
    assert zl.LaunchConfig.from_manifest(manifest, target, sms=7).grid == 7  # this GPU's SMs win


def test_launch_config_errors(manifest: dict[str, Any]) -> None:
    with pytest.raises(zl.CudaError, match="no GPU target 'cpu'"):
        zl.LaunchConfig.from_manifest(manifest, "cpu")
    with pytest.raises(zl.CudaError, match="no GPU target 'l4'.*a10, h100, a100"):
        zl.LaunchConfig.from_manifest(manifest, "l4")
    m = json.loads(json.dumps(manifest))
    m["targets"]["a10"]["metadata"]["launch_cooperative_grid"] = True
    with pytest.raises(zl.CudaError, match="cooperative"):
        zl.LaunchConfig.from_manifest(m, "a10")


def test_scratch_sizes() -> None:
    assert zl.Scratch(0, 1).nbytes(132) == 0  # NULL
    assert zl.Scratch(256, 128).nbytes(132) == 256 * 132
    assert zl.align_up(1000, 256) == 1024 and zl.align_up(1024, 256) == 1024 and zl.align_up(5, 1) == 5


def _pointers(params: list[dict[str, Any]]) -> dict[str, int]:
    return {p["name"]: 0 if p.get("hidden") else 0x7F0000000000 + 0x1000 * i for i, p in enumerate(params)}


@pytest.mark.parametrize("target", TARGETS)
def test_pack_params_in_manifest_order(manifest: dict[str, Any], target: str) -> None:
    params = manifest["targets"][target]["params"]
    names = [p["name"] for p in params]
    assert names[:9] == manifest["kernel"]["params"] == ["TASKS", "DI", "DF", "CTRL", "CNT", "W", "Q", "P", "A"]
    assert names[9:] == ["global_scratch", "profile_scratch"]
    assert all(p.get("hidden") for p in params[9:])
    ptrs = _pointers(params)
    packed = zl.pack_params(params, dict(reversed(list(ptrs.items()))))  # dict order does not matter
    assert packed.names == tuple(names) and len(packed) == 11
    # what cuLaunchKernel reads: void*[11], each pointing at one 8-byte value, in manifest order
    arr = (ctypes.c_void_p * 11).from_address(packed.address)
    got = [ctypes.c_uint64.from_address(int(arr[i] or 0)).value for i in range(11)]
    assert got == [ptrs[n] for n in names]
    assert packed.as_dict() == ptrs


def test_pack_params_errors(manifest: dict[str, Any]) -> None:
    params = manifest["targets"]["a10"]["params"]
    ptrs = _pointers(params)
    with pytest.raises(zl.CudaError, match="missing global_scratch, profile_scratch"):
        zl.pack_params(params, {k: v for k, v in ptrs.items() if "scratch" not in k})
    with pytest.raises(zl.CudaError, match="unknown BIAS"):
        zl.pack_params(params, {**ptrs, "BIAS": 1})
    with pytest.raises(zl.CudaError, match="missing A; unknown X"):
        zl.pack_params(params, {**{k: v for k, v in ptrs.items() if k != "A"}, "X": 1})
    with pytest.raises(zl.CudaError, match="not pointers: N"):
        zl.pack_params([*params, {"name": "N", "type": "i32"}], {**ptrs, "N": 3})
    with pytest.raises(zl.CudaError, match="twice"):
        zl.pack_params([*params, params[0]], ptrs)
    with pytest.raises(zl.CudaError, match="invalid pointer value for W"):
        zl.pack_params(params, {**ptrs, "W": -1})


def test_read_safetensors_matches_safetensors(bundle: Path) -> None:
    from safetensors.torch import load_file

    want = load_file(str(bundle / "weights.safetensors"))
    got = zl.read_safetensors(bundle / "weights.safetensors")
    assert got["W"][0] == "BF16" and got["P"][0] == "F32"
    assert np.array_equal(got["W"][1], want["W"].view(__import__("torch").int16).numpy().view(np.uint16))
    assert np.array_equal(got["P"][1], want["P"].numpy())
    tab = zl.read_safetensors(bundle / "tables" / "gpu.safetensors")
    want_t = load_file(str(bundle / "tables" / "gpu.safetensors"))
    for k in ("tasks", "desc_int", "desc_float"):
        assert np.array_equal(tab[k][1], want_t[k].numpy())
    bad = bundle.parent / "bad.safetensors"
    bad.write_bytes(b"\x01")
    with pytest.raises(zl.CudaError, match="unreadable safetensors"):
        zl.read_safetensors(bad)


# ---- the host protocol over a fake driver ----------------------------------------------------------


class FakeDriver:
    """Device memory is host memory (so 'device pointers' are real addresses), the stream runs
    each operation at once, and the 'cubin' is a toy kernel with the megakernel's control-block
    contract: OUT_TOKEN = f(tokens, past), logits rows written into A, auto-advance in decode."""

    def __init__(self, cc: int = 90, sms: int = 132, name: str = "Fake H100", driver: int = 13000) -> None:
        self.cc, self.sms, self.name, self.driver = cc, sms, name, driver
        self.refuse: dict[bytes, int] = {}  # image -> the CUresult cuModuleLoadData answers
        self.stuck_images: set[bytes] = set()  # a launch of these never finishes (cuStreamQuery: not ready)
        self.on_launch: Any = None  # (ptrs, image) -> None: what the "kernel" also does
        self.queries = 0
        self._pending: bytes | None = None
        self.buffers: dict[int, Any] = {}
        self.host: dict[int, Any] = {}
        self.launches: list[dict[str, Any]] = []
        self.capturing: list[Any] | None = None
        self.graph_launches = 0
        self.syncs = 0
        self.activations = 0
        self.closed = False
        self.image = b""
        self.images: list[bytes] = []  # every loaded module, in load order
        self.flag_error = 0
        self.leave_counters = False
        self.vocab = 256
        self.layout: dict[str, Any] = {}
        self.names: list[str] = []

    def open(self, index: int) -> zd.DeviceInfo:
        if index != 0:
            raise zl.CudaError(f"CUDA device {index} does not exist (this machine has 1)")
        return zd.DeviceInfo(index, self.name, self.cc, self.sms)

    def driver_version(self) -> int:
        return self.driver

    def activate(self) -> None:
        self.activations += 1

    def load_function(self, image: bytes, name: str, shared: int) -> Any:
        if image in self.refuse:
            code = self.refuse[image]
            err = zl.LOAD_FALLBACK_ERRORS.get(code, "CUDA_ERROR_OUT_OF_MEMORY")
            raise zl.CudaLoadError(f"cuModuleLoadData failed: {err} ({code})", code=code, name=err)
        self.image, self.fn_name, self.fn_shared = image, name, shared
        self.images.append(image)
        return ("fn", len(self.images) - 1)

    def alloc(self, nbytes: int) -> int:
        buf = ctypes.create_string_buffer(max(nbytes, 1))
        self.buffers[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free(self, ptr: int) -> None:
        del self.buffers[ptr]

    def host_alloc(self, nbytes: int, mapped: bool) -> tuple[int, int]:
        buf = ctypes.create_string_buffer(max(nbytes, 1))
        addr = ctypes.addressof(buf)
        self.host[addr] = buf
        return addr, addr if mapped else 0

    def host_free(self, addr: int) -> None:
        del self.host[addr]

    def stream(self) -> Any:
        return "stream"

    def _op(self, fn: Any, *args: Any) -> None:
        if self.capturing is not None:
            self.capturing.append((fn, args))
        else:
            fn(*args)

    def htod(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self._op(ctypes.memmove, dst, src, nbytes)

    def dtoh(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self._op(ctypes.memmove, dst, src, nbytes)

    def dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._op(ctypes.memmove, dst, src, nbytes)

    def memset(self, dst: int, nbytes: int) -> None:
        ctypes.memset(dst, 0, nbytes)

    def launch(self, fn: Any, grid: int, block: int, shared: int, stream: Any, params: int) -> None:
        arr = (ctypes.c_void_p * len(self.names)).from_address(params)
        ptrs = {n: ctypes.c_uint64.from_address(int(arr[i] or 0)).value for i, n in enumerate(self.names)}
        image = self.images[fn[1]]
        self.launches.append({"grid": grid, "block": block, "shared": shared, "ptrs": ptrs, "image": image})
        self._op(self._kernel, ptrs)
        if self.on_launch is not None:
            self.on_launch(ptrs, image)
        if image in self.stuck_images:
            self._pending = image

    def _kernel(self, ptrs: dict[str, int]) -> None:
        c = np.ctypeslib.as_array((ctypes.c_int32 * (fmt.CTRL_TOKENS + 1)).from_address(ptrs["CTRL"]))
        T, past, mode = int(c[fmt.CTRL_T]), int(c[fmt.CTRL_PAST]), int(c[fmt.CTRL_MODE])
        toks = np.ctypeslib.as_array((ctypes.c_int32 * T).from_address(ptrs["CTRL"] + 4 * fmt.CTRL_TOKENS))
        lg = self.layout["logits"]
        rows = np.ctypeslib.as_array((ctypes.c_float * (lg["rows"] * lg["cols"])).from_address(
            ptrs["A"] + 4 * lg["offset"])).reshape(lg["rows"], lg["cols"])
        targets = [toy_next(int(toks[r]), past + r, self.vocab) for r in range(T)]
        for r in range(T):
            rows[r] = -np.abs(np.arange(lg["cols"]) - targets[r]).astype(np.float32)
        c[fmt.CTRL_OUT_TOKEN] = targets[-1]
        if self.flag_error:
            c[fmt.CTRL_ERROR] |= self.flag_error
        if self.leave_counters:
            ctypes.c_int32.from_address(ptrs["CNT"] + 4 * fmt.CNT_EVENTS).value = 3
        if mode == fmt.MODE_DECODE and c[fmt.CTRL_AUTO_ADVANCE]:
            c[fmt.CTRL_TOKENS] = c[fmt.CTRL_OUT_TOKEN]
            c[fmt.CTRL_PAST] = past + 1

    def sync(self, stream: Any) -> None:
        if self._pending is not None:
            raise AssertionError("cuStreamSynchronize on a launch that never finishes: the process would hang")
        self.syncs += 1

    def query(self, stream: Any) -> bool:
        self.queries += 1
        return self._pending is None

    def begin_capture(self, stream: Any) -> None:
        self.capturing = []

    def end_capture(self, stream: Any) -> Any:
        ops, self.capturing = self.capturing, None
        return ops

    def graph_launch(self, graph: Any, stream: Any) -> None:
        self.graph_launches += 1
        for fn, args in graph:
            fn(*args)

    def graph_free(self, graph: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def toy_next(token: int, pos: int, vocab: int) -> int:
    return (token * 7 + pos * 3 + 1) % vocab


def toy_generate(prompt: list[int], n: int, vocab: int) -> list[int]:
    out, tok = [], toy_next(prompt[-1], len(prompt) - 1, vocab)
    for i in range(n):
        out.append(tok)
        tok = toy_next(tok, len(prompt) + i, vocab)
    return out


def _fake_backend(bundle: Path, manifest: dict[str, Any], *, ctrl: str = "mapped", debug: bool = False,
                  **kw: Any) -> tuple[zc.CudaBackend, FakeDriver]:
    drv = FakeDriver(**kw)
    drv.layout = manifest["tilings"]["gpu"]["layout"]
    drv.vocab = manifest["model"]["vocab"]
    target = zl.select_target(manifest, drv.cc, sms=drv.sms)
    drv.names = [p["name"] for p in manifest["targets"][target]["params"]]
    return zc.CudaBackend(bundle, manifest, driver=drv, ctrl=ctrl, debug=debug), drv


def _bytes(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


def test_backend_uploads_bundle_and_launches_per_manifest(bundle: Path, manifest: dict[str, Any]) -> None:
    be, drv = _fake_backend(bundle, manifest, cc=86, sms=80, name="NVIDIA GeForce RTX 3090")
    try:
        assert be.config.target == "a10" and be.config.grid == 80  # the device's SM count
        # two kernels of one source: the decode kernel (the target's cubin) and the prefill one
        decode_img = (bundle / "kernels" / "a10.cubin").read_bytes()
        prefill_img = (bundle / manifest["targets"]["a10"]["prefill"]["cubin"]).read_bytes()
        assert drv.images == [decode_img, prefill_img] and decode_img != prefill_img
        # the last module loaded is the prefill kernel's, with its own shared memory
        assert drv.fn_name == "zlc_megakernel"
        assert drv.fn_shared == manifest["targets"]["a10"]["prefill"]["metadata"]["shared"]
        w = zl.read_safetensors(bundle / "weights.safetensors")
        t = zl.read_safetensors(bundle / "tables" / "gpu.safetensors")
        p = be.pointers
        assert _bytes(p["W"], zl.arena_bytes(manifest, "W")) == w["W"][1].tobytes()
        assert _bytes(p["P"], zl.arena_bytes(manifest, "P")) == w["P"][1].tobytes()
        for name, key in (("TASKS", "tasks"), ("DI", "desc_int"), ("DF", "desc_float")):
            assert _bytes(p[name], t[key][1].nbytes) == t[key][1].tobytes()
        lay = manifest["tilings"]["gpu"]["layout"]
        assert _bytes(p["CNT"], 4 * lay["counters_size"]) == bytes(4 * lay["counters_size"])
        for params in (be.params, be.prefill_params):  # each kernel's scratch (none for these cubins)
            assert params.as_dict()["global_scratch"] == 0 and params.as_dict()["profile_scratch"] == 0
        assert p["CTRL"] in drv.host  # mapped pinned host memory, not a device buffer
        assert _bytes(p["A"], 4 * lay["a_size"]) == bytes(4 * lay["a_size"])  # zeroed like the interpreter's

        tok, lg = be.launch(fmt.MODE_PREFILL, [5, 6, 7], 0, False, True)
        assert drv.activations >= 1
        assert tok == toy_next(7, 2, drv.vocab)
        assert lg is not None and lg.shape == (1, lay["logits"]["cols"]) and int(lg.argmax()) == tok
        L = drv.launches[-1]
        assert (L["grid"], L["block"]) == (80, 32 * 8) and L["image"] == prefill_img  # a prefill launch
        assert L["shared"] == manifest["targets"]["a10"]["prefill"]["metadata"]["shared"]
        assert {k: v for k, v in L["ptrs"].items() if "scratch" not in k} == \
            {k: v for k, v in p.items() if "scratch" not in k}
        c = be.ctrl
        assert (c[fmt.CTRL_MODE], c[fmt.CTRL_T], c[fmt.CTRL_PAST], c[fmt.CTRL_ALL_LOGITS]) == (0, 3, 0, 0)
        tok2, lg2 = be.launch(fmt.MODE_DECODE, [tok], 3, False, False)
        assert lg2 is None and tok2 == toy_next(tok, 3, drv.vocab)
        assert drv.launches[-1]["image"] == decode_img  # a decode launch runs the decode kernel
        _, all_lg = be.launch(fmt.MODE_PREFILL, [1, 2], 4, True, True)
        assert all_lg is not None and all_lg.shape == (2, lay["logits"]["cols"])
        assert all_lg.argmax(1).tolist() == [toy_next(1, 4, drv.vocab), toy_next(2, 5, drv.vocab)]
    finally:
        be.close()
    assert drv.closed and not drv.buffers and not drv.host  # everything freed


@pytest.mark.parametrize("ctrl", ["mapped", "device"])
def test_session_and_decode_chain(bundle: Path, manifest: dict[str, Any], ctrl: str) -> None:
    be, drv = _fake_backend(bundle, manifest, ctrl=ctrl)
    chunk = manifest["tilings"]["gpu"]["layout"]["chunk"]
    vocab = manifest["model"]["vocab"]
    try:
        if ctrl == "device":
            assert be.pointers["CTRL"] in drv.buffers
        sess = MegakernelSession(be, chunk=chunk, max_seq=manifest["model"]["max_seq"], vocab=vocab)
        prompt = [(3 + 5 * i) % vocab for i in range(40)]
        n_new = manifest["model"]["max_seq"] - len(prompt)
        assert sess.generate(prompt, n_new) == toy_generate(prompt, n_new, vocab)
        # the same tokens from one host synchronisation, queued and as a CUDA graph
        sess.reset()
        first, _ = sess.prefill(prompt[:10])
        syncs = drv.syncs
        chain = be.decode_chain(first, 10, 20)
        assert drv.syncs == syncs + 1
        assert [first, *chain] == toy_generate(prompt[:10], 21, vocab)
        launches = len(drv.launches)
        assert be.decode_chain(first, 10, 20, graph=True) == chain
        assert len(drv.launches) == launches + 20 and drv.graph_launches == 1
        assert be.decode_chain(first, 10, 20, graph=True) == chain  # replayed, not captured again
        assert len(drv.launches) == launches + 20 and drv.graph_launches == 2
        assert be.ctrl[fmt.CTRL_AUTO_ADVANCE] == 0
        # a plain launch after a chain does not auto-advance
        tok, _ = be.launch(fmt.MODE_DECODE, [9], 30, False, False)
        assert tok == toy_next(9, 30, vocab) and be.ctrl[fmt.CTRL_PAST] == 30
        with pytest.raises(zl.CudaError, match="exceed max_seq"):
            be.decode_chain(first, 60, 10)
        with pytest.raises(zl.CudaError, match="takes 1"):
            be.launch(fmt.MODE_PREFILL, list(range(chunk + 1)), 0, False, False)
    finally:
        be.close()


def test_batched_launch_host_protocol(bundle: Path, manifest: dict[str, Any]) -> None:
    """TritonBatch on the cuda executor (over the fake driver: the host's side of a batched
    launch, which the interpreter tests cannot see): A holds the batch block and the page pool past
    the layout's buffers; each step copies the block the kernel reads, names it in CTRL[BATCH]
    for the prefill kernel's launch only, and reads back the logits rows asked for."""
    from zlc.runtime.batch import TritonBatch
    from zlc.runtime.paged_kv import batch_layout

    drv = FakeDriver()
    drv.layout = manifest["tilings"]["gpu"]["layout"]
    drv.vocab = manifest["model"]["vocab"]
    drv.names = [p["name"] for p in manifest["targets"][zl.select_target(manifest, drv.cc, sms=drv.sms)]["params"]]
    seen: list[tuple[int, bytes]] = []
    lay, kv_k, kv_v = batch_layout(drv.layout, manifest["model"]["max_seq"], 6, 4)

    def on_launch(ptrs: dict[str, int], image: bytes) -> None:
        word = ctypes.c_int32.from_address(ptrs["CTRL"] + 4 * fmt.CTRL_BATCH).value
        seen.append((word, _bytes(ptrs["A"] + 4 * lay.block, 4 * lay.block_words) if word else b""))

    drv.on_launch = on_launch
    tb = TritonBatch(bundle, manifest, device="cuda", page_size=4, pages=6, driver=drv)
    try:
        be = tb.nb
        assert isinstance(be, zc.CudaBackend) and be.batch is not None and be.batch == lay
        assert tb.max_rows == drv.layout["chunk"] and tb.token_floats == drv.layout["paged_kv"]["tok_floats"] > 0
        a, b = tb.open(), tb.open()
        got = tb.step([(a, [3, 4, 5]), (b, [7])], [True, False])
        assert got[1] is None and got[0] is not None and got[0].shape == (drv.layout["logits"]["cols"],)
        # the toy kernel's logits row 0 (the batched kernel gathers the lrows rows into the first rows)
        assert int(got[0].argmax()) == toy_next(3, 0, drv.vocab)
        prefill_img = (bundle / manifest["targets"][be.target]["prefill"]["cubin"]).read_bytes()
        assert drv.launches[-1]["image"] == prefill_img
        want = lay.words(kv_k, kv_v, np.array([0, 1, 2, 0]), np.array([0, 0, 0, 1]), np.array([0, 1]),
                         np.array([2]))
        assert seen[-1] == (lay.block, want.tobytes())
        assert be.ctrl[fmt.CTRL_BATCH] == 0  # ordinary launches after it see no batch
        tok, _ = be.launch(fmt.MODE_DECODE, [9], 3, False, False)
        assert seen[-1] == (0, b"") and tok == toy_next(9, 3, drv.vocab)
        got = tb.step([(b, [8]), (a, [6])], [True, True])
        assert [int(g.argmax()) for g in got if g is not None] == [toy_next(8, 0, drv.vocab), toy_next(6, 1, drv.vocab)]
        assert tb.pages_of(a) == [0] and tb.pages_of(b) == [1]
        tb.check_pages()
    finally:
        tb.close_all()
    assert drv.closed and not drv.buffers and not drv.host


def test_error_flag_and_counters(bundle: Path, manifest: dict[str, Any]) -> None:
    be, drv = _fake_backend(bundle, manifest)
    drv.flag_error = fmt.ERROR_WAIT_TIMEOUT
    with pytest.raises(zl.CudaError, match="error flags 1"):
        be.launch(fmt.MODE_DECODE, [1], 0, False, False)
    drv.flag_error = 0
    assert be.ctrl[fmt.CTRL_ERROR] == 1
    be.launch(fmt.MODE_DECODE, [1], 0, False, False)  # the host clears ERROR before a launch
    drv.leave_counters = True
    be.launch(fmt.MODE_DECODE, [1], 0, False, False)  # counters are only read back in debug mode
    be.close()
    be, drv = _fake_backend(bundle, manifest, debug=True)
    drv.leave_counters = True
    with pytest.raises(zl.CudaError, match="did not reset its counters"):
        be.launch(fmt.MODE_DECODE, [1], 0, False, False)
    be.close()
    be.close()  # idempotent


def test_weights_override(bundle: Path, manifest: dict[str, Any]) -> None:
    drv = FakeDriver()
    drv.names = [p["name"] for p in manifest["targets"]["h100"]["params"]]
    W = np.arange(manifest["weights"]["W"]["elements"], dtype=np.uint16)
    P = np.ones(manifest["weights"]["P"]["elements"], dtype=np.float32)
    be = zc.CudaBackend(bundle, manifest, driver=drv, weights={"W": W, "P": P})
    assert _bytes(be.pointers["W"], W.nbytes) == W.tobytes()
    be.close()
    with pytest.raises(zl.CudaError, match=r"W arena is 2 bytes; the manifest says \d+"):
        zc.CudaBackend(bundle, manifest, driver=FakeDriver(), weights={"W": W[:1], "P": P})
    with pytest.raises(zl.CudaError, match="no P arena"):
        zc.CudaBackend(bundle, manifest, driver=FakeDriver(), weights={"W": W})


def test_backend_errors_free_what_they_allocated(bundle: Path, manifest: dict[str, Any]) -> None:
    drv = FakeDriver(cc=75, sms=40, name="Tesla T4")
    with pytest.raises(zl.CudaError, match=r"this GPU is sm_75 \(Tesla T4\)"):
        zc.CudaBackend(bundle, manifest, driver=drv)
    assert drv.closed and not drv.buffers
    drv = FakeDriver(cc=86)
    with pytest.raises(zl.CudaError, match=r"target 'h100' \(sm_90\) does not run on this GPU \(sm_86"):
        zc.CudaBackend(bundle, manifest, driver=drv, target="h100")
    with pytest.raises(zl.CudaError, match="device 3 does not exist"):
        zc.CudaBackend(bundle, manifest, driver=FakeDriver(), device=3)
    with pytest.raises(zl.CudaError, match="ctrl must be"):
        zc.CudaBackend(bundle, manifest, driver=FakeDriver(), ctrl="zero-copy")


# ---- which cubin: toolkits, driver versions, refusals ------------------------------------------------

CUBINS = [{"cubin": "kernels/h200.cubin", "toolkit": "13.4", "ptx_isa": "9.4", "min_driver": 13000},
          {"cubin": "kernels/h200.cu129.cubin", "toolkit": "12.9", "ptx_isa": "8.8", "min_driver": 12000}]


def test_loadable_cubins_by_driver_version() -> None:
    assert zl.cuda_version(13000) == "13.0" and zl.cuda_version(12090) == "12.9"
    assert zl.loadable_cubins(CUBINS, 13000, "k") == CUBINS  # the bundle's order: Triton's own first
    assert zl.loadable_cubins(CUBINS, 13040, "k") == CUBINS
    assert zl.loadable_cubins(CUBINS, 12020, "k") == CUBINS[1:]  # a CUDA 12 driver: the 12.9 cubin only
    assert zl.loadable_cubins([{"cubin": "old.cubin"}], 11000, "k") == [{"cubin": "old.cubin"}]  # no record
    with pytest.raises(zl.CudaError) as e:
        zl.loadable_cubins(CUBINS, 11080, "target h200's decode kernel (release build)")
    msg = str(e.value)
    assert msg.startswith("the NVIDIA driver supports CUDA 11.8 but target h200's decode kernel (release build) "
                          "needs a driver for CUDA 12.0 or newer")
    assert "CUDA 13.0 (toolkit 13.4 cubin)" in msg and "\n" not in msg


def test_manifest_lists_each_toolkits_cubin(bundle: Path, manifest: dict[str, Any]) -> None:
    from zlc.codegen.aot import cubin_elf_abi

    for target in TARGETS:
        t = manifest["targets"][target]
        for kernel in (t, t["prefill"]):
            cubins = kernel["cubins"]
            assert cubins[0]["cubin"] == kernel["cubin"]
            for c in cubins:  # each really is the file it says, from the toolkit it says
                assert cubin_elf_abi((bundle / c["cubin"]).read_bytes()) == c["elf_abi"]
                assert c["min_driver"] == 1000 * int(c["toolkit"].split(".")[0])
            if t["arch"] == "sm_90":  # Triton's CUDA 13 ptxas, then the wheel's CUDA 12.9 one
                assert [c["ptxas"] for c in cubins] == ["ptxas-blackwell", "ptxas"]
                assert cubins[0]["toolkit"].startswith("13.") and cubins[1]["toolkit"] == "12.9"
                assert [c["elf_abi"] for c in cubins] == [8, 7] and cubins[1]["ptx_isa"] == "8.8"
                assert cubins[1]["cubin"].endswith(".cu129.cubin")
                assert cubins[1]["resources"]["spill_stores"] == 0
            else:  # sm_80 / sm_86: Triton already uses the CUDA 12.9 ptxas
                assert [(c["ptxas"], c["toolkit"]) for c in cubins] == [("ptxas", "12.9")]
        assert "debug" not in t and "trace" not in t["prefill"]  # diagnostic builds: --debug-waits only


def _images(bundle: Path, manifest: dict[str, Any], target: str, kernel: str = "decode",
            build: str = "release") -> list[bytes]:
    t = manifest["targets"][target]
    k = t if kernel == "decode" else t["prefill"]
    k = k if build == "release" else k[build]
    return [(bundle / c["cubin"]).read_bytes() for c in k["cubins"]]


def test_backend_falls_back_to_the_older_toolkit(bundle: Path, manifest: dict[str, Any],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    new_dec, old_dec = _images(bundle, manifest, "h100")
    new_pre, old_pre = _images(bundle, manifest, "h100", "prefill")
    # a CUDA 13.0 driver that refuses the CUDA 13.4 decode cubin: the 12.9 one from the same PTX
    drv = FakeDriver(cc=90, driver=13000)
    drv.refuse[new_dec] = 222
    drv.layout, drv.vocab = manifest["tilings"]["gpu"]["layout"], manifest["model"]["vocab"]
    drv.names = [p["name"] for p in manifest["targets"]["h100"]["params"]]
    with caplog.at_level("INFO", logger="zlc.runtime.cuda"):
        be = zc.CudaBackend(bundle, manifest, driver=drv)
    try:
        assert drv.images == [old_dec, new_pre]
        dec = be.loaded["decode/release"]
        assert dec["toolkit"] == "12.9" and dec["ptx_isa"] == "8.8"
        first = manifest["targets"]["h100"]["cubins"][0]
        assert dec["refused"] == [f"{first['cubin']} (toolkit {first['toolkit']}, PTX ISA {first['ptx_isa']}): "
                                  "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"]
        assert be.loaded["prefill/release"]["toolkit"].startswith("13.")
        logs = caplog.text
        assert "refused" in logs and "loaded kernels/h100.cu129.cubin (toolkit 12.9, PTX ISA 8.8)" in logs
        be.launch(fmt.MODE_DECODE, [1], 0, False, False)
        assert drv.launches[-1]["image"] == old_dec
    finally:
        be.close()
    # a CUDA 12.8 driver never tries a CUDA 13 cubin
    drv = FakeDriver(cc=90, driver=12080)
    zc.CudaBackend(bundle, manifest, driver=drv).close()
    assert drv.images == [old_dec, old_pre]
    # every cubin refused: one error naming each; an error that is no refusal is not retried
    drv = FakeDriver(cc=90, driver=13000)
    drv.refuse = {new_dec: 209, old_dec: 200}
    with pytest.raises(zl.CudaError, match=r"loads no cubin of target h100's decode kernel \(release build\): "
                       r".*CUDA_ERROR_NO_BINARY_FOR_GPU; .*cu129.cubin .*CUDA_ERROR_INVALID_IMAGE"):
        zc.CudaBackend(bundle, manifest, driver=drv)
    assert drv.closed and not drv.buffers
    drv = FakeDriver(cc=90, driver=13000)
    drv.refuse = {new_dec: 2}
    with pytest.raises(zl.CudaLoadError, match="OUT_OF_MEMORY"):
        zc.CudaBackend(bundle, manifest, driver=drv)


def test_driver_too_old_for_every_cubin_is_one_clear_error(bundle: Path, manifest: dict[str, Any]) -> None:
    drv = FakeDriver(cc=90, driver=11080)
    with pytest.raises(zl.CudaError) as e:
        zc.CudaBackend(bundle, manifest, driver=drv)
    msg = str(e.value)
    assert "driver supports CUDA 11.8" in msg and "needs a driver for CUDA 12.0 or newer" in msg
    assert "\n" not in msg and not drv.images and drv.closed and not drv.buffers


# ---- the debug build's first launch, the deadline, the trace build ---------------------------------------


@pytest.fixture(scope="module")
def diag(tmp_path_factory: pytest.TempPathFactory, tiny_onnx: Path) -> tuple[Path, dict[str, Any]]:
    """The tiny model for h100 with the diagnostic builds (--debug-waits): release, debug, trace."""
    out = tmp_path_factory.mktemp("cuda-diag") / "tiny.zlc"
    zlc.compile(tiny_onnx, targets=["h100"], out=out, max_seq=64, debug_waits=True, verify=False)
    return out, json.loads((out / "manifest.json").read_text())


def test_diagnostic_builds_in_the_manifest(diag: tuple[Path, dict[str, Any]]) -> None:
    bundle, man = diag
    t = man["targets"]["h100"]
    assert man["kernel"]["debug_waits"] is True
    for kernel, stem in ((t, "kernels/h100"), (t["prefill"], "kernels/h100.prefill")):
        release = (bundle / kernel["ptx"]).read_text()
        assert kernel["cubin"] == f"{stem}.cubin"  # the target's own cubin is the release build
        assert "%globaltimer" not in release and "%smid" not in release
        for build in ("debug", "trace"):
            b = kernel[build]
            assert b["cubin"] == f"{stem}.{build}.cubin" and b["ptx"] == f"{stem}.{build}.ptx"
            assert [c["toolkit"] for c in b["cubins"]][1:] == ["12.9"]
            assert all(c["resources"]["spill_stores"] == 0 for c in b["cubins"])
            assert all((bundle / c["cubin"]).is_file() for c in b["cubins"])
        trace = (bundle / kernel["trace"]["ptx"]).read_text()
        assert all(r in trace for r in ("%globaltimer", "%smid", "%clock64"))
        debug = (bundle / kernel["debug"]["ptx"]).read_text()
        assert "atom.global.relaxed.gpu.cas" in debug or ".cas.b32" in debug  # claims the error words


def _diag_backend(diag: tuple[Path, dict[str, Any]], **kw: Any) -> tuple[zc.CudaBackend, FakeDriver]:
    bundle, man = diag
    drv = FakeDriver(cc=90)
    drv.layout, drv.vocab = man["tilings"]["gpu"]["layout"], man["model"]["vocab"]
    drv.names = [p["name"] for p in man["targets"]["h100"]["params"]]
    return zc.CudaBackend(bundle, man, driver=drv, **kw), drv


def test_first_launch_of_each_kernel_runs_the_debug_build(diag: tuple[Path, dict[str, Any]]) -> None:
    bundle, man = diag
    be, drv = _diag_backend(diag)
    img = {(k, b): _images(bundle, man, "h100", k, b)[0] for k in ("decode", "prefill")
           for b in ("release", "debug")}
    try:
        assert drv.images == [img["decode", "release"], img["prefill", "release"]]  # debug: when first needed
        sess = MegakernelSession(be, chunk=be.chunk, max_seq=64, vocab=man["model"]["vocab"])
        prompt = [3, 1, 4, 1, 5]
        assert sess.generate(prompt, 4) == toy_generate(prompt, 4, man["model"]["vocab"])
        launched = [L["image"] for L in drv.launches]
        assert launched == [img["prefill", "debug"], img["decode", "debug"], *[img["decode", "release"]] * 2]
        assert be.checked == {"prefill", "decode"} and be.loaded["decode/debug"]["toolkit"].startswith("13.")
        assert drv.syncs == 2 and drv.queries >= 2  # the debug launches polled the stream, the rest synced
    finally:
        be.close()
    # decode_chain on a kernel not yet checked: the first step runs alone, checked, then the chain
    be, drv = _diag_backend(diag)
    try:
        tok, _ = be.launch(fmt.MODE_PREFILL, [7, 8], 0, False, False)
        assert be.decode_chain(tok, 2, 3) == toy_generate([7, 8], 4, man["model"]["vocab"])[1:]
        assert [L["image"] for L in drv.launches][1:] == [img["decode", "debug"], *[img["decode", "release"]] * 3]
    finally:
        be.close()
    # debug=True: every launch runs the debug build
    be, drv = _diag_backend(diag, debug=True)
    try:
        for _ in range(2):
            be.launch(fmt.MODE_DECODE, [1], 0, False, False)
        assert [L["image"] for L in drv.launches] == [img["decode", "debug"]] * 2
    finally:
        be.close()


def _lost_signal(be: zc.CudaBackend, task: int, mode: int = fmt.MODE_DECODE) -> Any:
    """A launch in which one producer of task `task`'s first wait never signalled: the counters
    as they stand once tasks 0..task were claimed, and the CTRL words the debug build writes when
    that wait times out (the template's layout)."""
    table = tr.table_tasks(be.tasks, mode)
    ev, target = table[task].waits[0]
    lost = tr.producers(table)[ev][-1]
    counts: dict[int, int] = {}
    for t in table[:task]:
        if t.index != lost and t.signal >= 0:
            counts[t.signal] = counts.get(t.signal, 0) + 1
    for g, parent, size in {(t.signal, t.parent, t.signal_target) for t in table[:task] if t.parent >= 0}:
        if counts.get(g, 0) == size:
            counts[parent] = counts.get(parent, 0) + 1
    seen = counts.get(ev, 0)
    base = int(be.tasks[2 * mode + 1])
    row = be.pointers["TASKS"] + 4 * (fmt.HEADER_WORDS + base + fmt.TASK_WORDS * task)

    def write(ptrs: dict[str, int], image: bytes) -> None:
        c = np.ctypeslib.as_array((ctypes.c_int32 * fmt.CTRL_TOKENS).from_address(ptrs["CTRL"]))
        c[fmt.CTRL_ERROR] |= fmt.ERROR_WAIT_TIMEOUT
        c[fmt.CTRL_ERR_EVENT], c[fmt.CTRL_ERR_TARGET], c[fmt.CTRL_ERR_SEEN] = ev + 1, target, seen
        c[fmt.CTRL_ERR_ROW] = np.uint32(row & 0xFFFFFFFF).view(np.int32)
        n = int(be.tasks[4])
        cnt = np.ctypeslib.as_array((ctypes.c_int32 * (fmt.CNT_EVENTS + n)).from_address(ptrs["CNT"]))
        cnt[fmt.CNT_QUEUE], cnt[fmt.CNT_EXIT] = task + 1, 0
        for e, v in counts.items():
            cnt[fmt.CNT_EVENTS + e] = v

    blocked = [t for t in table[:task + 1] if any(counts.get(e, 0) != tg for e, tg in t.waits)]
    return write, table[task], ev, target, seen, blocked, counts


def test_a_stuck_first_launch_is_reported_not_waited_for(diag: tuple[Path, dict[str, Any]]) -> None:
    bundle, man = diag
    be, drv = _diag_backend(diag, first_launch_deadline_s=0.2)
    readable = json.loads((bundle / "tables" / "gpu.json").read_text())
    labels, events = readable["tables"]["decode"], readable["events"]
    write, task, ev, target, seen, blocked, counts = _lost_signal(be, 6)
    drv.on_launch = write
    drv.stuck_images.add(_images(bundle, man, "h100", "decode", "debug")[0])
    t0 = time.monotonic()
    with pytest.raises(zl.CudaTimeout) as e:
        be.launch(fmt.MODE_DECODE, [1], 0, False, False)
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert msg.startswith("the decode kernel (debug build) did not finish within 0.2 s: error flags 1; ")
    assert (f"first timed-out wait: task 6 ({task.kind} {labels[6]['label']}) waited for event {ev} "
            f"({events[ev]}) to reach {target} and saw {seen}") in msg
    assert f"7 of {len(labels)} tasks claimed, 0 of 132 programs exited" in msg
    first = blocked[0]
    e0, t0_ = next((e, tg) for e, tg in first.waits if counts.get(e, 0) != tg)
    assert (f"task {first.index} ({first.kind} {labels[first.index]['label']}) waits for event {e0} "
            f"({events[e0]}) at {counts.get(e0, 0)} of {t0_}") in msg
    assert be.stuck and drv.syncs == 0
    with pytest.raises(zl.CudaError, match="overran its deadline"):
        be.launch(fmt.MODE_DECODE, [1], 0, False, False)
    be.close()  # no synchronize, no free: the kernel may still run (the process's exit ends it)
    assert drv.syncs == 0 and drv.buffers and not drv.closed


def test_a_timed_out_wait_names_its_task_and_event(diag: tuple[Path, dict[str, Any]]) -> None:
    bundle, man = diag
    for ctrl in ("mapped", "device"):
        be, drv = _diag_backend(diag, ctrl=ctrl)
        write, task, ev, target, seen, _, _ = _lost_signal(be, 3, fmt.MODE_PREFILL)
        drv.on_launch = write
        labels = json.loads((bundle / "tables" / "gpu.json").read_text())
        with pytest.raises(zl.CudaError, match=r"error flags 1 \(a wait timed out\): task 3 "
                           rf"\({task.kind} {re.escape(labels['tables']['prefill'][3]['label'])}\) waited for "
                           rf"event {ev} \(.*\) to reach {target} and saw {seen}$"):
            be.launch(fmt.MODE_PREFILL, [1, 2], 0, False, False)
        be.close()


def test_trace_launch_reads_the_records(diag: tuple[Path, dict[str, Any]]) -> None:
    bundle, man = diag
    be, drv = _diag_backend(diag)
    table = tr.table_tasks(be.tasks, fmt.MODE_DECODE)
    grid = be.config.grid
    trace_img = _images(bundle, man, "h100", "decode", "trace")[0]

    def records(ptrs: dict[str, int], image: bytes) -> None:  # what the trace build writes
        if image != trace_img:
            return
        words = tr.trace_words(be.tasks, grid)
        cnt = np.ctypeslib.as_array((ctypes.c_int32 * (be.trace_offset + words)).from_address(ptrs["CNT"]))
        rec = cnt[be.trace_offset:].reshape(-1, fmt.TRACE_WORDS)
        n_max = max(int(be.tasks[0]), int(be.tasks[2]))
        for t in table:
            start = (1 << 40) + 1000 * t.index
            rec[1 + t.index] = [t.index % 4, t.index % 4, start & 0xFFFFFFFF, start >> 32,
                                (start + 700) & 0xFFFFFFFF, (start + 700) >> 32, 1400, 1]
        for p in range(grid):
            rec[1 + n_max + p] = [p, p, 0, 1 << 8, 0, (1 << 8) + 1, 2000, 1]

    drv.on_launch = records
    try:
        tok, trace = be.trace_launch(fmt.MODE_DECODE, [5], 3)
        assert tok == toy_next(5, 3, man["model"]["vocab"])
        assert drv.launches[-1]["image"] == trace_img and drv.queries >= 1  # under the deadline
        assert trace.recorded.all() and trace.start.tolist() == [(1 << 40) + 1000 * i for i in range(len(table))]
        assert (trace.end - trace.start).tolist() == [700] * len(table) and trace.sm.tolist()[:5] == [0, 1, 2, 3, 0]
        assert trace.prog_tasks.tolist() == [1] * grid
        a = tr.analyze(table, trace)
        assert sum(o.tasks for o in a.ops.values()) == len(table) and a.path[-1].task == len(table) - 1
        # the records live after the counters: the counters are still zero
        cnt = np.zeros(be.cnt_words, dtype=np.int32)
        drv.dtoh(cnt.ctypes.data, be.pointers["CNT"], cnt.nbytes)
        assert not cnt.any()
    finally:
        be.close()
    be, _ = _fake_backend(*_plain(diag))
    with pytest.raises(zl.CudaError, match="no trace build of the decode kernel"):
        be.trace_launch(fmt.MODE_DECODE, [5], 3)
    be.close()


def _plain(diag: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """The diagnostic bundle's manifest without its debug and trace builds."""
    bundle, man = diag
    m = json.loads(json.dumps(man))
    for k in (m["targets"]["h100"], m["targets"]["h100"]["prefill"]):
        k.pop("debug"), k.pop("trace")
    return bundle, m


# ---- no driver, no GPU ----------------------------------------------------------------------------


def _gpu_present() -> bool:
    try:
        drv = zd.CudaDriver()
        drv.open(0)
        drv.close()
        return True
    except ZlcError:
        return False


HAS_GPU = _gpu_present()


@pytest.mark.skipif(HAS_GPU, reason="this machine has a CUDA GPU")
def test_session_cuda_without_gpu_is_one_clear_error(bundle: Path) -> None:
    b = zlc.load(bundle)
    with pytest.raises(ZlcError) as e:
        b.session("cuda")
    assert isinstance(e.value, zl.CudaError)
    assert "no CUDA driver/GPU" in str(e.value) or "pip install cuda-python" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ZlcError, match="use cuda or cuda:N"):
        b.session("cuda:x")


def test_missing_bindings_say_what_to_install(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(zl.CudaError, match="pip install cuda-python"):
        zlc.load(bundle).session("cuda")


@pytest.mark.skipif(HAS_GPU, reason="this machine has a CUDA GPU")
def test_cli_run_cuda_without_gpu(bundle: Path) -> None:
    from click.testing import CliRunner

    from zlc import cli

    res = CliRunner().invoke(cli.cli, ["run", str(bundle), "--prompt-ids", "1,2,3", "--device", "cuda",
                                       "--max-new-tokens", "2"])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    assert "no CUDA driver/GPU" in res.output or "cuda-python" in res.output


# ---- on a real GPU ----------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and driver (cuda-python); none here")
def test_real_gpu_matches_interpreter(tmp_path: Path, tiny_onnx: Path) -> None:
    drv = zd.CudaDriver()
    info = drv.open(0)
    drv.close()
    name = zl.suggest_target(info.cc, info.sms, info.name)
    if name is None:
        pytest.skip(f"zlc has no compile target for sm_{info.cc} ({info.name})")
    out = tmp_path / "tiny.zlc"
    zlc.compile(tiny_onnx, targets=[name], out=out, max_seq=64)
    b = zlc.load(out)
    prompt = [3, 14, 15, 92, 65, 35]
    with b.session("cpu") as s:
        want = s.generate(prompt, 12)
        s.reset()
        _, want_lg = s.prefill(prompt, all_logits=True, want_logits=True)
    with b.session("cuda") as s:
        assert s.generate(prompt, 12) == want
        s.reset()
        _, lg = s.prefill(prompt, all_logits=True, want_logits=True)
        assert lg is not None and want_lg is not None
        assert np.abs(lg - want_lg).max() < 1e-3
        s.reset()
        tok, _ = s.prefill(prompt)
        be = s.backend
        assert isinstance(be, zc.CudaBackend)
        assert [tok, *be.decode_chain(tok, len(prompt), 11)] == want
        assert [tok, *be.decode_chain(tok, len(prompt), 11, graph=True)] == want
    shutil.rmtree(out)


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and driver (cuda-python); none here")
def test_real_gpu_diagnostic_builds(tmp_path: Path, tiny_onnx: Path) -> None:
    """On a GPU: the cubin the driver takes, each kernel's first launch in its debug build under
    the deadline, then release launches; a traced step computes the same token and records every
    task with real SM ids and timestamps."""
    drv = zd.CudaDriver()
    info = drv.open(0)
    version = drv.driver_version()
    drv.close()
    name = zl.suggest_target(info.cc, info.sms, info.name)
    if name is None:
        pytest.skip(f"zlc has no compile target for sm_{info.cc} ({info.name})")
    out = tmp_path / "tiny.zlc"
    zlc.compile(tiny_onnx, targets=[name], out=out, max_seq=64, debug_waits=True, verify=False)
    man = json.loads((out / "manifest.json").read_text())
    prompt = [3, 14, 15, 92, 65, 35]
    with zlc.load(out).session("cpu") as s:
        want = s.generate(prompt, 6)
    be = zc.CudaBackend(out, man, first_launch_deadline_s=20.0, deadline_s=20.0)
    try:
        assert {"decode/release", "prefill/release"} <= set(be.loaded)
        assert all(int(c.get("min_driver") or 0) <= version for c in be.loaded.values())
        sess = MegakernelSession(be, chunk=be.chunk, max_seq=64, vocab=man["model"]["vocab"])
        assert sess.generate(prompt, 6) == want
        assert be.checked == {"prefill", "decode"} and "decode/debug" in be.loaded
        sess.reset()
        tok, _ = sess.prefill(prompt)
        plain, _ = be.launch(fmt.MODE_DECODE, [tok], len(prompt), False, False)
        traced, trace = be.trace_launch(fmt.MODE_DECODE, [tok], len(prompt))
        assert traced == plain == want[1]
        table = tr.table_tasks(be.tasks, fmt.MODE_DECODE)
        assert trace.recorded.all() and (trace.end >= trace.start).all()
        assert trace.sm.min() >= 0 and trace.sm.max() < info.sms and trace.prog_tasks.sum() == len(table)
        a = tr.analyze(table, trace)
        assert a.span > 0 and a.unit == "ns" and a.path and sum(o.tasks for o in a.ops.values()) == len(table)
    finally:
        be.close()
    shutil.rmtree(out)

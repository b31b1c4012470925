"""The house's rules, read from the code: which layer may import which, no import circles, no
private names crossing modules, no oversized rooms without a stated reason.

Every import counts, including the ones inside functions (a lazy import is still a dependency; it
only moves the cost). docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder -> package, as pyproject's package-dir maps them (longest prefix first)
FOLDERS = [("runtime/serve/engine", "zlc.runtime.serve.engine"),
           ("runtime/serve/ingress", "zlc.runtime.serve.ingress"), ("runtime/serve", "zlc.runtime.serve"), ("runtime", "zlc.runtime"), ("codegen", "zlc.codegen"),
           ("passes", "zlc.passes"), ("compiler", "zlc")]

# Layers, bottom up. A module may import its own package (and subpackages listed under it) and
# any package on a LOWER layer; never a package on its own layer or above. Packages on one layer
# are independent of each other (codegen and the runtime never import each other).
LAYERS: list[list[str]] = [
    ["zlc.errors", "zlc.version"],
    # the host-kernel ABI: every layout the kernels and the host share (below the IR's formats and
    # the bundle, which re-export parts of it)
    ["zlc.abi"],
    ["zlc.ir", "zlc.bundle", "zlc.gguf_reader"],  # the formats: the IR, bundles, GGUF files (read)
    ["zlc.reference", "zlc.targets", "zlc.testing"],
    ["zlc.frontend", "zlc.passes"],
    ["zlc.driver"],
    ["zlc.codegen", "zlc.runtime", "zlc.deploy"],
    # the verifier says whether a model fits the megakernel (runs codegen's scheduler check); the
    # kernel model reads back what codegen wrote (cubins, tables) and needs its toolchain lookup
    # the serving wire (zlc.runtime.serve: protocol, rings, engine_stats): what both serving
    # processes share, below both
    ["zlc.verifier", "zlc.kernelmodel", "zlc.memory", "zlc.runtime.serve"],  # zlc.memory: the compile's peak RSS, the room check
    # the serving wings, one per process: the engine process's and the ingress's (zlc serve's own);
    # on one layer, so neither imports the other
    ["zlc.build", "zlc.runtime.serve.engine", "zlc.runtime.serve.ingress"],
    ["zlc.cli"],
    ["zlc"],  # the public face (lazy: it names the modules it loads on first use)
]
LAYER = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}


def group(module: str) -> str:
    """The layer table entry a module belongs to (its longest listed prefix)."""
    best = "zlc"
    for pkg in LAYER:
        if (module == pkg or module.startswith(pkg + ".")) and len(pkg) > len(best):
            best = pkg
    return best


def modules() -> Iterator[tuple[str, Path, bool]]:
    """(dotted name, path, is_package) of every module of the installed package."""
    seen = set()
    for folder, pkg in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in seen or "__pycache__" in path.parts:
                continue
            seen.add(path)
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([pkg, *parts]), path, path.name == "__init__.py"


def imports(module: str, path: Path, is_pkg: bool) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    here = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [a.name for a in node.names]
            # `from pkg import submodule` imports the submodule
            yield mod, names, node.lineno


ALL = {m: (p, is_pkg) for m, p, is_pkg in modules()}


def _target(mod: str, name: str) -> str:
    """`from mod import name`: the submodule when `name` is one, else `mod`."""
    return f"{mod}.{name}" if f"{mod}.{name}" in ALL else mod


def edges() -> Iterator[tuple[str, str, int, list[str]]]:
    for m, (p, is_pkg) in ALL.items():
        for mod, names, line in imports(m, p, is_pkg):
            if not (mod == "zlc" or mod.startswith("zlc.")):
                continue
            targets = {_target(mod, n) for n in names} or {mod}
            for t in targets:
                yield m, t, line, [n for n in names if _target(mod, n) == t]


def test_layers_only_import_downwards() -> None:
    bad = []
    for src, dst, line, _ in edges():
        gs, gd = group(src), group(dst)
        if gs == gd or dst.startswith(src + ".") or gs == "zlc":
            continue
        if LAYER[gd] >= LAYER[gs]:
            bad.append(f"{ALL[src][0].relative_to(ROOT)}:{line}: {src} ({gs}, layer {LAYER[gs]}) imports "
                       f"{dst} ({gd}, layer {LAYER[gd]})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


@pytest.mark.parametrize("lower,upper", [
    ("zlc.passes", "zlc.runtime"), ("zlc.codegen", "zlc.runtime"), ("zlc.runtime", "zlc.codegen"),
    ("zlc.runtime", "zlc.frontend"), ("zlc.runtime", "zlc.passes"), ("zlc.reference", "zlc.passes"),
])
def test_named_directions(lower: str, upper: str) -> None:
    """The issue's own examples of the rule, spelled out (the layer test implies them)."""
    hits = [f"{src} -> {dst}" for src, dst, _, _ in edges()
            if group(src) == lower and (dst == upper or dst.startswith(upper + "."))
            and not (upper == "zlc.runtime" and dst.startswith("zlc.runtime.serve") and lower == "zlc.runtime")]
    assert not hits, hits


WIRE = "zlc.runtime.serve"
WINGS = ("zlc.runtime.serve.engine", "zlc.runtime.serve.ingress")


@pytest.mark.parametrize("src,dst", [(WINGS[0], WINGS[1]), (WINGS[1], WINGS[0]), (WIRE, WINGS[0]), (WIRE, WINGS[1])])
def test_serving_wings_meet_only_at_the_wire(src: str, dst: str) -> None:
    """The engine process's modules and the ingress's never import each other; the wire they share
    (protocol, rings, engine_stats) imports neither (the layer test implies it; spelled out)."""
    hits = [f"{s}:{line} -> {d}" for s, d, line, _ in edges()
            if group(s) == src and (d == dst or d.startswith(dst + "."))]
    assert not hits, hits


def test_the_wire_is_what_both_wings_import() -> None:
    """Each wing does import the wire (the table above is not vacuous)."""
    for wing in WINGS:
        assert any(group(s) == wing and group(d) == WIRE for s, d, _, _ in edges()), wing


def test_no_import_circles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in ALL}
    for src, dst, _, _ in edges():
        if dst in ALL and dst != src and not (ALL[src][1] and dst.startswith(src + ".")):
            graph[src].add(dst)
    # a package's __init__ may hand on its submodules' names; the submodules must not import it back
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _is_module(pkg: str, name: str) -> bool:
    """A private *module* (the `_rings` C extension) may be imported by its package's wrapper."""
    path = ALL.get(pkg, (None, False))[0]
    return path is not None and path.name == "__init__.py" and any(path.parent.glob(f"{name}.*"))


def test_no_private_names_cross_modules() -> None:
    bad = [f"{ALL[src][0].relative_to(ROOT)}:{line}: {', '.join(private)} from {dst}"
           for src, dst, line, names in edges()
           if dst != src and (private := [n for n in names if n.startswith("_") and not n.startswith("__")
                                          and not _is_module(dst, n)])]
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


MAX_LINES = 600


def test_rooms_are_small_or_say_why() -> None:
    """A module over MAX_LINES states why near its top ("Why one module: ...")."""
    big = []
    for p, _ in ALL.values():
        text = p.read_text()
        if text.count("\n") > MAX_LINES and "Why one module" not in text[:4000]:
            big.append(f"{p.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert not big, "modules over the size limit without a stated reason:\n" + "\n".join(big)


def test_templates_are_small_rooms() -> None:
    """The kernel templates are rooms too: every *.jinja file at most MAX_LINES lines, no exemption
    (a long kernel is a table of contents that includes one file per op body or concern)."""
    files = sorted({p for folder, _ in FOLDERS for p in (ROOT / folder).rglob("*.jinja")})
    assert any(p.name == "megakernel.c.jinja" for p in files) and any(p.name == "megakernel.py.jinja" for p in files)
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in files if (n := p.read_text().count("\n")) > MAX_LINES]
    assert not big, "templates over the size limit (split them into included files):\n" + "\n".join(big)


def test_the_layer_table_covers_every_package() -> None:
    packages = {m for m, (_, is_pkg) in ALL.items() if is_pkg}
    missing = sorted(p for p in packages if group(p) != p and not any(p.startswith(g + ".") for g in LAYER
                                                                       if g != "zlc"))
    assert not missing, f"packages not placed on a layer: {missing}"

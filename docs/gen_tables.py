"""Generates the docs' tables that code declares: docs/ir.md's op tables from `zlc.ir.OPS` (names,
arity, docs) and docs/megakernel.md's descriptor tables from `zlc.abi.descriptors` (each op's
words and what they mean).

    python docs/gen_tables.py            # print the tables (markdown)
    python docs/gen_tables.py --write    # replace the generated sections of the docs
    python docs/gen_tables.py --check    # exit 1 if a doc is out of date

Each section lives between BEGIN/END markers, so the prose around it is hand-written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zlc.abi import DESCS
from zlc.ir import OPS, OpDef

DOCS = Path(__file__).resolve().parent


def arity(d: OpDef) -> str:
    if d.max_inputs == -1:
        return f"{d.min_inputs}+"
    if d.min_inputs == d.max_inputs:
        return str(d.min_inputs)
    return f"{d.min_inputs}–{d.max_inputs}"


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def undocumented(d: OpDef) -> str:
    """What an op-level op without a doc string means: its ONNX namesake, by arity."""
    if d.level == "transformer":
        return "(undocumented)"
    if d.min_inputs == d.max_inputs == 1:
        return "elementwise, as in ONNX"
    if d.min_inputs == d.max_inputs == 2:
        return "elementwise with numpy broadcasting, as in ONNX"
    return "as in ONNX"


def table(defs: list[OpDef]) -> list[str]:
    rows = ["| op | inputs | semantics |", "|---|---|---|"]
    rows += [f"| `{d.name}` | {arity(d)} | {cell(d.doc) or undocumented(d)} |" for d in defs]
    return rows


def render_ops() -> list[str]:
    transformer = [d for d in OPS.values() if d.level == "transformer"]
    primitive = sorted((d for d in OPS.values() if d.level != "transformer"), key=lambda d: d.name)
    lines = ["", f"### Transformer-level ops ({len(transformer)})", ""]
    lines += table(transformer)
    lines += ["", f"### Op-level ops ({len(primitive)})", ""]
    lines += table(primitive)
    return lines + [""]


def render_descriptors() -> list[str]:
    lines = []
    for desc in DESCS:
        fs = sorted(desc.fields.values(), key=lambda f: (f.is_float, f.word))
        lines += ["", f"**{desc.__name__}** (`{fs[0].op}`): {cell(desc.__doc__ or '')}", "",
                  "| word | field | template name | meaning |", "|---|---|---|---|"]
        for f in fs:
            when = f" (when {f.when})" if f.when else ""
            lines.append(f"| {'DF' if f.is_float else 'DI'} {f.word} | `{f.name}` | `{f.constant}` | {cell(f.doc)}{when} |")
    return lines + [""]


# (doc, what its markers call the section, renderer)
SECTIONS = [("ir.md", "OPS", render_ops), ("megakernel.md", "DESCRIPTORS", render_descriptors)]


def markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN GENERATED {name} (python docs/gen_tables.py --write) -->", f"<!-- END GENERATED {name} -->"


def spliced(path: Path, doc: str, name: str, section: str) -> str:
    begin, end = markers(name)
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path}: markers missing; add\n{begin}\n{end}")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + begin + section + end + tail


def main(argv: list[str]) -> int:
    stale = []
    for doc, name, render in SECTIONS:
        path = DOCS / doc
        section = "\n" + "\n".join(render()) + "\n"
        if "--write" not in argv and "--check" not in argv:
            print(section)
            continue
        current = path.read_text()
        wanted = spliced(path, current, name, section)
        if current != wanted:
            stale.append(path)
            if "--write" in argv:
                path.write_text(wanted)
    if "--check" in argv and stale:
        print(f"out of date: {', '.join(map(str, stale))}: run python docs/gen_tables.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

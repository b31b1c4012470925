"""Generates the op tables of docs/ir.md from `zlc.ir.OPS` (names, arity, docs).

    python docs/gen_ops.py            # print the tables (markdown)
    python docs/gen_ops.py --write    # replace the generated section of docs/ir.md
    python docs/gen_ops.py --check    # exit 1 if docs/ir.md is out of date

The section lives between the BEGIN/END markers below, so the prose around it is hand-written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zlc.ir import OPS, OpDef

IR_MD = Path(__file__).resolve().parent / "ir.md"
BEGIN = "<!-- BEGIN GENERATED OPS (python docs/gen_ops.py --write) -->"
END = "<!-- END GENERATED OPS -->"


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


def render() -> str:
    transformer = [d for d in OPS.values() if d.level == "transformer"]
    primitive = sorted((d for d in OPS.values() if d.level != "transformer"), key=lambda d: d.name)
    lines = [BEGIN, "", f"### Transformer-level ops ({len(transformer)})", ""]
    lines += table(transformer)
    lines += ["", f"### Op-level ops ({len(primitive)})", ""]
    lines += table(primitive)
    lines += ["", END]
    return "\n".join(lines)


def spliced(doc: str, section: str) -> str:
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{IR_MD}: markers missing; add\n{BEGIN}\n{END}")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + section + tail


def main(argv: list[str]) -> int:
    section = render()
    if "--write" in argv or "--check" in argv:
        current = IR_MD.read_text()
        wanted = spliced(current, section)
        if "--check" in argv:
            if current != wanted:
                print(f"{IR_MD} is out of date: run python docs/gen_ops.py --write", file=sys.stderr)
                return 1
            return 0
        IR_MD.write_text(wanted)
        return 0
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

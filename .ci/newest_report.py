"""What the newest releases change for zlc: run by .ci/try-newest inside a venv that has them.

    python .ci/newest_report.py [--lock .ci/constraints.txt] [--against PYTHON] [--no-tests]

1. The packages whose installed version differs from the lock's.
2. The model-family tests (FAMILY_TESTS, slow ones included) run here; the failures are grouped by
   the zoo family their test id names, so the verdict reads "falcon: 3 tests" and not a log.
3. With --against (the locked venv's python): each family's stateless export is made with both
   sets of versions and the op histograms compared, so a changed export form shows even where
   raising still recognises it.

It informs a decision (refresh the lock, or raise a new form first); it is not part of the gate.
Exit status: 0 whatever the tests say, unless the script itself cannot run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The tests whose outcome depends on what the exporters (transformers, torch, onnxscript,
#: onnxruntime-genai) make of the zoo's families and the real model.
FAMILY_TESTS = [
    "tests/test_family_alibi_falcon.py", "tests/test_family_half.py", "tests/test_family_moe.py",
    "tests/test_family_norms.py", "tests/test_family_torch_rotary.py", "tests/test_family_windows.py",
    "tests/test_torch_route.py", "tests/test_torch_route_families.py", "tests/test_verify_models.py",
    "tests/test_zoo.py", "tests/test_export_forms.py", "tests/frontend/test_onnx_zoo.py",
    "tests/test_smollm2_bundle.py", "tests/runtime/test_tokenizer.py",
]


def lock_pins(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith("#") and "==" in line:
            name, version = line.split("==", 1)
            pins[_norm(name)] = version.strip()
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_changes(lock: Path) -> list[tuple[str, str, str]]:
    """(package, locked, installed) for every locked package installed at another version here."""
    installed = {_norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    out = []
    for name, locked in sorted(lock_pins(lock).items()):
        have = installed.get(name, "absent")
        if have.split("+")[0] != locked.split("+")[0]:
            out.append((name, locked, have))
    return out


def run_family_tests() -> tuple[int, dict[str, list[str]], int]:
    """Runs FAMILY_TESTS; returns (tests run, {family or "(no family)": failed test ids}, exit code)."""
    from zlc.testing.families import FAMILIES

    with tempfile.TemporaryDirectory() as d:
        xml = Path(d) / "junit.xml"
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "slow or not slow", "-p", "no:cacheprovider",
                              f"--junitxml={xml}", *FAMILY_TESTS], cwd=ROOT)
        if not xml.exists():
            return 0, {"(pytest did not run)": [f"exit {rc}"]}, rc
        cases = ET.parse(xml).getroot().iter("testcase")
        total, failed = 0, {}
        for case in cases:
            total += 1
            if case.find("failure") is None and case.find("error") is None:
                continue
            test = f"{case.get('classname')}::{case.get('name')}"
            params = re.findall(r"\[(.*)\]", case.get("name") or "")
            words = re.split(r"[-,\s]+", params[0]) if params else []
            fams = [w for w in words if w in FAMILIES] or ["(no family)"]
            for fam in fams:
                failed.setdefault(fam, []).append(test)
    return total, failed, rc


def histograms() -> dict[str, dict[str, int]]:
    """{family: op histogram of its stateless opset-20 export} with this interpreter's versions."""
    from zlc.testing import zoo

    out = {}
    for fam in sorted(zoo.FAMILIES):
        try:
            out[fam] = zoo.op_histogram(zoo.cached("stateless", fam, 20))
        except Exception as e:  # an export that fails is a finding, not a crash of the report
            out[fam] = {f"(export failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})": 1}
    return out


def histogram_changes(ours: dict[str, dict[str, int]], theirs: dict[str, dict[str, int]]) -> list[str]:
    lines = []
    for fam in sorted(set(ours) | set(theirs)):
        a, b = theirs.get(fam, {}), ours.get(fam, {})
        if a == b:
            continue
        delta = {op: b.get(op, 0) - a.get(op, 0) for op in sorted(set(a) | set(b))}
        moved = ", ".join(f"{op} {n:+d}" for op, n in delta.items() if n)
        lines.append(f"  {fam}: {sum(a.values())} -> {sum(b.values())} nodes ({moved})")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lock", type=Path, default=ROOT / ".ci" / "constraints.txt")
    ap.add_argument("--against", help="the locked venv's python, to compare each family's export with")
    ap.add_argument("--no-tests", action="store_true", help="skip the family tests")
    ap.add_argument("--histograms-json", action="store_true", help=argparse.SUPPRESS)  # what --against runs
    args = ap.parse_args()
    if args.histograms_json:
        print(json.dumps(histograms()))
        return 0

    changes = version_changes(args.lock)
    print(f"== versions here that differ from {args.lock}: {len(changes) or 'none'}")
    for name, locked, have in changes:
        print(f"  {name}: {locked} -> {have}")
    if not args.no_tests:
        total, failed, rc = run_family_tests()
        print(f"== family tests with these versions (pytest exit {rc}): {total} run, "
              f"{sum(map(len, failed.values()))} failed")
        if not failed:
            print("  every family passes")
        for fam, tests in sorted(failed.items()):
            print(f"  {fam}: {len(tests)} failed")
            for t in tests:
                print(f"    {t}")
    if args.against:
        print("== stateless exports (opset 20) whose op histogram differs from the locked versions':")
        theirs = json.loads(subprocess.check_output([args.against, __file__, "--histograms-json"], cwd=ROOT))
        lines = histogram_changes(histograms(), theirs)
        print("\n".join(lines) if lines else "  none")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A plan on disk: its files written into a bundle's deploy/ folder (registered in the bundle's
manifest, so its checksums cover them) or into a plain folder, and the plan read back from the
plan.json it wrote (re-made from the inputs recorded there: topology, options, model).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from zlc.bundle import MANIFEST, add_files, atomic_write

from .planning import IRQ_SCRIPT, PLAN_VERSION, Plan, PlanOptions, plan
from .topology import DeployError, Topology

DEPLOY_DIR = "deploy"
EXECUTABLE = {IRQ_SCRIPT}  # files written with mode 0755


def _safe_rel(rel: str) -> str:
    parts = Path(rel).parts
    if Path(rel).is_absolute() or ".." in parts or not parts or rel == MANIFEST:
        raise DeployError(f"not a path inside a bundle: {rel!r}")
    if parts[0] != DEPLOY_DIR:
        raise DeployError(f"{rel}: deployment files go under {DEPLOY_DIR}/")
    return Path(rel).as_posix()


def add_bundle_files(bundle: Path | str, files: Mapping[str, bytes], *, remove: Iterable[str] = (),
                     modes: Mapping[str, int] | None = None) -> None:
    """Writes `files` ({"deploy/...": bytes}) into a bundle, registered in its manifest (see
    `zlc.bundle.add_files`), after removing `remove`. Paths must be relative and under deploy/."""
    add_files(bundle, {_safe_rel(r): d for r, d in files.items()}, remove=[_safe_rel(r) for r in remove],
              modes=modes)


def write(p: Plan, bundle: Path | str) -> list[str]:
    """Writes the plan's files into BUNDLE/deploy/ and registers them; removes what a previous plan
    wrote that this one does not (e.g. the drop-in of a GPU no longer served). Returns the paths."""
    root = Path(bundle)
    new = {f"{DEPLOY_DIR}/{k}": v for k, v in p.files.items()}
    old_plan = root / DEPLOY_DIR / "plan.json"
    old: list[str] = []
    if old_plan.is_file():
        try:
            old = [f"{DEPLOY_DIR}/{f}" for f in json.loads(old_plan.read_text()).get("files", [])]
        except ValueError:
            old = []
    add_bundle_files(root, new, remove=[f for f in old if f not in new],
                     modes={f"{DEPLOY_DIR}/{f}": 0o755 for f in EXECUTABLE})
    return sorted(new)


def write_dir(p: Plan, out: Path | str) -> list[Path]:
    """Writes the plan's files into a plain folder (`zlc deploy plan --out`); no bundle involved."""
    out = Path(out)
    paths = []
    for rel, data in p.files.items():
        atomic_write(out / rel, data, 0o755 if rel in EXECUTABLE else 0o644)
        paths.append(out / rel)
    return paths


def load_plan(deploy_dir: Path | str) -> Plan:
    """The plan a deploy/ folder was written from, re-made from its plan.json inputs."""
    d = Path(deploy_dir)
    f = d / "plan.json"
    if not f.is_file():
        raise DeployError(f"{d}: no plan.json (run `zlc deploy build BUNDLE` or `zlc deploy plan BUNDLE --out DIR`)")
    try:
        data = json.loads(f.read_text())
        if data.get("plan_version") != PLAN_VERSION:
            raise DeployError(f"{f}: plan version {data.get('plan_version')!r}; this zlc reads {PLAN_VERSION}")
        return plan(Topology.from_json(data["topology"], str(f)), PlanOptions.from_json(data["options"]),
                    model=data["model"])
    except (ValueError, KeyError, TypeError) as e:
        raise DeployError(f"{f}: unreadable plan ({type(e).__name__}: {e})") from e

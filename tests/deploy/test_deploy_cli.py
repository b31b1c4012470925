"""`zlc deploy plan/build/apply/topology` through click's CliRunner on the tiny bundle: the plan as
text and JSON, `--out` leaving the bundle alone, `build` keeping the bundle loadable, `apply
--dry-run` listing every change without making one, the run-time parts applied only where that is
safe here (a child process, fake /proc/irq, a new network namespace), and errors as one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from deploy_helpers import FAKE_INTERRUPTS, compile_tiny, copy_bundle, fake_proc_irq, synthetic_topology

import zlc
from zlc import cli, deploy
from zlc.bundle import read_manifest
from zlc.deploy import format_cpulist
from zlc.deploy import host as deploy_host


def zlc_cli(*args: Any, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli.cli, [str(a) for a in args], env={"COLUMNS": "240", **(env or {})})


def assert_one_error_line(res: Result, code: int) -> str:
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    return lines[0]


@pytest.fixture(scope="module")
def tiny_bundle(tiny_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_tiny(tiny_onnx, tmp_path_factory.mktemp("deploy-cli") / "tiny.zlc")


@pytest.fixture
def bundle(tiny_bundle: Path, tmp_path: Path) -> Path:
    return copy_bundle(tiny_bundle, tmp_path / "tiny.zlc")


@pytest.fixture
def machine(tmp_path: Path) -> Path:
    f = tmp_path / "machine.json"
    f.write_text(json.dumps(synthetic_topology()))
    return f


def host_cpus() -> frozenset[int]:
    online = deploy.read_topology().online
    if len(online) < 2:
        pytest.skip("needs at least 2 online CPUs")
    return online


def build_for_this_host(bundle: Path) -> deploy.Plan:
    """A plan whose CPUs are this host's: GPU 0 served by the last CPU, no NICs (they differ per host)."""
    serving = max(host_cpus())
    res = zlc_cli("deploy", "build", bundle, "--gpus", "0", "--cpus", serving, "--zlc-bin", sys.executable)
    assert res.exit_code == 0, res.output
    # --nic is not given, so this host's NICs are in the plan; the fake /proc/interrupts does not name them
    return deploy.load_plan(bundle / "deploy")


def test_plan_prints_the_split(bundle: Path, machine: Path) -> None:
    before = (bundle / "manifest.json").read_bytes()
    res = zlc_cli("deploy", "plan", bundle, "--topology", machine, "--frame-port", "9000")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "tiny-llama: 8 instance(s) on a machine with 128 CPUs, 2 NUMA node(s), 8 GPU(s) found" in out
    assert "zlc-serve@0.service" in out and "CPUs 1-8,65-72 (node 0), port 8000, frames 9000" in out
    assert "zlc-serve@7.service" in out and "CPUs 57-63,121-127 (node 1), port 8007" in out
    assert "housekeeping CPUs: 0,32,64,96" in out
    assert "kernel arguments (reboot): isolcpus=managed_irq,1-31,33-63,65-95,97-127" in out
    assert "systemd/zlc-serve@.service" in out
    assert (bundle / "manifest.json").read_bytes() == before and not (bundle / "deploy" / "plan.json").exists()


def test_plan_json_and_out(bundle: Path, machine: Path, tmp_path: Path) -> None:
    res = zlc_cli("deploy", "plan", bundle, "--topology", machine, "--gpus", "2,5", "--json",
                  "--out", tmp_path / "out", "--bundle-path", "/srv/t.zlc", "--zlc-bin", "/opt/zlc/bin/zlc")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [(i["gpu"], i["cpus"], i["port"]) for i in data["instances"]] == \
        [(2, "1-31,65-95", 8002), (5, "33-63,97-127", 8005)]
    assert data["options"]["bundle_path"] == "/srv/t.zlc"
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file()) \
        == data["files"]
    unit = (tmp_path / "out/systemd/zlc-serve@.service").read_text()
    assert "ExecStart=/opt/zlc/bin/zlc serve /srv/t.zlc --device cuda" in unit
    assert not (bundle / "deploy" / "plan.json").exists()


def test_build_keeps_the_bundle_loadable_and_replaces_itself(bundle: Path, machine: Path) -> None:
    res = zlc_cli("deploy", "build", bundle, "--topology", machine)
    assert res.exit_code == 0, res.output
    assert f"wrote 21 files into {bundle / 'deploy'} (manifest updated)" in res.stdout
    files = read_manifest(bundle, check=True)["files"]
    assert "deploy/systemd/zlc-serve@7.service.d/10-zlc.conf" in files and "deploy/k8s/deployment.yaml" in files
    zlc.load(bundle)
    assert zlc_cli("inspect", bundle).exit_code == 0  # verifies every checksum
    res = zlc_cli("deploy", "build", bundle, "--topology", machine, "--gpus", "0", "--json")
    assert res.exit_code == 0, res.output
    assert [i["unit"] for i in json.loads(res.stdout)["instances"]] == ["zlc-serve@0.service"]
    files = read_manifest(bundle, check=True)["files"]
    assert "deploy/systemd/zlc-serve@7.service.d/10-zlc.conf" not in files
    zlc.load(bundle)


@pytest.mark.parametrize("args, code, message", [
    (["--cpus", "2-x"], 2, "Invalid value for '--cpus': bad list '2-x': expected CPU numbers and ranges like 2-5,8"),
    (["--gpus", ""], 2, "Invalid value for '--gpus': is empty"),
    (["--cpus", "2-5", "--housekeeping", "4-9"], 1, "--cpus and --housekeeping overlap: 4-5"),
    (["--cpus", "500"], 1, "CPU 500 in --cpus is not online (online: 0-127)"),
    (["--gpus", "0-8"], 1, "--gpus lists GPU 8, but the topology has GPUs 0-7"),
    (["--cpus", "0-127"], 1, "no housekeeping CPU left"),
    (["--zlc-bin", "zlc"], 2, "Invalid value for --zlc-bin: must be an absolute path"),
])
def test_plan_errors_are_one_line(bundle: Path, machine: Path, args: list[str], code: int, message: str) -> None:
    for cmd in ("plan", "build"):
        line = assert_one_error_line(zlc_cli("deploy", cmd, bundle, "--topology", machine, *args), code)
        assert message in line, line
    assert not (bundle / "deploy" / "plan.json").exists()


def test_bad_topology_file(bundle: Path, tmp_path: Path) -> None:
    f = tmp_path / "t.json"
    f.write_text("{not json")
    assert "not JSON" in assert_one_error_line(zlc_cli("deploy", "plan", bundle, "--topology", f), 1)
    f.write_text('{"cpus": [{"id": 0}]}')
    assert "not a topology" in assert_one_error_line(zlc_cli("deploy", "plan", bundle, "--topology", f), 1)


def test_topology_command_round_trips() -> None:
    res = zlc_cli("deploy", "topology")
    assert res.exit_code == 0, res.output
    assert deploy.Topology.from_json(json.loads(res.stdout)) == deploy.read_topology()


def fake_irq_env(tmp_path: Path) -> dict[str, str]:
    """The fake /proc/interrupts without rows naming this host's NICs (the host plan moves those), so
    what matches is the same everywhere: the nvidia row."""
    mine = [x for n in deploy.read_topology().nics for x in (n.name, n.pci) if x]
    interrupts = tmp_path / "interrupts"
    interrupts.write_text("".join(ln for ln in FAKE_INTERRUPTS.splitlines(True) if not any(m in ln for m in mine)))
    proc_irq = fake_proc_irq(tmp_path / "irq", {26: "0-3", 24: "0-3"})
    return {"PROC_INTERRUPTS": str(interrupts), "PROC_IRQ": str(proc_irq)}


def sysctls_now() -> dict[str, str]:
    return {k: Path("/proc/sys", k.replace(".", "/")).read_text() for k in deploy.SYSCTLS}


def test_apply_dry_run_lists_every_change_and_makes_none(bundle: Path, tmp_path: Path) -> None:
    p = build_for_this_host(bundle)
    env = fake_irq_env(tmp_path)
    before = sysctls_now()
    res = zlc_cli("deploy", "apply", bundle, "--dry-run", env=env)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert out.startswith("dry run: ") and "nothing is changed" in out.splitlines()[0]
    for key, (value, _) in deploy.SYSCTLS.items():
        now = before[key].strip()
        assert (f"sysctl   {key}: {now} -> {value}" if now != value else f"sysctl   {key}: {value} (unchanged)") in out
    hk = format_cpulist(p.housekeeping)
    assert f"irq      irq 26 (nvidia): 0-3 -> {hk}" in out
    assert f"irq      default irq affinity: f -> {deploy.cpumask_hex(p.housekeeping)}" in out
    assert "affinity zlc-serve@0.service: - -> " + format_cpulist(p.instances[0].cpus) in out
    assert "file     /etc/systemd/system/zlc-serve@0.service.d/10-zlc.conf <- systemd/zlc-serve@0.service.d/10-zlc.conf" in out
    assert "file     /etc/tuned/zlc-serving/tuned.conf <- tuned/zlc-serving/tuned.conf" in out
    assert "[tuned-adm profile zlc-serving, then reboot (its kernel arguments)]" in out
    assert "kernel   nohz_full=" in out and "[reboot: not applied" in out
    assert sysctls_now() == before
    assert Path(env["PROC_IRQ"], "26", "smp_affinity_list").read_text() == "0-3\n"
    data = json.loads(zlc_cli("deploy", "apply", bundle, "--dry-run", "--json", env=env).stdout)
    assert data["dry_run"] and data["applied"] == []
    assert {c["kind"] for c in data["changes"]} == {"sysctl", "irq", "affinity", "file", "kernel"}


def test_apply_a_plan_for_another_machine_is_refused(bundle: Path, machine: Path) -> None:
    assert zlc_cli("deploy", "build", bundle, "--topology", machine).exit_code == 0
    line = assert_one_error_line(zlc_cli("deploy", "apply", bundle, "--dry-run"), 1)
    assert "this plan is for a machine with CPUs 0-127" in line


def test_apply_needs_a_built_plan_and_an_intact_bundle(bundle: Path) -> None:
    assert "no plan.json (run `zlc deploy build BUNDLE`" in assert_one_error_line(
        zlc_cli("deploy", "apply", bundle, "--dry-run"), 1)
    build_for_this_host(bundle)
    script = bundle / "deploy" / "irq-affinity.sh"
    script.write_text(script.read_text() + "echo owned\n")
    line = assert_one_error_line(zlc_cli("deploy", "apply", bundle, "--dry-run"), 1)
    assert "deploy/irq-affinity.sh does not match its sha256" in line


def test_apply_irq_affinity_into_a_fake_proc(bundle: Path, tmp_path: Path) -> None:
    p = build_for_this_host(bundle)
    env = fake_irq_env(tmp_path)
    before = sysctls_now()
    res = zlc_cli("deploy", "apply", bundle, "--only", "irq", env=env)
    assert res.exit_code == 0, res.output
    hk = format_cpulist(p.housekeeping)
    assert f"applied 2 change(s):\n  irq      irq 26 (nvidia): 0-3 -> {hk}\n" in res.stdout
    assert "not applied (what [...] says does it; rows without [...] were left out by --only):" in res.stdout
    assert "sysctl   net.ipv4.tcp_fastopen" in res.stdout.split("not applied")[1] or \
        before["net.ipv4.tcp_fastopen"].strip() == "3"
    assert Path(env["PROC_IRQ"], "26", "smp_affinity_list").read_text() == hk + "\n"
    assert Path(env["PROC_IRQ"], "24", "smp_affinity_list").read_text() == "0-3\n"  # not this host's NIC
    assert sysctls_now() == before


def test_apply_pins_a_running_process(bundle: Path) -> None:
    p = build_for_this_host(bundle)
    child = subprocess.Popen(["sleep", "60"])
    try:
        os.sched_setaffinity(child.pid, p.housekeeping)  # whatever this runner's own mask is
        res = zlc_cli("deploy", "apply", bundle, "--only", "affinity", "--pid", child.pid, "--gpu", "0")
        assert res.exit_code == 0, res.output
        assert f"affinity pid {child.pid} (sleep) and its threads and children, GPU 0:" in res.stdout
        assert os.sched_getaffinity(child.pid) == set(p.instances[0].cpus)
    finally:
        child.kill()
        child.wait()
    assert "--gpu 3: the plan serves GPUs 0" in assert_one_error_line(
        zlc_cli("deploy", "apply", bundle, "--dry-run", "--pid", os.getpid(), "--gpu", "3"), 1)


def test_apply_refuses_without_root(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_for_this_host(bundle)
    if all(sysctls_now()[k].strip() == v for k, (v, _) in deploy.SYSCTLS.items()):
        pytest.skip("this host already has every planned sysctl: nothing to refuse")
    monkeypatch.setattr(deploy_host.os, "geteuid", lambda: 1000)
    line = assert_one_error_line(zlc_cli("deploy", "apply", bundle, "--only", "sysctl"), 1)
    assert "zlc deploy apply writes sysctls and IRQ affinity: run it as root (or see the changes with --dry-run)" in line


@pytest.mark.skipif(shutil.which("unshare") is None or
                    subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0,
                    reason="needs root and network namespaces (unshare -n)")
def test_apply_sysctls_in_a_new_network_namespace(bundle: Path) -> None:
    """The real `zlc deploy apply` writing the real /proc/sys, inside a fresh network namespace: every
    planned sysctl is per namespace, so this machine keeps its values."""
    build_for_this_host(bundle)
    before = sysctls_now()
    # in one namespace: apply, then a dry run that must find nothing left to do
    zlc_cmd = f'"{sys.executable}" -m zlc.cli deploy apply "{bundle}"'
    r = subprocess.run(["unshare", "-n", "sh", "-c", f"{zlc_cmd} --only sysctl --json && {zlc_cmd} --dry-run --json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first, second = (json.loads(doc) for doc in r.stdout.replace("}\n{", "}\0{").split("\0"))
    fresh = {c["target"]: c for c in first["changes"] if c["kind"] == "sysctl"}
    assert [c["kind"] for c in first["applied"]] == ["sysctl"] * sum(c["changed"] for c in fresh.values())
    assert fresh["net.ipv4.tcp_fastopen"]["changed"]  # a new namespace starts from the kernel default (1)
    assert [(c["target"], c["changed"]) for c in second["changes"] if c["kind"] == "sysctl"] == \
        [(k, False) for k in deploy.SYSCTLS]
    assert sysctls_now() == before

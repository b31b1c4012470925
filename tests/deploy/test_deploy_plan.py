"""zlc.deploy as a library: the CPU split (fixed machine, errors, a property test over random
machines), every rendered file checked against the plan (systemd-analyze verify, the Kubernetes
OpenAPI schema, the IRQ script on a fake /proc), the bundle registration, and `apply`'s run-time
changes made only where they are safe (fake /proc trees, a new network namespace, a child process).
Nothing here changes this machine's global settings."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import FAKE_INTERRUPTS, compile_tiny, copy_bundle, fake_proc_irq, synthetic_topology
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zlc import deploy
from zlc.bundle import BundleError, read_manifest
from zlc.deploy import DeployError, PlanOptions, Topology, format_cpulist, parse_cpulist
from zlc.deploy import host as deploy_host
from zlc.deploy import planning as deploy_planning

MACHINE = Topology.from_json(synthetic_topology())  # 2 sockets x 32 cores x 2 threads, 8 GPUs
ZLC_BIN = shutil.which("zlc") or str(Path(sys.executable).parent / "zlc")


def make(topo: Topology = MACHINE, **kw: Any) -> deploy.Plan:
    kw.setdefault("bundle_path", "/srv/zlc/tiny.zlc")
    return deploy.plan(topo, PlanOptions(**kw), model="tiny-llama")


def text(p: deploy.Plan, rel: str) -> str:
    return p.files[rel].decode()


def keyvals(body: str) -> dict[str, str]:
    """key=value lines of a systemd/env/sysctl file (comments and sections skipped)."""
    out = {}
    for line in body.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


# ---- CPU lists ----------------------------------------------------------------------------------

def test_cpulist_round_trip_and_kernel_form() -> None:
    assert parse_cpulist("2-5,8") == {2, 3, 4, 5, 8}
    assert parse_cpulist(" 0 , 3-3 ,\n") == {0, 3}
    assert parse_cpulist("") == frozenset()
    assert format_cpulist({0, 1, 5, 7, 8, 9}) == "0-1,5,7-9"  # what /proc/irq/N/smp_affinity_list prints
    for bad in ("2-x", "5-2", "a", "1,,-3", "1:2"):
        with pytest.raises(DeployError, match="expected CPU numbers"):
            parse_cpulist(bad)
    assert deploy.cpumask_hex({0, 1}) == "3"
    assert deploy.cpumask_hex({0, 33}) == "2,00000001"
    assert deploy.cpumask_hex({0, 32, 64, 96}) == "1,00000001,00000001,00000001"


# ---- the fixed 2-socket machine -----------------------------------------------------------------

def test_default_plan_on_the_two_socket_machine() -> None:
    p = make()
    assert p.housekeeping == {0, 64, 32, 96}  # the first core of each node, with its sibling
    assert p.isolated == MACHINE.online - p.housekeeping
    # 31 serving cores per node for 4 GPUs: 8, 8, 8, 7 whole cores, siblings together
    got = {i.gpu: format_cpulist(i.cpus) for i in p.instances}
    assert got == {0: "1-8,65-72", 1: "9-16,73-80", 2: "17-24,81-88", 3: "25-31,89-95",
                   4: "33-40,97-104", 5: "41-48,105-112", 6: "49-56,113-120", 7: "57-63,121-127"}
    assert [i.nodes for i in p.instances] == [(0,)] * 4 + [(1,)] * 4
    assert [i.port for i in p.instances] == list(range(8000, 8008))
    assert p.notes == ()
    assert p.kernel_args == ("isolcpus=managed_irq,1-31,33-63,65-95,97-127", "nohz_full=1-31,33-63,65-95,97-127",
                             "rcu_nocbs=1-31,33-63,65-95,97-127", "irqaffinity=0,32,64,96")


def test_explicit_cpus_gpus_and_node() -> None:
    p = make(gpus=(0, 1), cpus=parse_cpulist("2-5,8"))
    assert [(i.gpu, format_cpulist(i.cpus)) for i in p.instances] == [(0, "2-4"), (1, "5,8")]
    assert p.housekeeping == MACHINE.online - {2, 3, 4, 5, 8}
    assert any("SMT sibling" in n for n in p.notes)  # 66 etc. stay housekeeping but share the cores
    # GPUs 4-5 live on node 1; --numa-node 0 makes them serve from node 0, and says so
    p = make(gpus=(4, 5), numa_node=0)
    assert all(MACHINE.cpu(c).node == 0 for i in p.instances for c in i.cpus)
    assert any("GPU 4 is on NUMA node 1" in n for n in p.notes)
    # GPUs on node 0 only: node 1 is not isolated by default
    p = make(gpus=(0, 1))
    assert all(MACHINE.cpu(c).node == 0 for c in p.isolated)
    assert {32, 33, 127} <= p.housekeeping


def test_gpus_from_options_when_the_topology_has_none() -> None:
    topo = Topology.from_json({**synthetic_topology(sockets=1, cores=4, threads=1), "gpus": []})
    p = make(topo, gpus=(0, 1))
    assert [(i.gpu, i.pci, i.gpu_node, format_cpulist(i.cpus)) for i in p.instances] == \
        [(0, None, 0, "1-2"), (1, None, 0, "3")]
    with pytest.raises(DeployError, match="no GPUs found on this host; name them with --gpus"):
        make(topo)


@pytest.mark.parametrize("kw, message", [
    ({"cpus": frozenset({200})}, "CPU 200 in --cpus is not online (online: 0-127)"),
    ({"housekeeping": frozenset({130})}, "CPU 130 in --housekeeping is not online"),
    ({"cpus": frozenset({2, 3}), "housekeeping": frozenset({3, 4})}, "--cpus and --housekeeping overlap: 3"),
    ({"cpus": MACHINE.online}, "no housekeeping CPU left"),
    ({"gpus": (8,)}, "--gpus lists GPU 8, but the topology has GPUs 0-7"),
    ({"gpus": (1, 1)}, "--gpus lists GPU 1 twice"),
    ({"gpus": (0, 1, 2), "cpus": frozenset({2, 66, 3})}, "not enough serving cores: 3 GPUs need at least one "
                                                        "physical core each; the serving CPUs 2-3,66 have 2"),
    ({"numa_node": 2}, "--numa-node 2: no such node with online CPUs (nodes: 0-1)"),
    ({"cpus": frozenset({40}), "numa_node": 0, "gpus": (0,)}, "CPU 40 in --cpus is on NUMA node 1, not --numa-node 0"),
    ({"nics": ("eth7",)}, "NIC eth7 is not in the topology (NICs: eth0)"),
    ({"port": 65530}, "port 65536 for GPU 6 is above 65535"),
    ({"frame_port": 8004}, "the HTTP ports (8000+GPU) and frame ports (8004+GPU) overlap; move --frame-port"),
])
def test_contradictions_are_one_line_errors(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(DeployError) as e:
        make(**kw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_nic_names_that_would_break_the_script_are_refused() -> None:
    topo = Topology.from_json({**synthetic_topology(), "nics": []})  # any name allowed: none is known
    with pytest.raises(DeployError, match="not an interface name"):
        make(topo, nics=("eth0'; rm -rf /",))
    assert make(topo, nics=("ens1f0",)).nics == (deploy.Nic("ens1f0", None, None),)


# ---- the property test --------------------------------------------------------------------------

@st.composite
def machines(draw: st.DrawFn) -> tuple[Topology, PlanOptions]:
    sockets = draw(st.integers(1, 3))
    cores = draw(st.integers(1, 8))
    threads = draw(st.integers(1, 2))
    data = synthetic_topology(sockets, cores, threads, gpus_per_socket=0)
    n_gpus = draw(st.integers(0, 6))
    nodes = draw(st.lists(st.one_of(st.none(), st.integers(0, sockets - 1)), min_size=n_gpus, max_size=n_gpus))
    data["gpus"] = [{"index": i, "pci": None, "node": n} for i, n in enumerate(nodes)]
    topo = Topology.from_json(data)
    online = sorted(topo.online)
    kw: dict[str, Any] = {"bundle_path": "/b"}
    if n_gpus == 0 or draw(st.booleans()):
        kw["gpus"] = tuple(range(draw(st.integers(1, 4)))) if n_gpus == 0 else \
            tuple(sorted(draw(st.sets(st.integers(0, n_gpus - 1), min_size=1))))
    if draw(st.booleans()):
        kw["cpus"] = frozenset(draw(st.sets(st.sampled_from(online), min_size=1)))
    if draw(st.booleans()):
        kw["housekeeping"] = frozenset(draw(st.sets(st.sampled_from(online), min_size=1)))
    if draw(st.integers(0, 3)) == 0:
        kw["numa_node"] = draw(st.integers(0, sockets - 1))
    return topo, PlanOptions(**kw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(machines())
def test_any_machine_gets_a_consistent_plan_or_a_clear_error(m: tuple[Topology, PlanOptions]) -> None:
    topo, o = m
    try:
        p = deploy.plan(topo, o)
    except DeployError as e:
        assert "\n" not in str(e) and str(e)
        return
    online = topo.online
    # serving and housekeeping split the online CPUs
    assert p.isolated and p.housekeeping
    assert not p.isolated & p.housekeeping
    assert p.isolated | p.housekeeping == online
    # each GPU its own CPUs; never two instances on one physical core
    sets = [frozenset(i.cpus) for i in p.instances]
    assert all(sets) and sum(map(len, sets)) == len(p.isolated) and frozenset().union(*sets) == p.isolated
    core_owner: dict[tuple[int, int], int] = {}
    for i in p.instances:
        for c in i.cpus:
            key = (topo.cpu(c).package, topo.cpu(c).core)
            assert core_owner.setdefault(key, i.gpu) == i.gpu
        assert set(i.nodes) == {topo.cpu(c).node for c in i.cpus}
    if o.cpus is not None:
        assert p.isolated <= o.cpus
    if o.housekeeping is not None:
        assert o.housekeeping <= p.housekeeping
    if o.numa_node is not None:
        assert all(topo.cpu(c).node == o.numa_node for c in p.isolated)
    # NUMA locality whenever each GPU's node has a serving core per GPU
    gpus = {g.index: g for g in topo.gpus}
    served = [gpus.get(i.gpu) for i in p.instances]
    if o.cpus is None and o.housekeeping is None and o.numa_node is None and all(g and g.node is not None for g in served):
        per_node: dict[int, int] = {}
        for g in served:
            assert g is not None and g.node is not None
            per_node[g.node] = per_node.get(g.node, 0) + 1
        first = {n: topo.siblings(min(cs)) for n, cs in topo.nodes.items()}
        room = {n: len({(topo.cpu(c).package, topo.cpu(c).core) for c in cs - first[n]}) for n, cs in topo.nodes.items()}
        if all(room[n] >= k for n, k in per_node.items()):
            for i in p.instances:
                assert i.nodes == (i.gpu_node,), (i, p.notes)
            assert not p.notes or all("SMT" in n for n in p.notes)
    check_files(p)


def check_files(p: deploy.Plan) -> None:
    """Every rendered file says what the plan says."""
    iso, hk = format_cpulist(p.isolated), format_cpulist(p.housekeeping)
    tuned = configparser.ConfigParser(interpolation=None)
    tuned.read_string(text(p, "tuned/zlc-serving/tuned.conf"))
    assert tuned["main"]["include"] == "cpu-partitioning"
    assert tuned["variables"]["isolated_cores"] == iso
    assert tuned["bootloader"]["cmdline_zlc"] == f"+isolcpus=managed_irq,{iso} rcu_nocbs={iso} irqaffinity={hk}"
    assert keyvals(text(p, "tuned/cpu-partitioning-variables.conf")) == {"isolated_cores": iso}
    assert keyvals(text(p, "irqbalance.conf")) == {"IRQBALANCE_BANNED_CPULIST": iso}
    assert "#IRQBALANCE_BANNED_CPUS=" + deploy.cpumask_hex(p.isolated) in text(p, "irqbalance.conf")
    assert keyvals(text(p, "sysctl.d/90-zlc.conf")) == {k: v for k, (v, _) in deploy.SYSCTLS.items()}
    args = [ln for ln in text(p, "kernel-args.txt").splitlines() if ln and not ln.startswith("#")]
    assert args == [f"isolcpus=managed_irq,{iso} nohz_full={iso} rcu_nocbs={iso} irqaffinity={hk}"]
    script = keyvals(text(p, "irq-affinity.sh"))
    assert script["HOUSEKEEPING"] == f'"{hk}"' and script["HOUSEKEEPING_MASK"] == f'"{deploy.cpumask_hex(p.housekeeping)}"'
    for i in p.instances:
        unit = keyvals(text(p, f"systemd/zlc-serve@{i.gpu}.service.d/10-zlc.conf"))
        assert unit["CPUAffinity"] == unit["AllowedCPUs"] == format_cpulist(i.cpus)
        assert unit["NUMAPolicy"] == "bind" and unit["NUMAMask"] == unit["AllowedMemoryNodes"] == format_cpulist(i.nodes)
        assert unit["Environment"].split()[0] == f"ZLC_PORT={i.port}"
    assert set(p.files) == {*deploy_files(p)}
    assert json.loads(p.files["plan.json"])["files"] == sorted(p.files)


def deploy_files(p: deploy.Plan) -> list[str]:
    return ["README.md", "irq-affinity.sh", "irqbalance.conf", "k8s/deployment.yaml", "k8s/kubelet-config.yaml",
            "k8s/service.yaml", "kernel-args.txt", "plan.json", "sysctl.d/90-zlc.conf",
            "systemd/zlc-irq-affinity.service", "systemd/zlc-serve@.service",
            "tuned/cpu-partitioning-variables.conf", "tuned/zlc-serving/tuned.conf",
            *(f"systemd/zlc-serve@{i.gpu}.service.d/10-zlc.conf" for i in p.instances)]


def test_fixed_machine_files() -> None:
    p = make(frame_port=9000)
    check_files(p)
    unit = keyvals(text(p, "systemd/zlc-serve@.service"))
    assert unit["ExecStart"].startswith("/usr/local/bin/zlc serve /srv/zlc/tiny.zlc --device cuda --host 0.0.0.0 "
                                        "--port ${ZLC_PORT} --frame-port ${ZLC_FRAME_PORT}")
    assert unit["LimitMEMLOCK"] == "infinity" and unit["NoNewPrivileges"] == "yes" and unit["Restart"] == "on-failure"
    assert unit["Environment"] == "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=%i"
    assert keyvals(text(p, "systemd/zlc-serve@5.service.d/10-zlc.conf"))["Environment"] == "ZLC_PORT=8005 ZLC_FRAME_PORT=9005"


# ---- systemd-analyze verify ---------------------------------------------------------------------

def systemd_verify(*units: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("frame_port", [None, 9000])
def test_systemd_units_verify(tmp_path: Path, frame_port: int | None) -> None:
    """Each instance is verified as systemd loads it: the template plus its drop-in. verify exits 0
    on unknown keys and unparsable values (it only warns), so any output at all fails the test."""
    p = make(zlc_bin=ZLC_BIN, frame_port=frame_port)
    deploy.write_dir(p, tmp_path)
    units = tmp_path / "systemd"
    paths = [units / "zlc-serve@.service", units / "zlc-irq-affinity.service",
             *(units / i.unit for i in p.instances)]
    r = systemd_verify(*paths)
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr
    # and verify does read the drop-ins: a broken one is reported
    bad = units / "zlc-serve@3.service.d" / "10-zlc.conf"
    bad.write_text(bad.read_text().replace("NUMAMask=0", "NUMAMask=zero"))
    r = systemd_verify(units / "zlc-serve@3.service")
    assert "NUMAMask" in r.stderr or "NUMA" in r.stderr, r.stderr


# ---- Kubernetes --------------------------------------------------------------------------------

def test_k8s_manifests_validate_against_the_openapi_schema() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the 'test' extra)")
    yaml = pytest.importorskip("yaml")
    p = make(frame_port=9000, image="registry.example.com/zlc:1")
    for rel in ("k8s/deployment.yaml", "k8s/service.yaml"):
        doc = yaml.safe_load(p.files[rel])
        for version in ("1.30.0", kv.latest_version()):
            kv.validate(doc, version, strict=True)  # strict: unknown fields fail too
    dep = yaml.safe_load(p.files["k8s/deployment.yaml"])
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    res = c["resources"]
    assert res["requests"] == res["limits"] == {"cpu": "14", "memory": "16Gi", "nvidia.com/gpu": 1}  # Guaranteed
    assert dep["spec"]["replicas"] == 8
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {pt["name"]: pt["containerPort"] for pt in c["ports"]} == {"http": 8000, "frames-tcp": 9000, "frames-udp": 9000}
    assert c["image"] == "registry.example.com/zlc:1"
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in spec["volumes"])
    svc = yaml.safe_load(p.files["k8s/service.yaml"])
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    # a broken manifest does fail (the validator is not a no-op)
    dep_bad = json.loads(json.dumps(dep))
    dep_bad["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = {"x": 1}
    with pytest.raises(kv.ValidationError):
        kv.validate(dep_bad, kv.latest_version(), strict=True)


def test_kubelet_config_documents_the_policies() -> None:
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load(make().files["k8s/kubelet-config.yaml"])
    assert cfg == {"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
                   "cpuManagerPolicy": "static", "cpuManagerPolicyOptions": {"full-pcpus-only": "true"},
                   "reservedSystemCPUs": "0,32,64,96", "topologyManagerPolicy": "single-numa-node",
                   "topologyManagerScope": "pod"}


def test_k8s_names_are_dns_labels() -> None:
    assert deploy_planning._k8s_name("SmolLM2 135M/Instruct") == "zlc-smollm2-135m-instruct"
    assert deploy_planning._k8s_name("___") == "zlc-model"


# ---- the IRQ script -----------------------------------------------------------------------------

def irq_plan() -> deploy.Plan:
    return deploy.plan(Topology.from_json(synthetic_topology(nics=("eth0", "eth1"))),
                       PlanOptions(bundle_path="/b"), model="m")


def run_script(script: Path, interrupts: Path, proc_irq: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PROC_INTERRUPTS": str(interrupts), "PROC_IRQ": str(proc_irq)}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=30)


def test_irq_script_moves_nic_and_gpu_interrupts(tmp_path: Path) -> None:
    deploy.write_dir(irq_plan(), tmp_path / "d")
    script = tmp_path / "d" / "irq-affinity.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert os.access(script, os.X_OK)
    interrupts = tmp_path / "interrupts"
    interrupts.write_text(FAKE_INTERRUPTS)
    proc_irq = fake_proc_irq(tmp_path / "irq", {n: "0-3" for n in (0, 24, 25, 27, 28, 29)} | {26: "0,32,64,96"})
    r = run_script(script, interrupts, proc_irq, "--dry-run")
    assert r.returncode == 0, r.stderr
    # mlx5 by its PCI address, eth1 by name, nvidia; not nvme, virtio, the timer, nor veth10 ("eth1" inside a word)
    assert r.stdout.splitlines() == [
        "irq 24 (mlx5_comp0@pci:0000:a0:00.0): 0-3 -> 0,32,64,96",
        "irq 25 (eth1-TxRx-0): 0-3 -> 0,32,64,96",
        "irq 26 (nvidia): 0,32,64,96 (unchanged)",
        "default irq affinity: f -> 1,00000001,00000001,00000001",
    ]
    assert (proc_irq / "24" / "smp_affinity_list").read_text() == "0-3\n"  # dry run: untouched
    # for real, into the fake tree; a kernel-managed IRQ (its file cannot be written) is skipped
    (proc_irq / "25" / "smp_affinity_list").unlink()
    (proc_irq / "25" / "smp_affinity_list").mkdir()
    r = run_script(script, interrupts, proc_irq)
    assert r.returncode == 0, r.stderr
    assert (proc_irq / "24" / "smp_affinity_list").read_text() == "0,32,64,96\n"
    assert (proc_irq / "27" / "smp_affinity_list").read_text() == "0-3\n"
    assert (proc_irq / "default_smp_affinity").read_text() == "1,00000001,00000001,00000001\n"
    assert "irq 25 (eth1-TxRx-0): not moved" in r.stderr
    assert "moved 1 interrupt(s) to CPUs 0,32,64,96; 1 skipped" in r.stderr
    assert run_script(script, interrupts, proc_irq, "--bogus").returncode == 2


# ---- topology from sysfs ------------------------------------------------------------------------

def test_read_topology_from_a_fake_sysfs(tmp_path: Path) -> None:
    """2 nodes x 2 cores x 2 threads, CPU 7 offline, two GPUs under /proc/driver/nvidia."""
    sysd = tmp_path / "sys/devices/system"
    (sysd / "cpu").mkdir(parents=True)
    (sysd / "cpu/online").write_text("0-6\n")
    for c in range(8):
        t = sysd / f"cpu/cpu{c}/topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text(f"{(c % 4) // 2}\n")
        (t / "thread_siblings_list").write_text(f"{c % 4},{c % 4 + 4}\n")
    for n, cl in ((0, "0-1,4-5"), (1, "2-3,6")):
        (sysd / f"node/node{n}").mkdir(parents=True)
        (sysd / f"node/node{n}/cpulist").write_text(cl + "\n")
    for bdf, node in (("0000:17:00.0", 0), ("0000:b1:00.0", 1)):
        (tmp_path / "proc/driver/nvidia/gpus" / bdf).mkdir(parents=True)
        (tmp_path / "sys/bus/pci/devices" / bdf).mkdir(parents=True)
        (tmp_path / "sys/bus/pci/devices" / bdf / "numa_node").write_text(f"{node}\n")
    topo = deploy.read_topology(tmp_path)
    assert [(c.id, c.core, c.package, c.node) for c in topo.cpus] == [
        (0, 0, 0, 0), (1, 1, 0, 0), (2, 2, 1, 1), (3, 3, 1, 1), (4, 0, 0, 0), (5, 1, 0, 0), (6, 2, 1, 1)]
    assert topo.gpus == (deploy.Gpu(0, "0000:17:00.0", 0), deploy.Gpu(1, "0000:b1:00.0", 1))
    assert Topology.from_json(json.loads(json.dumps(topo.to_json()))) == topo
    p = make(topo)
    assert [(i.gpu, format_cpulist(i.cpus)) for i in p.instances] == [(0, "1,5"), (1, "3")]


def test_read_topology_of_this_host() -> None:
    topo = deploy.read_topology()
    assert topo.online == parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    assert all(t.node in topo.nodes for t in topo.cpus)


# ---- the bundle ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bundle(tiny_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_tiny(tiny_onnx, tmp_path_factory.mktemp("deploy") / "tiny.zlc")


def test_add_bundle_files_keeps_the_bundle_loadable(tiny_bundle: Path, tmp_path: Path) -> None:
    import zlc

    b = copy_bundle(tiny_bundle, tmp_path / "b.zlc")
    deploy.add_bundle_files(b, {"deploy/ebpf/x.c": b"int x;\n", "deploy/a/b.txt": b"hi\n"},
                            modes={"deploy/a/b.txt": 0o755})
    man = read_manifest(b, check=True)
    assert "deploy/ebpf/x.c" in man["files"] and os.access(b / "deploy/a/b.txt", os.X_OK)
    zlc.load(b)
    deploy.add_bundle_files(b, {}, remove=["deploy/a/b.txt"])
    assert not (b / "deploy/a").exists() and "deploy/a/b.txt" not in read_manifest(b, check=True)["files"]
    for rel in ("weights.safetensors", "deploy/../kernel.py", "/etc/passwd", "manifest.json"):
        with pytest.raises(DeployError):
            deploy.add_bundle_files(b, {rel: b"x"})
    # never re-bless a modified bundle
    (b / "kernel.py").write_text("# tampered\n")
    with pytest.raises(BundleError, match="kernel.py does not match"):
        deploy.add_bundle_files(b, {"deploy/y": b"y"})


def test_write_replaces_a_previous_plan(tiny_bundle: Path, tmp_path: Path) -> None:
    import zlc

    b = copy_bundle(tiny_bundle, tmp_path / "b.zlc")
    deploy.add_bundle_files(b, {"deploy/ebpf/zlc_xdp.c": b"/* the other half of deploy/ */\n"})
    files = deploy.write(make(), b)
    assert "deploy/systemd/zlc-serve@7.service.d/10-zlc.conf" in files
    deploy.write(make(gpus=(0, 1)), b)
    man = read_manifest(b, check=True)
    assert not (b / "deploy/systemd/zlc-serve@7.service.d").exists()
    assert "deploy/systemd/zlc-serve@7.service.d/10-zlc.conf" not in man["files"]
    assert "deploy/ebpf/zlc_xdp.c" in man["files"]  # not ours: kept
    assert deploy.load_plan(b / "deploy").instances == make(gpus=(0, 1)).instances
    zlc.load(b)


# ---- apply: the run-time changes ----------------------------------------------------------------

def host_plan(tmp_path: Path, **kw: Any) -> tuple[deploy.Plan, Path]:
    """A plan for this host (so its CPUs are this host's), written to a plain folder."""
    topo = deploy.read_topology()
    if len(topo.online) < 2:
        pytest.skip("needs at least 2 online CPUs")
    kw.setdefault("gpus", (0,))
    kw.setdefault("cpus", frozenset({max(topo.online)}))
    kw.setdefault("nics", ())  # this host's NICs differ from machine to machine; the fake IRQs name none
    p = make(topo, **kw)
    deploy.write_dir(p, tmp_path / "deploy")
    return p, tmp_path / "deploy"


def fake_proc_sys(root: Path, values: dict[str, str]) -> Path:
    for k, v in values.items():
        f = root / k.replace(".", "/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(v + "\n")
    return root


def test_host_changes_and_apply_on_fake_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p, d = host_plan(tmp_path)
    sysfs = fake_proc_sys(tmp_path / "sys", {"net.ipv4.tcp_fastopen": "1", "net.ipv4.tcp_slow_start_after_idle": "0"})
    interrupts = tmp_path / "interrupts"
    interrupts.write_text(FAKE_INTERRUPTS)
    proc_irq = fake_proc_irq(tmp_path / "irq", {26: "0-3"})
    monkeypatch.setenv("PROC_INTERRUPTS", str(interrupts))
    monkeypatch.setenv("PROC_IRQ", str(proc_irq))
    changes = deploy.host_changes(p, d, proc_sys=sysfs)
    lines = [c.line() for c in changes]
    assert "sysctl   net.ipv4.tcp_fastopen: 1 -> 3" in lines
    assert "sysctl   net.ipv4.tcp_slow_start_after_idle: 0 (unchanged)" in lines
    assert "sysctl   net.core.somaxconn: (absent) -> 4096" in lines
    hk = format_cpulist(p.housekeeping)
    assert f"irq      irq 26 (nvidia): 0-3 -> {hk}" in lines
    assert any(ln.startswith("file     /etc/systemd/system/zlc-serve@.service <- systemd/zlc-serve@.service (")
               for ln in lines)
    assert any(ln.startswith(f"kernel   isolcpus=managed_irq,{format_cpulist(p.isolated)}: absent -> present [reboot")
               for ln in lines)
    monkeypatch.setattr(deploy_host.os, "geteuid", lambda: 1000)
    with pytest.raises(DeployError, match="run it as root"):
        deploy.apply(changes)
    monkeypatch.setattr(deploy_host.os, "geteuid", lambda: 0)
    made = deploy.apply(changes)
    assert {c.target for c in made} == {"net.ipv4.tcp_fastopen", "irq 26 (nvidia)", "default irq affinity"}
    assert (sysfs / "net/ipv4/tcp_fastopen").read_text() == "3\n"
    assert not (sysfs / "net/core/somaxconn").exists()  # absent here: nothing to write
    assert (proc_irq / "26" / "smp_affinity_list").read_text() == hk + "\n"
    # a plan for another machine is refused
    with pytest.raises(DeployError, match="this plan is for a machine with CPUs 0-127"):
        deploy.host_changes(make(), d)


def unshare_works() -> bool:
    return shutil.which("unshare") is not None and \
        subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not unshare_works(), reason="needs root and network namespaces (unshare -n)")
def test_sysctls_applied_for_real_in_a_new_network_namespace(tmp_path: Path) -> None:
    """Every planned sysctl is per network namespace, so applying them inside a fresh one writes
    the real /proc/sys and leaves this machine's values alone."""
    assert all(k.startswith("net.") for k in deploy.SYSCTLS)
    keys = list(deploy.SYSCTLS)
    before = {k: Path("/proc/sys", k.replace(".", "/")).read_text() for k in keys}
    _, d = host_plan(tmp_path)
    code = f"""
import json
from pathlib import Path
from zlc import deploy
changes = deploy.host_changes(deploy.load_plan({str(d)!r}), {str(d)!r})
deploy.apply([c for c in changes if c.kind == "sysctl"])
print(json.dumps({{k: Path("/proc/sys", k.replace(".", "/")).read_text().strip() for k in {keys!r}}}))
"""
    r = subprocess.run(["unshare", "-n", sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == {k: v for k, (v, _) in deploy.SYSCTLS.items()}
    assert {k: Path("/proc/sys", k.replace(".", "/")).read_text() for k in keys} == before


def test_process_affinity_of_a_child_and_its_children(tmp_path: Path) -> None:
    p, d = host_plan(tmp_path)
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    try:
        for _ in range(100):
            kids = [q for q in deploy_host._descendants(proc.pid) if q != proc.pid]
            if kids:
                break
            subprocess.run(["sleep", "0.05"])
        for q in [proc.pid, *kids]:
            os.sched_setaffinity(q, p.housekeeping)  # whatever this runner's own mask is
        changes = [c for c in deploy.host_changes(p, d, pid=proc.pid) if c.kind == "affinity"]
        assert changes[0].old == format_cpulist(p.housekeeping)
        assert len(changes) == 1 and changes[0].new == format_cpulist(p.instances[0].cpus)
        deploy.apply(changes)
        for q in [proc.pid, *kids]:
            assert os.sched_getaffinity(q) == set(p.instances[0].cpus)
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(DeployError, match="--pid needs --gpu N: the plan serves GPUs 0-7"):
        deploy_host._instance(make(), None)
    with pytest.raises(DeployError, match="--gpu 9: the plan serves GPUs 0-7"):
        deploy_host._instance(make(), 9)

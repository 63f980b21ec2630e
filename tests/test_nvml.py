"""The NVML reader against a stand-in `pynvml` (no GPU here): which GPUs are the daemon's own,
and what one failing GPU or one query a GPU does not support costs.

The stand-in is a module file (FAKE_PYNVML) reading its host's GPUs from the FAKE_NVML
environment variable, loaded in place of nvidia-ml-py's `pynvml`: in this process for the
reader's tests, through PYTHONPATH for a real `kvguard serve`. It answers as NVML does: a
handle by index, by PCI bus id (any of NVML's spellings) or by UUID, NVMLError_NotSupported for
a query the GPU does not support (utilisation on a MIG-enabled GPU), NVMLError for a lost GPU.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.daemon import nvml
from kvguard.daemon.metrics import NvmlCollector
from kvguard.daemon.nvml import NvmlReader

GiB = 2**30
FAKE_PYNVML = '''
"""A stand-in pynvml: the GPUs of $FAKE_NVML, a JSON list of
{"pci": "0000:3b:00.0", "uuid": "GPU-...", "used": 0.5, "unsupported": ["utilization"],
 "lost": false}."""
import json
import os

NVML_TEMPERATURE_GPU = 0
GPUS = json.loads(os.environ.get("FAKE_NVML", "[]"))


class NVMLError(Exception):
    def __init__(self, why="Unknown Error"):
        self.why = why

    def __str__(self):
        return self.why


class NVMLError_NotSupported(NVMLError):
    def __init__(self):
        super().__init__("Not Supported")


class NVMLError_NotFound(NVMLError):
    def __init__(self):
        super().__init__("Not Found")


class _Memory:
    def __init__(self, used):
        self.total = 80 * 2**30
        self.used = int(used * self.total)
        self.free = self.total - self.used


class _Utilization:
    gpu = 40
    memory = 10


def _pci(text):
    """(domain, bus, device) of any spelling NVML takes: 0000:3b:00.0, 00000000:3B:00.0, ..."""
    domain, bus, rest = text.split(":")
    return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)


def _gpu(h, what):
    g = GPUS[h]
    if g.get("lost"):
        raise NVMLError("GPU is lost")
    if what in g.get("unsupported", ()):
        raise NVMLError_NotSupported()
    return g


def nvmlInit():
    pass


def nvmlDeviceGetCount():
    return len(GPUS)


def nvmlDeviceGetHandleByIndex(i):
    if not 0 <= i < len(GPUS):
        raise NVMLError("Invalid Argument")
    return i


def nvmlDeviceGetHandleByPciBusId(bus):
    for i, g in enumerate(GPUS):
        if _pci(g["pci"]) == _pci(bus):
            return i
    raise NVMLError_NotFound()


def nvmlDeviceGetHandleByUUID(uuid):
    for i, g in enumerate(GPUS):
        if g.get("uuid") == uuid:
            return i
    raise NVMLError_NotFound()


def nvmlDeviceGetIndex(h):
    return h


def nvmlDeviceGetMemoryInfo(h):
    return _Memory(_gpu(h, "memory")["used"])


def nvmlDeviceGetUtilizationRates(h):
    _gpu(h, "utilization")
    return _Utilization()


def nvmlDeviceGetName(h):
    _gpu(h, "name")
    return b"NVIDIA H100 80GB HBM3"


def nvmlDeviceGetTemperature(h, sensor):
    _gpu(h, "temperature")
    return 41


def nvmlDeviceGetPowerUsage(h):
    _gpu(h, "power")
    return 123456
'''
A, B = "0000:3b:00.0", "0000:86:00.0"  # GPU 0: the daemon's; GPU 1: another tenant's


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Install the stand-in with these GPUs as `pynvml`; returns a function taking the GPUs."""

    def install(gpus: list[dict[str, Any]]) -> ModuleType:
        monkeypatch.setenv("FAKE_NVML", json.dumps(gpus))
        path = tmp_path / "pynvml.py"
        path.write_text(FAKE_PYNVML)
        spec = importlib.util.spec_from_file_location("pynvml", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module

    return install


def samples(reader: NvmlReader) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The NVML collector's exposition, as {(sample name, sorted labels): value}."""
    registry = CollectorRegistry()
    registry.register(NvmlCollector(reader))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_signal_reads_only_the_engines_gpus(fake_nvml) -> None:  # noqa: ANN001
    fake_nvml([{"pci": A, "used": 0.5}, {"pci": B, "used": 0.99}])
    r = NvmlReader()
    assert r.available
    assert r.memory_used_ratio() is None  # not told which GPUs are the engine's: unknown
    r.use_gpus(["00000000:3B:00.0"])  # NVML's own spelling of A finds it too
    assert r.own_gpus == [0]
    assert r.memory_used_ratio() == pytest.approx(0.5)  # not GPU 1's 0.99
    assert [(g.index, g.own) for g in r.read()] == [(0, True), (1, False)]
    r.use_gpus([A, B])  # tensor parallel over both: the fuller one
    assert r.memory_used_ratio() == pytest.approx(0.99)
    r.use_gpus([])  # an engine on the CPU acts on no GPU's memory
    assert r.own_gpus == []
    assert r.memory_used_ratio() is None
    assert len(r.read()) == 2  # still exported for the host


def test_metrics_mark_the_daemons_own_gpus(fake_nvml) -> None:  # noqa: ANN001
    fake_nvml([{"pci": A, "used": 0.5}, {"pci": B, "used": 0.99}])
    r = NvmlReader()
    r.use_gpus([A])
    got = samples(r)
    assert got[("kvguard_nvml_up", ())] == 1.0
    own = (("gpu", "0"), ("own", "true"))
    other = (("gpu", "1"), ("own", "false"))
    assert got[("kvguard_gpu_memory_used_bytes", own)] == int(0.5 * 80 * GiB)
    assert got[("kvguard_gpu_memory_used_bytes", other)] == int(0.99 * 80 * GiB)
    assert got[("kvguard_gpu_memory_total_bytes", other)] == 80 * GiB
    assert got[("kvguard_gpu_power_watts", own)] == pytest.approx(123.456)


def test_a_query_the_gpu_does_not_support_costs_that_field_only(
    fake_nvml,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MIG: NVML answers memory, temperature and power but not utilisation. Before, the one
    NotSupported blanked every GPU's reading (and kvguard_nvml_up went to 0)."""
    fake_nvml(
        [
            {"pci": A, "used": 0.97, "unsupported": ["utilization"]},
            {"pci": B, "used": 0.5, "unsupported": ["power", "temperature", "name"]},
        ]
    )
    r = NvmlReader()
    with caplog.at_level(logging.INFO, logger="kvguard.nvml"):
        gpus = r.read()
        r.read()
    assert [g.index for g in gpus] == [0, 1]
    r.use_gpus([A])
    assert gpus[0].utilization_ratio is None and gpus[0].power_watts == pytest.approx(123.456)
    assert gpus[1].utilization_ratio == pytest.approx(0.4) and gpus[1].power_watts is None
    assert gpus[1].temperature_celsius is None and gpus[1].name == ""
    assert r.memory_used_ratio() == pytest.approx(0.97)
    assert r.error == ""
    # each (GPU, field) logged once, not on every poll and scrape
    lines = [m for m in caplog.messages if "not available" in m]
    assert len(lines) == 4, lines
    got = samples(r)
    assert got[("kvguard_nvml_up", ())] == 1.0
    own, other = (("gpu", "0"), ("own", "true")), (("gpu", "1"), ("own", "false"))
    assert ("kvguard_gpu_utilization_ratio", own) not in got  # absent, not a made-up 0
    assert got[("kvguard_gpu_utilization_ratio", other)] == pytest.approx(0.4)
    assert got[("kvguard_gpu_temperature_celsius", own)] == 41
    assert ("kvguard_gpu_power_watts", other) not in got
    assert got[("kvguard_gpu_memory_used_bytes", own)] == int(0.97 * 80 * GiB)


def test_a_gpu_whose_memory_cannot_be_read_is_left_out(
    fake_nvml,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
) -> None:
    nv = fake_nvml([{"pci": A, "used": 0.5}, {"pci": B, "used": 0.6, "lost": True}])
    r = NvmlReader()
    r.use_gpus([A])
    with caplog.at_level(logging.INFO, logger="kvguard.nvml"):
        assert [g.index for g in r.read()] == [0]
        assert r.memory_used_ratio() == pytest.approx(0.5)  # the daemon's GPU still reads
        assert "GPU 1" in r.error and "GPU is lost" in r.error
        r.use_gpus([A, B])  # one of the engine's GPUs unread: unknown, not the other's max
        assert r.memory_used_ratio() is None
        nv.GPUS[1]["lost"] = False
        assert r.memory_used_ratio() == pytest.approx(0.6)
    assert r.error == ""
    assert sum("cannot read GPU 1" in m for m in caplog.messages) == 1
    assert sum("reads GPU 1 again" in m for m in caplog.messages) == 1


def test_an_engine_gpu_nvml_does_not_know_leaves_the_signal_unknown(fake_nvml) -> None:  # noqa: ANN001
    fake_nvml([{"pci": A, "used": 0.5, "uuid": "GPU-aaaa"}])
    r = NvmlReader()
    r.use_gpus(["0000:99:00.0"])
    assert r.memory_used_ratio() is None
    assert r.own_gpus is None
    assert "0000:99:00.0 not found" in r.error
    assert [g.own for g in r.read()] == [False]
    r.use_gpus(["GPU-aaaa"])  # by UUID, where torch gives no PCI address
    assert r.memory_used_ratio() == pytest.approx(0.5)


def test_no_nvml_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: no nvidia-ml-py
    r = NvmlReader()
    r.use_gpus([A])
    assert not r.available and r.read() == [] and r.memory_used_ratio() is None
    assert samples(r) == {("kvguard_nvml_up", ()): 0.0}


def test_gpu_id_is_the_pci_address_nvml_looks_up() -> None:
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0, uuid="x")
    assert nvml.gpu_id(props) == A
    assert nvml.gpu_id(SimpleNamespace(uuid="5a1f-77")) == "GPU-5a1f-77"  # an older torch
    assert nvml.gpu_id(SimpleNamespace(uuid="MIG-5a1f")) == "MIG-5a1f"


def test_engine_gpu_ids_are_this_hosts_ranks_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = SimpleNamespace(device=torch.device("cpu"), runner=SimpleNamespace())
    assert nvml.engine_gpu_ids(cpu) == []
    # rank 0 alone here on cuda:1; or rank 0 and a local worker of rank 2 on cuda:0 and
    # cuda:1 (their order among this host's ranks), ranks 1 and 3 remote
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B + i, pci_device_id=0),
    )
    workers = [
        SimpleNamespace(rank=1, process=None),
        SimpleNamespace(rank=2, process=object()),
        SimpleNamespace(rank=3, process=None),
    ]
    one = SimpleNamespace(device=torch.device("cuda", 1), runner=SimpleNamespace())
    assert nvml.engine_gpu_ids(one) == ["0000:3c:00.0"]
    tp = SimpleNamespace(device=torch.device("cuda", 0), runner=SimpleNamespace(workers=workers))
    assert nvml.engine_gpu_ids(tp) == ["0000:3b:00.0", "0000:3c:00.0"]


# -- a real daemon -----------------------------------------------------------------------------
def metric(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        tuple(sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def test_a_cpu_daemon_does_not_act_on_another_tenants_gpu(tmp_path: Path) -> None:
    """A `device: cpu` daemon on a host whose GPU 1 (someone else's) is 99% full: its GPU rules
    stay unknown (before, they read 0.99, halted admission and shrank the KV pool) while the
    host's GPUs are still exported, as not its own."""
    from test_server import TOKEN, Daemon

    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "pynvml.py").write_text(FAKE_PYNVML)
    gpus = [{"pci": A, "used": 0.5}, {"pci": B, "used": 0.99}]
    path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p)
    d = Daemon(
        tmp_path,
        env={"FAKE_NVML": json.dumps(gpus), "PYTHONPATH": path},
        serving="{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512, device: cpu}",
    )
    try:
        deadline = time.monotonic() + 60
        while not metric(d.url, "kvguard_rule_evaluations_total").get((), 0):
            assert time.monotonic() < deadline, "no rule evaluation within 60s"
            time.sleep(0.2)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        state = httpx.get(d.url + "/admin/state", headers=auth, timeout=10).json()
        rules = {r["name"]: r["state"] for r in state["rules"]}
        assert rules["gpu-near-oom"] == "unknown" and rules["gpu-mem-shrink"] == "unknown"
        assert not state["admission"]["halted"]
        assert state["nvml"]["available"] and state["nvml"]["own_gpus"] == []
        used = metric(d.url, "kvguard_gpu_memory_used_bytes")
        assert used == {
            (("gpu", "0"), ("own", "false")): int(0.5 * 80 * GiB),
            (("gpu", "1"), ("own", "false")): int(0.99 * 80 * GiB),
        }
    finally:
        assert d.stop() == 0

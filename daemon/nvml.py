"""GPU memory, utilisation, temperature and power from NVML (`nvidia-ml-py`, module `pynvml`).

Where there is no NVML library or no GPU, `available` is False, `kvguard_nvml_up` reads 0 and
the rest of the daemon carries on; rules reading GPU signals see them as unknown.

NVML sees every GPU of the host, other tenants' too. The rule signal (`memory_used_ratio`) reads
only the GPUs the engine runs on (`use_gpus`, matched by PCI bus id, which CUDA_VISIBLE_DEVICES
does not renumber); the metrics export every GPU NVML answers for, each marked as the daemon's
own or not. One GPU's failure, or one query a GPU does not support (utilisation on a MIG-enabled
GPU, power or temperature on some boards), costs that GPU or that field only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvguard.nvml")


@dataclass(slots=True, frozen=True)
class GpuReading:
    """One GPU as NVML answered: memory always; the optional fields None where NVML did not
    answer them (not supported on this GPU, or failed this time)."""

    index: int
    name: str
    memory_used_bytes: int
    memory_free_bytes: int
    memory_total_bytes: int
    utilization_ratio: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    own: bool = False  # one of the GPUs the engine runs on

    @property
    def memory_used_ratio(self) -> float:
        return self.memory_used_bytes / self.memory_total_bytes if self.memory_total_bytes else 0.0


class NvmlReader:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        # why NVML did not answer, by where: loading it, counting the GPUs, finding the
        # engine's GPUs, reading one GPU's memory (`error` shows the first)
        self._init_error = ""
        self._count_error = ""
        self._own_error = ""
        # The engine's GPUs as NVML names them (PCI bus ids, or GPU-/MIG- UUIDs): None until
        # told (`use_gpus`), () for an engine on no GPU. Their NVML indices once resolved.
        self._gpu_ids: tuple[str, ...] | None = None
        self._own: frozenset[int] | None = None
        self._gpu_errors: dict[int, str] = {}  # GPUs whose memory could not be read, and why
        self._unsupported: set[tuple[int, str]] = set()  # (gpu, field) already logged
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as e:  # noqa: BLE001 - any failure means "no NVML here"
            self._init_error = f"{type(e).__name__}: {e}"
            log.info("NVML unavailable (%s); GPU metrics disabled", self._init_error)

    @property
    def available(self) -> bool:
        return self._nvml is not None

    @property
    def error(self) -> str:
        """Why NVML did not answer as a whole or for one of the GPUs ("" when it did)."""
        whole = [self._init_error, self._count_error, self._own_error]
        gpus = [f"GPU {i}: {why}" for i, why in sorted(self._gpu_errors.items())]
        return "; ".join(e for e in whole + gpus if e)

    def use_gpus(self, gpu_ids: Sequence[str] | None) -> None:
        """The GPUs the engine runs on, by PCI bus id (`engine_gpu_ids`); [] for an engine on
        the CPU, None where they are not known. Only these feed `memory_used_ratio`."""
        with self._lock:
            self._gpu_ids = None if gpu_ids is None else tuple(gpu_ids)
            self._own, self._own_error = None, ""
        if gpu_ids is not None:
            log.info("the engine's GPUs: %s", ", ".join(gpu_ids) if gpu_ids else "none (CPU)")

    @property
    def own_gpus(self) -> list[int] | None:
        """The NVML indices of the engine's GPUs; None while not known."""
        with self._lock:
            own = self._own_indices()
        return None if own is None else sorted(own)

    def read(self) -> list[GpuReading]:
        """One reading per GPU NVML answers for; [] when NVML is missing or cannot count them.
        A GPU whose memory cannot be read is left out (and logged once, until it answers)."""
        if self._nvml is None:
            return []
        with self._lock:
            try:
                n = self._nvml.nvmlDeviceGetCount()
            except Exception as e:  # noqa: BLE001
                why = f"{type(e).__name__}: {e}"
                if why != self._count_error:
                    log.warning("NVML query failed: %s", why)
                self._count_error = why
                return []
            if self._count_error:
                log.info("NVML answers again")
                self._count_error = ""
            own = self._own_indices() or frozenset()
            readings = [self._read_gpu(i, i in own) for i in range(n)]
            return [r for r in readings if r is not None]

    def memory_used_ratio(self) -> float | None:
        """Highest used/total over the engine's GPUs; None when unknown (never a made-up 0):
        NVML missing, the engine's GPUs not known or on no GPU, or one of them not read."""
        readings = self.read()
        with self._lock:
            own = self._own_indices()
        if not own:
            return None
        mine = [r for r in readings if r.index in own]
        if len(mine) != len(own):
            return None
        return max(r.memory_used_ratio for r in mine)

    # -- internals (with the lock held) ----------------------------------------------------
    def _own_indices(self) -> frozenset[int] | None:
        """The engine's GPUs' NVML indices, looked up once; None while that fails (retried)."""
        if self._own is not None or self._gpu_ids is None or self._nvml is None:
            return self._own
        nv = self._nvml
        found = set()
        for gpu in self._gpu_ids:
            try:
                by_uuid = gpu.startswith(("GPU-", "MIG-"))
                get = nv.nvmlDeviceGetHandleByUUID if by_uuid else nv.nvmlDeviceGetHandleByPciBusId
                found.add(int(nv.nvmlDeviceGetIndex(get(gpu))))
            except Exception as e:  # noqa: BLE001 - that GPU's memory is unknown, not guessed
                why = f"the engine's GPU {gpu} not found by NVML ({type(e).__name__}: {e})"
                if why != self._own_error:
                    log.warning("%s; the GPU memory signal stays unknown", why)
                self._own_error = why
                return None
        self._own, self._own_error = frozenset(found), ""
        return self._own

    def _read_gpu(self, i: int, own: bool) -> GpuReading | None:
        nv = self._nvml
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
        except Exception as e:  # noqa: BLE001 - this GPU only
            why = f"{type(e).__name__}: {e}"
            if self._gpu_errors.get(i) != why:
                log.warning("NVML cannot read GPU %d's memory: %s", i, why)
            self._gpu_errors[i] = why
            return None
        if self._gpu_errors.pop(i, None) is not None:
            log.info("NVML reads GPU %d again", i)
        name = self._optional(i, "name", lambda: nv.nvmlDeviceGetName(h))
        util = self._optional(i, "utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu)
        temp = self._optional(
            i, "temperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
        )
        power = self._optional(i, "power", lambda: nv.nvmlDeviceGetPowerUsage(h))
        return GpuReading(
            index=i,
            name=name.decode() if isinstance(name, bytes) else str(name or ""),
            memory_used_bytes=int(mem.used),
            memory_free_bytes=int(mem.free),
            memory_total_bytes=int(mem.total),
            utilization_ratio=None if util is None else util / 100.0,
            temperature_celsius=None if temp is None else float(temp),
            power_watts=None if power is None else power / 1000.0,
            own=own,
        )

    def _optional(self, i: int, what: str, query: Callable[[], Any]) -> Any:
        """A field NVML may not answer for this GPU (NotSupported on MIG, ...): None then,
        logged once per GPU and field."""
        try:
            return query()
        except Exception as e:  # noqa: BLE001 - the field is absent, the GPU is not
            if (i, what) not in self._unsupported:
                self._unsupported.add((i, what))
                log.info("NVML: GPU %d's %s not available (%s: %s)", i, what, type(e).__name__, e)
            return None


def engine_gpu_ids(engine: Any) -> list[str] | None:
    """The GPUs the engine's ranks on this host run on, as NVML can look them up: [] on the
    CPU; None where they cannot be told (the daemon's GPU signal then stays unknown).

    Rank 0 is this process's device. With local workers, this host's ranks (rank 0 and the
    workers with a process here) take cuda:0, cuda:1, ... in rank order (`rank_device`), with
    this process's CUDA_VISIBLE_DEVICES; remote ranks' GPUs are another host's."""
    device = engine.device
    if device.type != "cuda":
        return []
    import torch

    local = sum(w.process is not None for w in getattr(engine.runner, "workers", ()))
    if local:  # rank 0 and its local workers: one GPU each, by their order among them
        indices = set(range(1 + local))
    else:  # one rank here: the device as named
        indices = {device.index if device.index is not None else torch.cuda.current_device()}
    try:
        return [gpu_id(torch.cuda.get_device_properties(i)) for i in sorted(indices)]
    except Exception as e:  # noqa: BLE001
        log.warning("cannot tell which GPUs the engine runs on (%s: %s)", type(e).__name__, e)
        return None


def gpu_id(props: Any) -> str:
    """How NVML finds a CUDA device: its PCI address (`0000:3b:00.0`, as nvmlDeviceGet-
    HandleByPciBusId takes it) where torch reports it, else its UUID (`GPU-...`)."""
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    uuid = str(props.uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"

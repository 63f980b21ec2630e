"""GPU memory, utilisation, temperature and power from NVML (`nvidia-ml-py`, module `pynvml`).

Where there is no NVML library or no GPU, `available` is False, `kvguard_nvml_up` reads 0 and
the rest of the daemon carries on; rules reading GPU signals see them as unknown.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger("kvguard.nvml")


@dataclass(slots=True, frozen=True)
class GpuReading:
    index: int
    name: str
    memory_used_bytes: int
    memory_free_bytes: int
    memory_total_bytes: int
    utilization_ratio: float
    temperature_celsius: float
    power_watts: float

    @property
    def memory_used_ratio(self) -> float:
        return self.memory_used_bytes / self.memory_total_bytes if self.memory_total_bytes else 0.0


class NvmlReader:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml = None
        self.error = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as e:  # noqa: BLE001 - any failure means "no NVML here"
            self.error = f"{type(e).__name__}: {e}"
            log.info("NVML unavailable (%s); GPU metrics disabled", self.error)

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def read(self) -> list[GpuReading]:
        """One reading per GPU; [] when NVML is missing or a query fails."""
        if self._nvml is None:
            return []
        with self._lock:
            try:
                n = self._nvml.nvmlDeviceGetCount()
                return [self._read_one(i) for i in range(n)]
            except Exception as e:  # noqa: BLE001
                self.error = f"{type(e).__name__}: {e}"
                log.warning("NVML query failed: %s", self.error)
                return []

    def _read_one(self, i: int) -> GpuReading:
        nv = self._nvml
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        util = nv.nvmlDeviceGetUtilizationRates(h)
        name = nv.nvmlDeviceGetName(h)
        return GpuReading(
            index=i,
            name=name.decode() if isinstance(name, bytes) else str(name),
            memory_used_bytes=int(mem.used),
            memory_free_bytes=int(mem.free),
            memory_total_bytes=int(mem.total),
            utilization_ratio=util.gpu / 100.0,
            temperature_celsius=float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            power_watts=nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
        )

    def memory_used_ratio(self) -> float | None:
        """Highest used/total over GPUs; None when unknown (never a made-up 0)."""
        readings = self.read()
        return max(r.memory_used_ratio for r in readings) if readings else None

"""GPU telemetry from NVML (nvidia-ml-py), sampled in a background thread while training.

Telemetry is best effort: without CUDA, NVML or permissions it reports itself absent
and never raises into the training path.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

log = logging.getLogger("flwr.fedgpu." + __name__)


@dataclass
class Samples:
    util_pct: list[float] = field(default_factory=list)
    mem_used_mb: list[float] = field(default_factory=list)
    temp_c: list[float] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)


def _nvml_handle(device: torch.device):  # noqa: ANN202 - pynvml handle type is opaque
    """NVML handle of a torch CUDA device, matched by PCI bus id (CUDA_VISIBLE_DEVICES-safe)."""
    import pynvml

    pynvml.nvmlInit()
    index = device.index if device.index is not None else torch.cuda.current_device()
    bus_id = getattr(torch.cuda.get_device_properties(index), "pci_bus_id", None)
    if bus_id:
        return pynvml.nvmlDeviceGetHandleByPciBusId(str(bus_id))
    return pynvml.nvmlDeviceGetHandleByIndex(index)


class GpuTelemetry:
    """Context manager: samples utilisation, memory, temperature and power every `interval_s`."""

    def __init__(self, device: torch.device, interval_s: float = 0.2) -> None:
        self.device, self.interval_s = device, interval_s
        self.samples = Samples()
        self.available = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None

    def __enter__(self) -> GpuTelemetry:
        if self.device.type != "cuda":
            return self
        try:
            self._handle = _nvml_handle(self.device)
            self._sample()
            self.available = True
        except Exception as err:  # noqa: BLE001 - any NVML failure means "absent"
            log.info("GPU telemetry unavailable: %s", err)
            return self
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.available:
            import pynvml

            for final_step in (self._sample, pynvml.nvmlShutdown):  # shutdown balances nvmlInit
                try:
                    final_step()
                except Exception:  # noqa: BLE001 - telemetry never fails the client
                    pass

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception as err:  # noqa: BLE001
                log.info("GPU telemetry sampling stopped: %s", err)
                return

    def _sample(self) -> None:
        import pynvml

        h = self._handle
        self.samples.util_pct.append(float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
        self.samples.mem_used_mb.append(pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20)
        self.samples.temp_c.append(float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)))
        self.samples.power_w.append(pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0)

    def metrics(self) -> dict[str, float]:
        """Reply metrics; only `gpu-telemetry` = 0 when absent (MetricRecord has no null)."""
        s = self.samples
        if not self.available or not s.util_pct:
            return {"gpu-telemetry": 0.0}
        return {
            "gpu-telemetry": 1.0,
            "gpu-util-mean-pct": sum(s.util_pct) / len(s.util_pct),
            "gpu-util-max-pct": max(s.util_pct),
            "gpu-mem-used-max-mb": max(s.mem_used_mb),
            "gpu-temp-max-c": max(s.temp_c),
            "gpu-power-mean-w": sum(s.power_w) / len(s.power_w),
        }

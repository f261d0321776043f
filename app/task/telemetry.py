"""GPU telemetry from NVML (nvidia-ml-py), sampled in a background thread while training.

Telemetry is best effort: without CUDA, NVML or permissions it reports itself absent
and never raises into the training path. NVML describes the whole GPU (other processes
on it included), so the metric names say `device`. `pynvml` is imported lazily: importing
this module must stay cheap for the ServerApp and for CPU-only clients.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from app.protocol import (
    GPU_MEM_USED_MAX_MB,
    GPU_POWER_MEAN_W,
    GPU_TELEMETRY,
    GPU_TEMP_MAX_C,
    GPU_UTIL_MAX_PCT,
    GPU_UTIL_MEAN_PCT,
)

log = logging.getLogger("flwr.fedgpu." + __name__)

_nvml_lock = threading.Lock()
_nvml_ready = False
_nvml_error: Exception | None = None  # the first nvmlInit failure, re-raised without retrying


def _nvml() -> ModuleType:
    """`pynvml`, initialised once per process (thread-safe) and shut down once at exit.

    The simulation runs several GpuTelemetry contexts at once in threads; a single init with a
    single atexit shutdown stays balanced whichever context fails half-way. A failure is kept
    and re-raised, so a machine without NVML does not retry it every round.
    """
    global _nvml_ready, _nvml_error
    with _nvml_lock:
        if _nvml_error is not None:
            raise _nvml_error.with_traceback(None)  # re-raising one object would grow its traceback
        try:
            import pynvml

            if not _nvml_ready:
                pynvml.nvmlInit()
                _nvml_ready = True
                atexit.register(_nvml_shutdown, pynvml)
        except Exception as err:
            _nvml_error = err
            raise
        return pynvml


def _nvml_shutdown(pynvml: ModuleType) -> None:
    """The atexit half of `_nvml`; later calls get an error instead of a second init."""
    global _nvml_ready, _nvml_error
    with _nvml_lock:
        _nvml_error = _nvml_error or RuntimeError("NVML was shut down at exit")
        if _nvml_ready:
            _nvml_ready = False
            try:
                pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - a failing shutdown at exit is not worth a traceback
                pass


def nvml_uuid_candidates(torch_uuid: object) -> tuple[str, ...]:
    """NVML UUID strings that may name a torch CUDA device, most likely first.

    `str(torch.cuda.get_device_properties(i).uuid)` is the bare 8-4-4-4-12 hex; NVML's
    `nvmlDeviceGetHandleByUUID` wants it prefixed by `GPU-` (a whole GPU) or `MIG-` (a MIG
    slice), which torch does not say. A string that already has a prefix is kept.
    """
    text = str(torch_uuid).strip()
    if text.upper().startswith(("GPU-", "MIG-")):
        return (text,)
    return (f"GPU-{text}", f"MIG-{text}")


def _torch_index(device: torch.device | int | None) -> int:
    if isinstance(device, int):
        return device
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


def _nvml_handle(device: torch.device | int | None) -> Any:  # noqa: ANN401 - NVML handles are opaque
    """NVML handle of a torch CUDA device, matched by UUID.

    Torch numbers devices after CUDA_VISIBLE_DEVICES (Ray's cuda:0 may be NVML index 3) and
    reports `pci_bus_id` as a bare int, so neither index nor bus id is a safe key; the UUID is.
    """
    pynvml = _nvml()
    uuid = torch.cuda.get_device_properties(_torch_index(device)).uuid
    error: Exception | None = None
    for candidate in nvml_uuid_candidates(uuid):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(candidate)
        except pynvml.NVMLError as err:
            error = err
    raise LookupError(f"NVML has no device with UUID {uuid}: {error}")


def nvml_uuid(device: torch.device | int | None = None) -> str:
    """NVML's UUID (`GPU-...`/`MIG-...`) of the device NVML matched to a torch device.

    A check for smoke tests (it should end with `str(torch.cuda.get_device_properties(i).uuid)`);
    unlike the telemetry it raises when NVML is missing or has no matching device.
    """
    uuid = _nvml().nvmlDeviceGetUUID(_nvml_handle(device))
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


def process_gpu_memory(device: torch.device) -> int | None:
    """Bytes NVML says this process holds on `device` (None: no NVML, or the process is not
    listed, as in a container whose PID namespace hides it from the driver)."""
    try:
        pynvml = _nvml()
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(_nvml_handle(device)):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - "unknown" is an answer here
        return None
    return None


def hidden_gpus_notice() -> str | None:
    """A warning when the machine has NVIDIA GPUs this process was denied, else None.

    With the default `client-resources-num-gpus=0`, Ray sets CUDA_VISIBLE_DEVICES="" for each
    simulated ClientApp, which then trains on the CPU on a GPU machine without a word.
    NVML ignores CUDA_VISIBLE_DEVICES, so it still counts the GPUs.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() not in ("", "-1"):
        return None
    try:
        if torch.version.cuda is None or torch.cuda.is_available():
            return None  # a CPU-only torch would not use a GPU share either
        count = int(_nvml().nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001 - no NVML means no GPUs we can point at
        return None
    if count < 1:
        return None
    return (
        f"this ClientApp trains on the CPU although the machine has {count} NVIDIA GPU(s): "
        "CUDA_VISIBLE_DEVICES is empty because the simulation gave ClientApps no GPU share; give them one "
        'with `flwr run . --federation-config "client-resources-num-gpus=0.25"` '
        "(sweeps: simulation.client_gpus=0.25)"
    )


@functools.cache
def log_hidden_gpus_once() -> None:
    """Log `hidden_gpus_notice()` as a warning at most once per process (one per Ray worker)."""
    notice = hidden_gpus_notice()
    if notice:
        log.warning(notice)


@dataclass
class Samples:
    util_pct: list[float] = field(default_factory=list)
    mem_used_mb: list[float] = field(default_factory=list)
    temp_c: list[float] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)


# Samples field -> its reading from (pynvml, handle). Each is device-wide.
_READERS: dict[str, Callable[[Any, Any], float]] = {
    "util_pct": lambda nv, h: float(nv.nvmlDeviceGetUtilizationRates(h).gpu),
    "mem_used_mb": lambda nv, h: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20,
    "temp_c": lambda nv, h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
    "power_w": lambda nv, h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
}


class GpuTelemetry:
    """Context manager: samples device-wide utilisation, memory, temperature and power every `interval_s`.

    Each quantity is sampled on its own: one that NVML does not support (utilisation on a MIG
    slice, power on some boards) is left out of the metrics instead of hiding the others.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.2) -> None:
        self.device, self.interval_s = device, interval_s
        self.samples = Samples()
        self.available = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pynvml: Any = None
        self._handle: Any = None
        self._readers: dict[str, Callable[[Any, Any], float]] = {}

    def __enter__(self) -> GpuTelemetry:
        if self.device.type != "cuda":
            return self
        try:
            self._pynvml = _nvml()
            self._handle = _nvml_handle(self.device)
            self._readers = dict(_READERS)
            self._sample(first=True)
        except Exception as err:  # noqa: BLE001 - any NVML failure means "absent"
            log.info("GPU telemetry unavailable: %s", err)
            self._readers = {}
        if not self._readers:
            return self
        self.available = True
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sample()

    def _loop(self) -> None:
        while self._readers and not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self, first: bool = False) -> None:
        """One reading of each quantity still sampled; a quantity whose reading raises is dropped.

        Never raises: it runs in the sampler thread and in `__exit__`.
        """
        not_supported = getattr(self._pynvml, "NVMLError_NotSupported", ())
        for name, read in list(self._readers.items()):
            try:
                getattr(self.samples, name).append(read(self._pynvml, self._handle))
            except Exception as err:  # noqa: BLE001 - telemetry never fails the client
                self._readers.pop(name, None)
                expected = first and isinstance(err, not_supported)
                log.log(logging.DEBUG if expected else logging.INFO, "GPU telemetry leaves out %s: %r", name, err)

    def metrics(self) -> dict[str, float]:
        """Reply metrics (app/protocol.py); only GPU_TELEMETRY = 0 when absent (MetricRecord has no null).

        The values are device-wide: they include other processes on the same GPU.
        """
        s = self.samples
        if not self.available:
            return {GPU_TELEMETRY: 0.0}
        out = {GPU_TELEMETRY: 1.0}
        if s.util_pct:
            out[GPU_UTIL_MEAN_PCT] = sum(s.util_pct) / len(s.util_pct)
            out[GPU_UTIL_MAX_PCT] = max(s.util_pct)
        if s.mem_used_mb:
            out[GPU_MEM_USED_MAX_MB] = max(s.mem_used_mb)
        if s.temp_c:
            out[GPU_TEMP_MAX_C] = max(s.temp_c)
        if s.power_w:
            out[GPU_POWER_MEAN_W] = sum(s.power_w) / len(s.power_w)
        return out

"""GPU telemetry without a GPU: a fake `pynvml` module and a mocked `torch.cuda`.

The fake NVML has four GPUs with distinct UUIDs (and optionally MIG slices); the mocked torch
numbers the devices CUDA_VISIBLE_DEVICES leaves visible, as CUDA does, and reports their UUIDs
the way torch prints them (bare hex) and their PCI bus ids as ints.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

import app.task.telemetry as telemetry
from app.task.telemetry import GpuTelemetry

UUIDS = [f"{i}{i}{i}{i}{i}{i}{i}{i}-aaaa-bbbb-cccc-00000000000{i}" for i in range(4)]  # bare, as torch prints them
MIG_UUID = "99999999-aaaa-bbbb-cccc-999999999999"
ALL_KEYS = {
    "gpu-telemetry",
    "gpu-device-util-mean-pct",
    "gpu-device-util-max-pct",
    "gpu-device-mem-used-max-mb",
    "gpu-device-temp-max-c",
    "gpu-device-power-mean-w",
}


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's own spelling
    pass


class NVMLError_NotFound(NVMLError):  # noqa: N801
    pass


@dataclass(frozen=True)
class Handle:
    uuid: str  # NVML's form: GPU-... or MIG-...
    index: int | None  # NVML index of a whole GPU; None for a MIG slice


class FakeNvml(types.ModuleType):
    """The part of pynvml telemetry uses; counts calls, fails on demand."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NotFound = NVMLError_NotFound
    NVML_TEMPERATURE_GPU = 0

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.calls: Counter[str] = Counter()
        self.devices = [Handle(f"GPU-{u}", i) for i, u in enumerate(UUIDS)]
        self.migs = [Handle(f"MIG-{MIG_UUID}", None)]
        self.init_error: Exception | None = None
        self.unsupported: set[str] = set()  # reading names that raise NotSupported (per handle kind below)
        self.mig_unsupported = {"util", "temp", "power"}  # what NVML refuses on a MIG handle
        self.fail_after: dict[str, int] = {}  # reading name -> raise NVMLError after this many calls
        self.atexit: list[tuple] = []  # the shutdowns telemetry registered; tests run them as the interpreter would
        self._lock = threading.Lock()

    def _count(self, name: str) -> int:
        with self._lock:
            self.calls[name] += 1
            return self.calls[name]

    def nvmlInit(self) -> None:
        self._count("nvmlInit")
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self._count("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        self._count("nvmlDeviceGetHandleByIndex")
        return self.devices[index]

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> Handle:
        raise NVMLError_NotFound(f"no device at PCI bus id {bus_id!r}")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Handle:
        self._count("nvmlDeviceGetHandleByUUID")
        for handle in self.devices + self.migs:
            if handle.uuid == uuid:
                return handle
        raise NVMLError_NotFound(uuid)

    def nvmlDeviceGetUUID(self, handle: Handle) -> bytes:
        return handle.uuid.encode()  # older pynvml returned bytes; telemetry accepts both

    def _read(self, name: str, handle: Handle) -> int:
        n = self._count(name)
        if name in self.unsupported or (handle.index is None and name in self.mig_unsupported):
            raise NVMLError_NotSupported(name)
        if n > self.fail_after.get(name, 10**9):
            raise NVMLError(f"GPU is lost ({name})")
        return n - 1  # 0, 1, 2, ...

    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> types.SimpleNamespace:
        return types.SimpleNamespace(gpu=self._read("util", handle), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: Handle) -> types.SimpleNamespace:
        return types.SimpleNamespace(used=(100 + self._read("mem", handle)) * 2**20)

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        return 50 + self._read("temp", handle)

    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:
        self._read("power", handle)
        return 200_000  # mW


class FakeCUuuid:
    """torch._C._CUuuid: `str()` gives the bare 8-4-4-4-12 hex, no GPU-/MIG- prefix."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __str__(self) -> str:
        return self._text


@pytest.fixture(autouse=True)
def fresh_nvml_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a fresh process would: NVML not initialised, no failure remembered."""
    monkeypatch.setattr(telemetry, "_nvml_ready", False)
    monkeypatch.setattr(telemetry, "_nvml_error", None)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """A fake NVML as `pynvml`, and torch.cuda seeing its GPUs through CUDA_VISIBLE_DEVICES."""
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(telemetry.atexit, "register", lambda func, *args: fake.atexit.append((func, args)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def visible() -> list[str]:
        value = os.environ.get("CUDA_VISIBLE_DEVICES")
        if value is None:
            return UUIDS
        if value.startswith("MIG-"):
            return [value.removeprefix("MIG-")]
        return [UUIDS[int(i)] for i in value.split(",") if i.strip() and int(i) >= 0]

    def get_device_properties(index: int) -> types.SimpleNamespace:
        uuid = visible()[index]
        bus_id = 0x41 + 0x10 * UUIDS.index(uuid) if uuid in UUIDS else 0  # an int, as torch reports it
        return types.SimpleNamespace(uuid=FakeCUuuid(uuid), pci_bus_id=bus_id)

    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(visible()))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible()))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake


def run_exit_handlers(fake: FakeNvml) -> None:
    for func, args in fake.atexit:
        func(*args)


# --- the torch device -> NVML device mapping ---------------------------------------------


def test_torch_uuid_to_nvml_uuid_is_pure_and_handles_both_forms():
    bare = UUIDS[2]
    assert telemetry.nvml_uuid_candidates(bare) == (f"GPU-{bare}", f"MIG-{bare}")
    assert telemetry.nvml_uuid_candidates(FakeCUuuid(bare)) == (f"GPU-{bare}", f"MIG-{bare}")
    assert telemetry.nvml_uuid_candidates(f"GPU-{bare}") == (f"GPU-{bare}",)
    assert telemetry.nvml_uuid_candidates(f"MIG-{MIG_UUID}") == (f"MIG-{MIG_UUID}",)


def test_cuda_visible_devices_maps_cuda0_to_the_nvml_device_with_index_3(nvml, monkeypatch):
    """Under Ray on a 4-GPU host torch's cuda:0 can be NVML index 3; the UUID finds it, an index would not."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with GpuTelemetry(torch.device("cuda", 0), interval_s=0.01) as t:
        pass
    assert t._handle == nvml.devices[3] and t._handle.index == 3
    assert t.metrics()["gpu-telemetry"] == 1.0
    assert telemetry.nvml_uuid(torch.device("cuda", 0)) == f"GPU-{torch.cuda.get_device_properties(0).uuid}"
    assert telemetry.nvml_uuid(torch.device("cuda")) == f"GPU-{UUIDS[3]}"  # no index: the current device
    assert nvml.calls["nvmlDeviceGetHandleByIndex"] == 0


def test_every_visible_device_maps_to_its_own_nvml_device(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert [telemetry.nvml_uuid(i) for i in range(2)] == [f"GPU-{UUIDS[2]}", f"GPU-{UUIDS[0]}"]


def test_nvml_uuid_raises_when_nvml_has_no_such_device(nvml, monkeypatch):
    """The smoke-test helper fails loudly; only the telemetry swallows errors."""
    nvml.devices = nvml.devices[:1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(LookupError, match=UUIDS[3]):
        telemetry.nvml_uuid(0)


# --- one NVML init per process, one shutdown ---------------------------------------------


def test_nvml_is_initialised_once_for_concurrent_contexts_and_shut_down_once(nvml):
    """The in-process simulation grid runs several clients' telemetry at once, in threads."""
    metrics: list[dict[str, float]] = []

    def client() -> None:
        with GpuTelemetry(torch.device("cuda", 0), interval_s=0.005) as t:
            time.sleep(0.03)
        metrics.append(t.metrics())

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [m["gpu-telemetry"] for m in metrics] == [1.0] * 8
    assert nvml.calls["nvmlInit"] == 1 and nvml.calls["nvmlShutdown"] == 0 and len(nvml.atexit) == 1
    run_exit_handlers(nvml)
    run_exit_handlers(nvml)
    assert nvml.calls["nvmlShutdown"] == 1
    with GpuTelemetry(torch.device("cuda", 0)) as late:  # after shutdown: absent, no second init
        pass
    assert late.metrics() == {"gpu-telemetry": 0.0} and nvml.calls["nvmlInit"] == 1


def test_nvml_is_shut_down_when_enter_fails_after_init(nvml, monkeypatch):
    """The handle lookup raises after nvmlInit: telemetry is absent and NVML still shut down once."""
    nvml.devices = nvml.devices[:1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # a GPU NVML does not list
    for _ in range(3):
        with GpuTelemetry(torch.device("cuda", 0)) as t:
            pass
        assert t.metrics() == {"gpu-telemetry": 0.0}
    assert nvml.calls["nvmlInit"] == 1
    run_exit_handlers(nvml)
    assert nvml.calls["nvmlShutdown"] == 1


def test_nvml_is_shut_down_when_sampling_raises(nvml):
    """The GPU falls off the bus mid-round: earlier samples are kept, nothing raises, one shutdown."""
    for name in ("util", "mem", "temp", "power"):
        nvml.fail_after[name] = 2
    with GpuTelemetry(torch.device("cuda", 0), interval_s=0.005) as t:
        time.sleep(0.05)
    assert not (t._thread and t._thread.is_alive())
    assert t.samples.util_pct == [0.0, 1.0] and t.metrics()["gpu-device-util-max-pct"] == 1.0
    assert nvml.calls["nvmlInit"] == 1
    run_exit_handlers(nvml)
    assert nvml.calls["nvmlShutdown"] == 1


def test_telemetry_is_absent_when_every_first_reading_fails_and_nvml_is_still_shut_down(nvml):
    for name in ("util", "mem", "temp", "power"):
        nvml.fail_after[name] = 0
    with GpuTelemetry(torch.device("cuda", 0)) as t:
        pass
    assert t.metrics() == {"gpu-telemetry": 0.0} and t._thread is None
    run_exit_handlers(nvml)
    assert (nvml.calls["nvmlInit"], nvml.calls["nvmlShutdown"]) == (1, 1)


def test_a_failed_nvml_init_is_not_retried_every_round(nvml):
    nvml.init_error = NVMLError("Driver Not Loaded")
    for _ in range(3):
        with GpuTelemetry(torch.device("cuda", 0)) as t:
            pass
        assert t.metrics() == {"gpu-telemetry": 0.0}
    assert nvml.calls["nvmlInit"] == 1 and nvml.atexit == []


# --- device-wide metrics, each quantity on its own ---------------------------------------


def test_telemetry_summarises_samples_under_device_wide_names(nvml):
    """The sampler thread runs; NVML values cover the whole GPU, so the names say `device`."""
    with GpuTelemetry(torch.device("cuda", 0), interval_s=0.01) as t:
        time.sleep(0.1)
    m = t.metrics()
    n = len(t.samples.util_pct)
    assert n >= 3 and set(m) == ALL_KEYS and m["gpu-telemetry"] == 1.0
    assert m["gpu-device-util-max-pct"] == n - 1 and m["gpu-device-util-mean-pct"] == pytest.approx((n - 1) / 2)
    assert m["gpu-device-mem-used-max-mb"] == 100 + len(t.samples.mem_used_mb) - 1
    assert m["gpu-device-temp-max-c"] == 50 + len(t.samples.temp_c) - 1 and m["gpu-device-power-mean-w"] == 200.0


def test_an_unsupported_quantity_is_left_out_not_the_whole_telemetry(nvml):
    """Some boards do not report power: the other quantities are still reported."""
    nvml.unsupported = {"power"}
    with GpuTelemetry(torch.device("cuda", 0), interval_s=0.005) as t:
        time.sleep(0.03)
    m = t.metrics()
    assert m["gpu-telemetry"] == 1.0 and set(m) == ALL_KEYS - {"gpu-device-power-mean-w"}
    assert nvml.calls["power"] == 1  # dropped after the first NotSupported, not retried every sample


def test_a_mig_slice_reports_memory_without_utilisation(nvml, monkeypatch):
    """On a MIG slice torch's UUID is the slice's (MIG-...) and NVML refuses utilisation."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"MIG-{MIG_UUID}")
    with GpuTelemetry(torch.device("cuda", 0), interval_s=0.005) as t:
        time.sleep(0.03)
    assert t._handle == nvml.migs[0] and telemetry.nvml_uuid(0) == f"MIG-{MIG_UUID}"
    m = t.metrics()
    assert set(m) == {"gpu-telemetry", "gpu-device-mem-used-max-mb"} and m["gpu-telemetry"] == 1.0


def test_telemetry_is_absent_without_a_gpu():
    with GpuTelemetry(torch.device("cpu")) as t:
        pass
    assert t.metrics() == {"gpu-telemetry": 0.0}


def test_telemetry_never_crashes_when_nvml_fails(monkeypatch):
    def broken(_device):
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(telemetry, "_nvml_handle", broken)
    with GpuTelemetry(torch.device("cuda")) as t:
        pass
    assert t.metrics() == {"gpu-telemetry": 0.0}


def test_telemetry_without_pynvml_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    with GpuTelemetry(torch.device("cuda")) as t:
        pass
    assert t.metrics() == {"gpu-telemetry": 0.0}


# --- GPUs hidden from a simulated ClientApp ----------------------------------------------


@pytest.mark.parametrize("hidden", ["", "-1"])
def test_hidden_gpus_notice_when_the_simulation_gives_no_gpu_share(nvml, monkeypatch, hidden):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    notice = telemetry.hidden_gpus_notice()
    assert notice is not None and "trains on the CPU although the machine has 4 NVIDIA GPU(s)" in notice
    assert 'client-resources-num-gpus=0.25"' in notice and "simulation.client_gpus=0.25" in notice
    assert "\n" not in notice


def test_no_hidden_gpus_notice_otherwise(nvml, monkeypatch):
    assert telemetry.hidden_gpus_notice() is None  # CUDA_VISIBLE_DEVICES unset
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert telemetry.hidden_gpus_notice() is None  # a GPU is visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    nvml.devices = []
    assert telemetry.hidden_gpus_notice() is None  # a machine without GPUs
    nvml.devices = [Handle("GPU-x", 0)]
    assert "has 1 NVIDIA GPU(s)" in (telemetry.hidden_gpus_notice() or "")
    with monkeypatch.context() as m:
        m.setattr(torch.version, "cuda", None)
        assert telemetry.hidden_gpus_notice() is None  # a CPU-only torch: a GPU share would not help
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert telemetry.hidden_gpus_notice() is None  # torch sees one anyway


def test_no_hidden_gpus_notice_when_nvml_fails(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    nvml.init_error = NVMLError("Driver Not Loaded")
    assert telemetry.hidden_gpus_notice() is None


def test_the_hidden_gpus_warning_is_logged_once_per_process(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    warnings: list[str] = []
    monkeypatch.setattr(telemetry.log, "warning", warnings.append)
    telemetry.log_hidden_gpus_once.cache_clear()
    try:
        for _ in range(3):
            telemetry.log_hidden_gpus_once()
    finally:
        telemetry.log_hidden_gpus_once.cache_clear()
    assert warnings == [telemetry.hidden_gpus_notice()]

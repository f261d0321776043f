"""One ClientApp's GPU memory: its share of a shared GPU, a hard cap at that share, and
giving cached memory back after each task.

Flower's fractional `client-resources-num-gpus` only tells Ray how many actors fit on a
GPU; nothing stops one of them from taking all of its memory (Flower #5855, #1383), and
PyTorch's caching allocator keeps what a task freed (#1942). So a ClientApp with a share
(Ray's reservation, or `train.gpu_memory_fraction` on a deployed node) caps its own
process with `torch.cuda.set_per_process_memory_fraction` and empties the cache after every
task. The cap covers PyTorch's allocator only: the CUDA context and library workspaces of the
process live outside it, so they are measured (NVML) and taken off the share first.
"""

from __future__ import annotations

import gc
import logging
import sys
from dataclasses import dataclass

import torch

from app.config.schema import ConfigError
from app.protocol import GPU_MEM_CAP_MB, GPU_MEM_SHARE
from app.task.telemetry import process_gpu_memory

log = logging.getLogger("flwr.fedgpu." + __name__)

# Outside PyTorch's allocator when NVML cannot say (CUDA context + cuBLAS/cuDNN handles: a
# fresh process with one model on an Ampere card holds 300-500 MiB).
DEFAULT_CONTEXT_BYTES = 512 * 2**20


@dataclass(frozen=True)
class MemoryCap:
    """This process's part of a GPU."""

    share: float  # of the device's total memory, as reserved or configured
    limit_bytes: int  # what PyTorch's allocator may hold: the share less the memory outside it

    def metrics(self) -> dict[str, float]:
        return {GPU_MEM_SHARE: self.share, GPU_MEM_CAP_MB: self.limit_bytes / 2**20}


def ray_gpu_share() -> float | None:
    """The GPU fraction Ray reserved for this process (a simulation actor); None outside Ray.

    Ray is only looked up, never imported: a deployed ClientApp must not pay for it.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        gpus = ray.get_runtime_context().get_assigned_resources().get("GPU")
    except Exception:  # noqa: BLE001 - the driver process (no task) has no assigned resources
        return None
    return float(gpus) if gpus else None


def memory_share(configured: float) -> float | None:
    """`train.gpu_memory_fraction` when set (> 0), else Ray's fractional reservation below one
    whole GPU; None means the process may use the whole device."""
    if configured > 0:
        return configured
    share = ray_gpu_share()
    return share if share is not None and share < 1 else None


def outside_allocator(device: torch.device) -> int:
    """Bytes this process holds on `device` beyond PyTorch's cache: NVML's figure for this
    process less `memory_reserved`, or DEFAULT_CONTEXT_BYTES where NVML cannot tell (no NVML, or
    a container's PID namespace hiding the process)."""
    used = process_gpu_memory(device)
    if used is None:
        return DEFAULT_CONTEXT_BYTES
    return max(0, used - torch.cuda.memory_reserved(device))


def cap_memory(device: torch.device, share: float | None) -> MemoryCap | None:
    """Cap PyTorch's allocator in this process at `share` of the device, less the memory the
    process holds outside the allocator; over it an allocation raises out-of-memory here
    instead of starving the other clients on the GPU. No share, or not CUDA: no cap."""
    if share is None or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    outside = outside_allocator(device)
    fraction = share - outside / total
    if fraction <= 0:
        raise ConfigError(
            f"GPU memory share {share:.3f} of {total / 2**30:.1f} GiB is {share * total / 2**20:.0f} MiB, "
            f"no more than this process's CUDA context ({outside / 2**20:.0f} MiB): put fewer clients on "
            "each GPU (a larger client-resources-num-gpus) or raise train.gpu_memory_fraction"
        )
    # torch wants an index here; a bare "cuda" (the usual ClientApp device) means the current one.
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return MemoryCap(share=share, limit_bytes=int(fraction * total))


def release(device: torch.device | None = None) -> None:
    """Give PyTorch's cached blocks back to the GPU (after a task, or an out-of-memory error),
    so that other clients on it (other processes) can have them. No device: whichever CUDA
    device this process has used, if any."""
    if device.type == "cuda" if device is not None else torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error of any PyTorch device (CUDA's is `torch.OutOfMemoryError`)."""
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))

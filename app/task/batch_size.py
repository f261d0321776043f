"""`train.batch_size=auto`: the largest batch that fits this node's GPU memory.

A 24 GB and an 80 GB card want different batches, and so does a client capped at a quarter
of a GPU. At its first task a node probes (forward and backward of growing batches of its own
examples, doubling then bisecting: O(log max) passes) and keeps the answer in its node state,
keyed by everything that changes it: the model, the input shape, the precision and layout, and
the memory limit. A later task with the same key skips the probe; a changed key probes again.
On the CPU, `auto` is the configured default (TrainConfig's).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, fields, replace

import torch
from flwr.app import ConfigRecord, RecordDict

from app.config.schema import ModelConfig, TrainConfig
from app.task.data import Examples
from app.task.gpu_memory import MemoryCap, is_oom, outside_allocator, release
from app.task.training import Steps, forward_backward, scratch

log = logging.getLogger("flwr.fedgpu." + __name__)

PROBES = "batch-size-probes"  # ConfigRecord in context.state: {probe key: batch size}
HEADROOM = 0.9  # of the limit: the allocator's fragmentation and the loop's extra tensors
AUTO = "auto"
CPU_DEFAULT: int = next(f.default for f in fields(TrainConfig) if f.name == "batch_size")  # type: ignore[assignment]


def largest_fitting(fits: Callable[[int], bool], maximum: int) -> int:
    """The largest b in [1, maximum] with `fits(b)`, for a `fits` that is true up to some size
    and false after it: doubling from 1, then bisecting. 0 when not even one example fits."""
    if maximum < 1 or not fits(1):
        return 0
    good, bad = 1, None
    while bad is None and good < maximum:
        size = min(2 * good, maximum)
        if fits(size):
            good = size
        else:
            bad = size
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def optimizer_state_bytes(steps: Steps) -> int:
    """What the optimizer allocates at its first step and a forward/backward probe cannot see:
    one buffer per trained parameter for SGD with momentum, two for Adam(W)."""
    per_param = {"sgd": 1 if steps.cfg.momentum > 0 else 0, "adam": 2, "adamw": 2}[steps.cfg.optimizer]
    return per_param * sum(p.numel() * p.element_size() for p in steps.model.parameters() if p.requires_grad)


def memory_limit(device: torch.device, cap: MemoryCap | None) -> int:
    """Bytes the loop may use: the cap, or the device's total less what the process holds
    outside PyTorch's allocator (as the cap counts it)."""
    if cap is not None:
        return cap.limit_bytes
    return torch.cuda.get_device_properties(device).total_memory - outside_allocator(device)


def probe(steps: Steps, data: Examples, limit_bytes: int) -> int:
    """Largest batch (at most `steps.cfg.max_batch_size`) whose forward and backward pass, plus
    the optimizer's state, stays within HEADROOM of `limit_bytes`; the examples are this node's
    own (repeated when it has fewer). Leaves no trace on the model (`scratch`)."""
    device = steps.precision.device
    extra = optimizer_state_bytes(steps)
    on_device = Examples(data.x.to(device), data.y.to(device))

    def fits(size: int) -> bool:
        idx = torch.arange(size, device=device) % len(on_device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            with scratch(steps):
                forward_backward(steps, on_device.x[idx], on_device.y[idx])
            ok = torch.cuda.max_memory_allocated(device) + extra <= HEADROOM * limit_bytes
        except Exception as err:  # noqa: BLE001 - anything but out-of-memory is re-raised
            if not is_oom(err):
                raise
            ok = False
        release(device)
        return ok

    return largest_fitting(fits, steps.cfg.max_batch_size)


def probe_key(model: ModelConfig, input_shape: tuple[int, ...], steps: Steps, limit_bytes: int) -> str:
    """Everything the probe's answer depends on, as text (stable across processes)."""
    p = steps.precision
    parts = [asdict(model), list(input_shape), p.amp, p.channels_last, str(p.device), limit_bytes]
    return json.dumps(parts + [steps.cfg.max_batch_size, steps.cfg.optimizer], sort_keys=True)


def resolve_batch_size(
    state: RecordDict,
    make_steps: Callable[[TrainConfig], Steps],
    cfg: TrainConfig,
    model: ModelConfig,
    data: Examples,
    cap: MemoryCap | None,
) -> int:
    """`cfg.batch_size`, or for `auto` the probed size for this node (cached in `state`), never
    more than the node's examples. `make_steps` builds the loop's Steps for a concrete size."""
    if cfg.batch_size != AUTO:
        return int(cfg.batch_size)
    steps = make_steps(replace(cfg, batch_size=1))
    device = steps.precision.device
    if device.type != "cuda":
        return min(CPU_DEFAULT, cfg.max_batch_size)
    limit = memory_limit(device, cap)
    key = probe_key(model, tuple(data.x.shape[1:]), steps, limit)
    probes = state[PROBES] if PROBES in state else ConfigRecord()
    if key not in probes:
        found = probe(steps, data, limit)
        if found == 0:
            raise RuntimeError(
                f"train.batch_size=auto: not even one example fits in {limit / 2**20:.0f} MiB of GPU memory "
                "for this model; give the client a larger share or use a smaller model"
            )
        log.info("train.batch_size=auto: %d fits in %.0f MiB (probed on %s)", found, limit / 2**20, device)
        probes[key] = found
        state[PROBES] = probes
    return min(int(probes[key]), len(data))

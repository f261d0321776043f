"""The ClientApp's training and evaluation loops.

One training loop (`fit`) for plain training and DP-SGD alike: what differs between
them is a `Steps` object (optimizer, batches, per-step details). Fast by construction,
in the spirit of airbench: the partition is copied to the device once (from pinned
memory, non-blocking), batches are index gathers on the device, loss and accuracy
accumulate on the device, and the host synchronises once per call. CUDA adds channels_last, cuDNN autotuning and autocast (bf16, or fp16 with
a GradScaler).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from app.config.registry import Registry
from app.config.schema import AMP_MODES, AMP_PRECISIONS, OPTIMIZERS, ConfigError, TrainConfig
from app.task.data import ImageTensors

log = logging.getLogger("flwr.fedgpu." + __name__)

_AMP_DTYPES = Registry("train.amp", AMP_PRECISIONS, {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None})
_OPTIMIZERS: Registry[Callable[[list[nn.Parameter], TrainConfig], torch.optim.Optimizer]] = Registry(
    "train.optimizer",
    OPTIMIZERS,
    {
        "sgd": lambda p, cfg: torch.optim.SGD(p, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay),
        "adam": lambda p, cfg: torch.optim.Adam(p, lr=cfg.lr, weight_decay=cfg.weight_decay),
        "adamw": lambda p, cfg: torch.optim.AdamW(p, lr=cfg.lr, weight_decay=cfg.weight_decay),
    },
)


@dataclass(frozen=True)
class Precision:
    """Where and in which precision to compute."""

    device: torch.device
    amp: str  # "fp16" | "bf16" | "off" after resolving "auto"

    @property
    def dtype(self) -> torch.dtype | None:
        return _AMP_DTYPES[self.amp]

    @property
    def channels_last(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class TrainStats:
    loss: float
    accuracy: float
    num_examples: int
    steps: int
    samples_per_s: float
    wall_time_s: float
    peak_gpu_mem_mb: float | None


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but no CUDA device is visible; use auto or cpu")
    return torch.device(name)


def resolve_precision(amp: str, device: torch.device) -> Precision:
    """Map the configured AMP mode to one this device supports (and say so when it differs)."""
    if amp not in AMP_MODES:
        raise ConfigError(f"train.amp={amp!r} is invalid: allowed: {', '.join(AMP_MODES)}")
    if device.type == "cuda":
        if amp == "auto":
            amp = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    elif amp == "auto":
        amp = "off"
    elif amp == "fp16":
        log.warning("train.amp=fp16 needs CUDA; using bf16 autocast on %s instead", device)
        amp = "bf16"
    return Precision(device=device, amp=amp)


def prepare_model(model: nn.Module, precision: Precision) -> nn.Module:
    model = model.to(precision.device)
    if precision.channels_last:
        torch.backends.cudnn.benchmark = True
        model = model.to(memory_format=torch.channels_last)
    return model


def to_device(data: ImageTensors, device: torch.device) -> ImageTensors:
    """One host-to-device copy of the whole partition (pinned, non-blocking on CUDA)."""
    if device.type != "cuda":
        return data
    return ImageTensors(
        x=data.x.pin_memory().to(device, non_blocking=True),
        y=data.y.pin_memory().to(device, non_blocking=True),
    )


def model_inputs(x: torch.Tensor, precision: Precision) -> torch.Tensor:
    """uint8 0-255 or float 0-1 images to float 0-1, in the device's preferred layout."""
    x = x.float().div_(255.0) if x.dtype == torch.uint8 else x.float()
    return x.contiguous(memory_format=torch.channels_last) if precision.channels_last else x


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return _OPTIMIZERS[cfg.optimizer](params, cfg)


def batch_indices(n: int, batch_size: int, generator: torch.Generator, device: torch.device) -> list[torch.Tensor]:
    """A seeded shuffle split into batches; a trailing batch of one is dropped (BatchNorm)."""
    perm = torch.randperm(n, generator=generator).to(device, non_blocking=True)
    batches = list(perm.split(batch_size))
    if len(batches) > 1 and len(batches[-1]) < 2:
        batches.pop()
    return batches


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(precision: Precision) -> contextlib.AbstractContextManager:
    """Autocast to the AMP dtype; no context at all in fp32 (cheaper per step)."""
    if precision.dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(precision.device.type, dtype=precision.dtype)


def start_clock(device: torch.device) -> float:
    """Reset the peak-memory counter, drain queued GPU work and start timing a training loop."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    return time.perf_counter()


class Steps:
    """What one training step does around the forward and backward pass of `fit`.

    This base is plain mini-batch training: a seeded shuffle per epoch, the configured
    optimizer, train.grad_clip. DP-SGD (`app.privacy.dp_sgd.DpSgdSteps`) overrides the
    parts it changes (Opacus's optimizer, Poisson batches, precision, fp32 grad samples,
    noise-only steps), so that the loop itself is written once.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig, precision: Precision, generator: torch.Generator) -> None:
        self.model, self.cfg, self.precision, self.generator = model, cfg, precision, generator
        self.net: nn.Module = model  # what the loop calls (DP-SGD: a per-example-gradient wrapper)
        self.optimizer = make_optimizer(model, cfg)

    def batches(self, n: int) -> Iterator[torch.Tensor]:
        """Index tensors on the device, one per step, drawn with `generator`."""
        for _ in range(self.cfg.epochs):
            yield from batch_indices(n, self.cfg.batch_size, self.generator, self.precision.device)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return model_inputs(x, self.precision)

    def before_step(self, scaler: torch.amp.GradScaler | None) -> None:
        """Between backward and the optimizer step: train.grad_clip (on unscaled gradients)."""
        if self.cfg.grad_clip > 0:
            if scaler is not None:
                scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)

    def empty_step(self) -> None:
        """A step on a batch without examples; `batch_indices` never draws one."""

    def close(self) -> None:
        """After the loop, also when it fails."""


def fit(steps: Steps, data: ImageTensors) -> TrainStats:
    """The training loop, for plain training and DP-SGD alike; `steps.model` is updated in place.

    Loss and accuracy are tallied once after the loop from the kept per-step losses
    and logits (N x classes values): per-step tallies cost ~3% of a small model's step.
    Every step counts, an empty batch's too (DP-SGD's noise-only step).
    """
    precision, optimizer = steps.precision, steps.optimizer
    device = precision.device
    steps.net.train()
    scaler = torch.amp.GradScaler(device.type) if precision.amp == "fp16" else None
    on_device = to_device(data, device)
    losses: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    taken = 0
    start = start_clock(device)
    try:
        for idx in steps.batches(len(data)):
            taken += 1
            optimizer.zero_grad(set_to_none=True)
            if len(idx) == 0:
                steps.empty_step()
                continue
            xb, yb = steps.inputs(on_device.x[idx]), on_device.y[idx]
            with autocast(precision):
                logits = steps.net(xb)
                loss = F.cross_entropy(logits, yb)
            if scaler is None:
                loss.backward()
                steps.before_step(None)
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                steps.before_step(scaler)
                scaler.step(optimizer)
                scaler.update()
            losses.append(loss.detach())
            outputs.append(logits.detach())
            labels.append(yb)
        synchronize(device)
        wall = time.perf_counter() - start
    finally:
        steps.close()
    return train_stats(losses, outputs, labels, len(data), wall, device, taken)


def train(model: nn.Module, data: ImageTensors, cfg: TrainConfig, precision: Precision, seed: int) -> TrainStats:
    """`cfg.epochs` epochs of mini-batch training; the model is updated in place."""
    return fit(Steps(model, cfg, precision, torch.Generator().manual_seed(seed)), data)


def train_stats(
    losses: list[torch.Tensor],
    outputs: list[torch.Tensor],
    labels: list[torch.Tensor],
    num_examples: int,
    wall: float,
    device: torch.device,
    steps: int,
) -> TrainStats:
    """Tally the kept per-step mean losses, logits and labels once, after the loop."""
    seen = sum(len(y) for y in labels)
    if seen:
        sizes = torch.tensor([len(y) for y in labels], dtype=torch.float32)
        loss_mean = float((torch.stack(losses).float().cpu() * sizes).sum()) / seen
        accuracy = float((torch.cat(outputs).argmax(1) == torch.cat(labels)).sum()) / seen
    else:
        loss_mean, accuracy = float("nan"), float("nan")
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return TrainStats(
        loss=loss_mean,
        accuracy=accuracy,
        num_examples=num_examples,
        steps=steps,
        samples_per_s=seen / wall if wall > 0 else 0.0,
        wall_time_s=wall,
        peak_gpu_mem_mb=peak,
    )


@torch.no_grad()
def evaluate(model: nn.Module, data: ImageTensors, precision: Precision, batch_size: int = 512) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) over `data`; (nan, nan) when it is empty."""
    if len(data) == 0:
        return float("nan"), float("nan")
    device = precision.device
    model.eval()
    on_device = to_device(data, device)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, len(data), batch_size):
        xb = model_inputs(on_device.x[start : start + batch_size], precision)
        yb = on_device.y[start : start + batch_size]
        with autocast(precision):
            logits = model(xb)
        loss_sum += F.cross_entropy(logits.float(), yb, reduction="sum")
        correct += (logits.argmax(1) == yb).sum()
    return float(loss_sum) / len(data), float(correct) / len(data)

"""The ClientApp's training and evaluation loops.

One training loop (`fit`) for plain training and DP-SGD alike: what differs between
them is a `Steps` object (optimizer, batches, per-step details). Fast by construction,
in the spirit of airbench: the partition is copied to the device once (from pinned
memory, non-blocking), batches are index gathers on the device, loss and accuracy
accumulate on the device, and the host synchronises once per call. CUDA adds autocast
(bf16, or fp16 with a GradScaler whose state a node keeps between rounds), channels_last
where it pays (not for GroupNorm models: see `use_channels_last`), optional cuDNN
autotuning with every batch shape warmed up outside the timer, a deterministic mode, and
timing with CUDA events on a stream of the loop's own (threads may share one GPU).
The loss and the metrics are the task's (`app.task.metrics.Task`; default: cross-entropy
and accuracy).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from app.config.registry import Registry
from app.config.schema import AMP_MODES, AMP_PRECISIONS, CHANNELS_LAST_MODES, OPTIMIZERS, ConfigError, TrainConfig
from app.task.data import Examples
from app.task.gpu_memory import is_oom, release
from app.task.metrics import DEFAULT_TASK, Task

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
    """Where, in which precision and in which memory layout to compute."""

    device: torch.device
    amp: str  # "fp16" | "bf16" | "off" after resolving "auto"
    channels_last: bool = False  # decided per model: `with_layout`

    @property
    def dtype(self) -> torch.dtype | None:
        return _AMP_DTYPES[self.amp]


@dataclass
class TrainStats:
    loss: float
    accuracy: float
    num_examples: int
    steps: int
    samples_per_s: float
    wall_time_s: float
    peak_gpu_mem_mb: float | None  # None off CUDA, and when another loop shared the GPU meanwhile
    skipped_steps: int = 0  # fp16: steps the GradScaler skipped for inf/NaN gradients (counted in `steps`)
    scaler_state: dict[str, float | int] = field(default_factory=dict)  # fp16: GradScaler state to keep
    examples_seen: int = 0  # examples over all steps (epochs x examples for plain training)
    oom_retries: int = 0  # batches redone in smaller micro-batches after an out-of-memory error
    micro_batch_size: int = 0  # the micro-batch the loop ended with (= the batch size without OOM)


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; a CUDA device this process cannot see is an error.

    Indices are relative to CUDA_VISIBLE_DEVICES: under Ray's and Docker's GPU reservations
    every process sees its own GPU as cuda:0, so `cuda:1` would fail in every ClientApp
    with "invalid device ordinal" mid-run.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but no CUDA device is visible; use auto or cpu")
    visible = torch.cuda.device_count()
    if device.index is not None and device.index >= visible:
        raise ConfigError(
            f"device {name!r}: this process sees {visible} CUDA device(s) (cuda:0..cuda:{visible - 1}); "
            f"indices are relative to CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}, "
            "and Ray or Docker GPU reservations show each process its GPU as cuda:0: use cuda or auto"
        )
    return device


def bf16_native(device: torch.device) -> bool:
    """bf16 tensor cores exist from compute capability 8.0 (Ampere) on. `is_bf16_supported()`
    also counts emulation (Turing: slow) and asks about the current device, not this one."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_precision(amp: str, device: torch.device) -> Precision:
    """Map the configured AMP mode to one this device supports (and say so when it differs)."""
    if amp not in AMP_MODES:
        raise ConfigError(f"train.amp={amp!r} is invalid: allowed: {', '.join(AMP_MODES)}")
    if device.type == "cuda":
        if amp == "auto":
            amp = "bf16" if bf16_native(device) else "fp16"
    elif amp == "auto":
        amp = "off"
    elif amp == "fp16":
        log.warning("train.amp=fp16 needs CUDA; using bf16 autocast on %s instead", device)
        amp = "bf16"
    return Precision(device=device, amp=amp)


def use_channels_last(model: nn.Module, setting: str, device: torch.device, images: bool = True) -> bool:
    """`auto`: channels_last on CUDA unless the model has GroupNorm, whose CUDA kernels call
    `.contiguous()` (and run in fp32 under autocast), converting layouts at every layer.
    Only image batches (N x C x H x W) have the layout: other data never uses it."""
    if setting not in CHANNELS_LAST_MODES:
        raise ConfigError(f"train.channels_last={setting!r} is invalid: allowed: {', '.join(CHANNELS_LAST_MODES)}")
    if not images:
        if setting == "on":
            log.warning("train.channels_last=on: the data are not images (N x C x H x W); training without it")
        return False
    if setting != "auto":
        return setting == "on"
    return device.type == "cuda" and not any(isinstance(m, nn.GroupNorm) for m in model.modules())


def with_layout(precision: Precision, model: nn.Module, setting: str, images: bool = True) -> Precision:
    """`precision` with the memory layout `use_channels_last` picks for `model` (and the data)."""
    return replace(precision, channels_last=use_channels_last(model, setting, precision.device, images))


def round_lr(cfg: TrainConfig, rnd: int, rounds: int) -> float:
    """The learning rate of round `rnd` (1-based) of `rounds` (`train.lr_schedule`): constant, or
    linear warm-up over `warmup_rounds` then a cosine from `lr` (the first round after warm-up)
    down to `lr * min_lr_ratio` (the last round). Nodes step it from the round number alone."""
    if cfg.lr_schedule == "constant" or rnd < 1:
        return cfg.lr
    if rnd <= cfg.warmup_rounds:
        return cfg.lr * rnd / cfg.warmup_rounds
    progress = min(1.0, (rnd - cfg.warmup_rounds - 1) / max(1, rounds - cfg.warmup_rounds - 1))
    low = cfg.lr * cfg.min_lr_ratio
    return low + (cfg.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def prepare_model(model: nn.Module, precision: Precision) -> nn.Module:
    model = model.to(precision.device)
    if precision.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def to_device(data: Examples, device: torch.device) -> Examples:
    """One host-to-device copy of the whole partition (pinned, non-blocking on CUDA)."""
    if device.type != "cuda":
        return data
    return Examples(
        x=data.x.pin_memory().to(device, non_blocking=True),
        y=data.y.pin_memory().to(device, non_blocking=True),
    )


def model_inputs(x: torch.Tensor, precision: Precision) -> torch.Tensor:
    """uint8 0-255 to float 0-1, floats as float32, other integers (token ids) as they are;
    images in the device's preferred layout."""
    if x.dtype == torch.uint8:
        x = x.float().div_(255.0)
    elif x.is_floating_point():
        x = x.float()
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


def autocast(precision: Precision) -> contextlib.AbstractContextManager:
    """Autocast to the AMP dtype; no context at all in fp32 (cheaper per step)."""
    if precision.dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(precision.device.type, dtype=precision.dtype)


class _Tenants:
    """Which loops on this process's GPU overlapped in time. The peak-memory counter is
    process-wide: a loop reports it only when it had the process to itself throughout (the
    in-process grid trains several nodes in threads; the server may evaluate meanwhile)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._entries = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[list[bool]]:
        """Yields [alone at entry]; on exit the flag says whether it stayed alone throughout."""
        with self._lock:
            alone = [self._active == 0]
            self._active += 1
            self._entries += 1
            entries = self._entries
        try:
            yield alone
        finally:
            with self._lock:
                self._active -= 1
                alone[0] = alone[0] and self._entries == entries


GPU_TENANTS = _Tenants()


class LoopClock:
    """Wall time of a training loop and, on CUDA, the loop's own peak memory.

    On CUDA the loop runs on a stream of its own and is timed with events on that stream:
    `torch.cuda.synchronize` would also wait for other threads' work on the same GPU.
    Use as a context around the whole loop; `start()` after the untimed set-up.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.peak_mb: float | None = None
        self._stack = contextlib.ExitStack()
        self._alone = [False]
        self._t0 = 0.0

    def __enter__(self) -> LoopClock:
        self._alone = self._stack.enter_context(GPU_TENANTS.hold()) if self.cuda else [False]
        if self.cuda:
            self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the model was moved there
            self._stack.enter_context(torch.cuda.stream(self._stream))
            if self._alone[0]:
                torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(self._stream)
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since `start()`, once the loop's queued work has finished."""
        if not self.cuda:
            return time.perf_counter() - self._t0
        end = torch.cuda.Event(enable_timing=True)
        end.record(self._stream)
        end.synchronize()
        return self._start.elapsed_time(end) / 1000.0

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self._stream.synchronize()  # the caller reads the model on its own stream next
        self._stack.close()
        if self.cuda and self._alone[0]:
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20


@contextlib.contextmanager
def kernel_settings(cfg: TrainConfig, fixed_shapes: bool) -> Iterator[None]:
    """cuDNN autotuning only where batch shapes repeat, deterministic kernels on request.

    Deterministic also means one intra-op CPU thread: CPU kernels split their reductions by
    thread count, so the same task would round differently in a ClientApp given 1 CPU and in
    one given 2 (Flower's simulation sizes workers by `client-resources-num-cpus`).
    These are process-wide flags, restored afterwards; nodes trained concurrently in one
    process (the in-process grid) share them, which is fine as they share one config.
    """
    cudnn = torch.backends.cudnn
    before = (cudnn.benchmark, cudnn.deterministic, torch.are_deterministic_algorithms_enabled())
    threads = torch.get_num_threads()
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic workspace
        torch.set_num_threads(1)
    cudnn.benchmark = cfg.cudnn_benchmark and fixed_shapes and not cfg.deterministic
    cudnn.deterministic = cfg.deterministic
    torch.use_deterministic_algorithms(cfg.deterministic)
    try:
        yield
    finally:
        cudnn.benchmark, cudnn.deterministic = before[0], before[1]
        torch.use_deterministic_algorithms(before[2])
        torch.set_num_threads(threads)


def make_scaler(precision: Precision, state: dict[str, float | int] | None) -> torch.amp.GradScaler | None:
    """fp16's GradScaler, continuing from this node's last round (`TrainStats.scaler_state`):
    a fresh scaler starts at 2**16 and skips the first steps of every round for overflow."""
    if precision.amp != "fp16":
        return None
    scaler = torch.amp.GradScaler(precision.device.type)
    if state:
        scaler.load_state_dict(dict(state))
    return scaler


class Steps:
    """What one training step does around the forward and backward pass of `fit`.

    This base is plain mini-batch training: a seeded shuffle per epoch, the configured
    optimizer, train.grad_clip. DP-SGD (`app.privacy.dp_sgd.DpSgdSteps`) overrides the
    parts it changes (Opacus's optimizer, Poisson batches, precision, fp32 grad samples,
    noise-only steps), so that the loop itself is written once.
    """

    fixed_shapes = True  # batches have at most two sizes (full, last): worth autotuning
    # Why a batch may not run as micro-batches after an out-of-memory error (None: it may).
    unsplittable: str | None = None
    # The loss weight of the batch `batches` yielded last: 1 here; local DDP ranks weight their
    # slice of a global batch so that the ranks' mean gradient is the global batch's.
    weight = 1.0

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        precision: Precision,
        generator: torch.Generator,
        task: Task | None = None,
        proximal_mu: float = 0.0,
        correction: dict[str, torch.Tensor] | None = None,
        anchor: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.model, self.cfg, self.precision, self.generator = model, cfg, precision, generator
        self.task = task or DEFAULT_TASK  # the loss `fit` and `warm_up` use, the accuracy `fit` reports
        self.net: nn.Module = model  # what the loop calls (DP-SGD: a per-example-gradient wrapper)
        self.optimizer = make_optimizer(model, cfg)
        # FedProx (strategy.proximal_mu): every step is pulled towards `anchor` (parameter name ->
        # tensor; default: the model as it is now, i.e. as received), Ditto's personal model
        # towards the global one (app/task/ditto.py)
        self.proximal_mu = proximal_mu
        params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        if anchor is None and proximal_mu > 0:
            anchor = {k: p.detach().clone() for k, p in params.items()}
        self.anchor = [(params[k], a) for k, a in (anchor or {}).items() if k in params] if proximal_mu > 0 else []
        # SCAFFOLD: parameter name -> c - c_i, added to its gradient every step (app/task/scaffold.py)
        self.correction = [(params[k], c) for k, c in (correction or {}).items()]
        if not isinstance(cfg.batch_size, int):
            raise TypeError(f"train.batch_size={cfg.batch_size!r}: resolve 'auto' first (app.task.batch_size)")

    def batches(self, n: int) -> Iterator[torch.Tensor]:
        """Index tensors on the device, one per forward and backward pass, drawn with `generator`:
        `train.epochs` passes over the data, or with `train.max_steps` that many optimizer steps
        (each `train.grad_accum_steps` batches), as many passes as they take."""
        if not self.cfg.max_steps:
            for _ in range(self.cfg.epochs):
                yield from self.epoch(n)
            return
        left = self.cfg.max_steps * self.cfg.grad_accum_steps
        while left:
            for idx in self.epoch(n):
                yield idx
                left -= 1
                if not left:
                    return

    def epoch(self, n: int) -> Iterator[torch.Tensor]:
        """One pass over the data in seeded batches."""
        yield from batch_indices(n, self.cfg.batch_size, self.generator, self.precision.device)

    def batch_sizes(self, n: int) -> list[int]:
        """Every size `batches` yields (as `batch_indices` cuts them), for the warm-up."""
        full, tail = min(self.cfg.batch_size, n), n % self.cfg.batch_size if n > self.cfg.batch_size else 0
        return [full] + ([tail] if tail >= 2 else [])

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return model_inputs(x, self.precision)

    def before_step(self, scaler: torch.amp.GradScaler | None) -> None:
        """Between backward and the optimizer step, on unscaled gradients: SCAFFOLD's correction
        c - c_i (`correction`), FedProx's pull, the
        gradient of mu/2 ||w - w_received||^2, i.e. mu (w - w_received) (`proximal_mu`; Li et al.
        2020 add the term to the loss: the same gradient, without a second forward pass), then
        train.grad_clip."""
        if scaler is not None and (self.cfg.grad_clip > 0 or self.anchor or self.correction):
            scaler.unscale_(self.optimizer)
        for param, c in self.correction:  # SCAFFOLD's drift correction
            if param.grad is not None:
                param.grad.add_(c.to(param.grad.device))
        for param, anchor in self.anchor:  # FedProx
            if param.grad is not None:
                param.grad.add_(param.detach() - anchor.to(param.device), alpha=self.proximal_mu)
        if self.cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)

    def empty_step(self) -> None:
        """A step on a batch without examples; `batch_indices` never draws one."""

    def close(self) -> None:
        """After the loop, also when it fails."""


@contextlib.contextmanager
def scratch(steps: Steps) -> Iterator[None]:
    """Passes that must leave no trace: the model's buffers (BatchNorm statistics), the RNG
    streams and the gradients are as they were afterwards."""
    device = steps.precision.device
    saved = [b.detach().clone() for b in steps.model.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        steps.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, value in zip(steps.model.buffers(), saved, strict=True):
                buffer.copy_(value)


def forward_backward(
    steps: Steps, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0, scaler: torch.amp.GradScaler | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward pass of the task's loss times `weight` (scaled by `scaler`
    for fp16); gradients are added. Returns the weighted loss and the logits, detached."""
    with autocast(steps.precision):
        logits = steps.net(steps.inputs(x))
        loss = steps.task.loss(logits, y)
    if weight != 1.0:
        loss = loss * weight
    (loss if scaler is None else scaler.scale(loss)).backward()
    return loss.detach(), logits.detach()


def warm_up(steps: Steps, data: Examples) -> None:
    """One forward and backward per batch size the loop will see, before the clock starts
    (`fit` does it on CUDA): lazy kernel loading, cuBLAS set-up and cuDNN autotuning would
    otherwise be timed (in a deployed node's fresh process, every round). A size that runs out
    of memory ends the warm-up: the loop meets the same error and retries in micro-batches
    (an H200 run under a 1.5 GiB cap crashed here, before the loop could)."""
    oom = False
    with scratch(steps):
        for size in steps.batch_sizes(len(data)):
            try:
                forward_backward(steps, data.x[:size], data.y[:size])
            except Exception as err:  # noqa: BLE001 - anything but out-of-memory is re-raised
                if not is_oom(err):
                    raise
                oom = True
                break
    if oom:  # outside the handler, so the failed pass's tensors are gone
        release(steps.precision.device)
        log.info("warm-up ran out of memory on a batch of %d: the loop will split it", size)


def accumulation_groups(batches: Iterator[torch.Tensor], k: int) -> Iterator[tuple[torch.Tensor, float, bool, bool]]:
    """(batch, its share of the group's loss, first of its group, last of its group) for groups of
    `k` batches whose gradients make one optimizer step (`train.grad_accum_steps`); the last group
    may be shorter. k = 1: every batch is its own step, as without accumulation."""
    if k == 1:
        for idx in batches:
            yield idx, 1.0, True, True
        return
    listed = list(batches)  # index tensors: cheap to hold, and the last group's size must be known
    for start in range(0, len(listed), k):
        group = listed[start : start + k]
        for i, idx in enumerate(group):
            yield idx, 1.0 / len(group), i == 0, i == len(group) - 1


def accumulate(
    steps: Steps,
    data: Examples,
    idx: torch.Tensor,
    micro: int | None,
    scaler: torch.amp.GradScaler | None,
    share: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of the batch `idx` in micro-batches of `micro` examples (None: the
    whole batch at once, as before any out-of-memory error), each loss
    weighted by its share of the batch, so the gradients add up to the whole batch's (the task's
    loss is a batch mean), times `steps.weight`. One micro-batch of weight 1 (the usual case)
    is the plain step, bit for bit. Returns the batch's mean loss and its logits."""
    chunks, weight = (idx,) if micro is None else idx.split(micro), steps.weight * share
    parts = [forward_backward(steps, data.x[c], data.y[c], weight * len(c) / len(idx), scaler) for c in chunks]
    loss = parts[0][0] if len(parts) == 1 else torch.stack([loss for loss, _ in parts]).sum()
    logits = parts[0][1] if len(parts) == 1 else torch.cat([logits for _, logits in parts])
    return (loss if weight in (0.0, 1.0) else loss / weight), logits


def smaller_micro_batch(steps: Steps, micro: int | None, batch: int, err: BaseException) -> int:
    """The micro-batch to retry a batch of `batch` examples with after `err` (`micro`: the
    current one, None for whole batches); re-raises what halving cannot fix."""
    current = batch if micro is None else min(micro, batch)
    if not is_oom(err):
        raise err
    if steps.unsplittable or steps.cfg.grad_accum_steps > 1:
        why = steps.unsplittable or "with train.grad_accum_steps > 1 a batch is not split after out-of-memory"
        err.add_note(f"{why}: lower train.batch_size")
        raise err
    if current <= 1:
        err.add_note("out of memory with one example per micro-batch: the model does not fit this node's memory")
        raise err
    return current // 2


def optimizer_step(steps: Steps, scaler: torch.amp.GradScaler | None) -> torch.Tensor | int:
    """The optimizer step after `before_step`; with fp16's GradScaler, 1 on the device when the
    scaler skipped it (it tells only by lowering its scale, and reading that with get_scale()
    would synchronise every step, so it is compared on the device), else 0."""
    if scaler is None:
        steps.before_step(None)
        steps.optimizer.step()
        return 0
    steps.before_step(scaler)
    scale = scaler._scale.clone()  # noqa: SLF001 - set by scale() in the backward pass
    scaler.step(steps.optimizer)
    scaler.update()
    return scaler._scale < scale  # noqa: SLF001


def fit(steps: Steps, data: Examples, scaler_state: dict[str, float | int] | None = None) -> TrainStats:
    """The training loop, for plain training and DP-SGD alike; `steps.model` is updated in place.

    Loss and accuracy are tallied once after the loop from the kept per-step losses
    and logits (N x classes values): per-step tallies cost ~3% of a small model's step.
    Every step counts, an empty batch's too (DP-SGD's noise-only step), and so do steps
    the fp16 GradScaler skipped (reported apart, `skipped_steps`). `scaler_state`: the
    node's GradScaler state from its previous round.
    """
    precision, optimizer = steps.precision, steps.optimizer
    device = precision.device
    steps.net.train()
    scaler = make_scaler(precision, scaler_state)
    skipped = torch.zeros((), dtype=torch.int64, device=device)
    losses: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    taken = retries = 0
    micro: int | None = None  # None: each batch whole (DP-SGD's Poisson batches vary around the batch size)
    try:
        with kernel_settings(steps.cfg, steps.fixed_shapes), LoopClock(device) as clock:
            on_device = to_device(data, device)
            if device.type == "cuda":
                warm_up(steps, on_device)
            clock.start()
            for idx, share, first, last in accumulation_groups(steps.batches(len(data)), steps.cfg.grad_accum_steps):
                taken += 1
                if first:
                    optimizer.zero_grad(set_to_none=True)
                if len(idx) == 0:
                    steps.empty_step()
                    continue
                while True:
                    try:
                        loss, logits = accumulate(steps, on_device, idx, micro, scaler, share)
                        break
                    except Exception as err:  # noqa: BLE001 - anything but out-of-memory is re-raised
                        micro = smaller_micro_batch(steps, micro, len(idx), err)
                    # Outside the handler, so the failed pass's tensors are gone before retrying.
                    optimizer.zero_grad(set_to_none=True)
                    release(device)
                    retries += 1
                    log.warning("out of memory on a batch of %d: retrying in micro-batches of %d", len(idx), micro)
                yb = on_device.y[idx]
                if last:  # a group's gradients add up before its one step
                    skipped += optimizer_step(steps, scaler)
                if steps.weight > 0:  # a DDP rank's stand-in for an empty slice is not tallied
                    kept, kept_y = steps.task.keep(logits, yb)
                    losses.append(loss)
                    outputs.append(kept)
                    labels.append(kept_y)
            wall = clock.stop()
    finally:
        steps.close()
    stats = train_stats(losses, outputs, labels, len(data), wall, clock.peak_mb, taken, steps.task)
    stats.oom_retries, stats.micro_batch_size = retries, steps.cfg.batch_size if micro is None else micro
    if scaler is not None:
        stats.skipped_steps, stats.scaler_state = int(skipped), scaler.state_dict()
    return stats


def train(
    model: nn.Module,
    data: Examples,
    cfg: TrainConfig,
    precision: Precision,
    seed: int,
    scaler_state: dict[str, float | int] | None = None,
    task: Task | None = None,
    proximal_mu: float = 0.0,
    correction: dict[str, torch.Tensor] | None = None,
) -> TrainStats:
    """`cfg.epochs` epochs of mini-batch training with `task`'s loss (default: cross-entropy),
    with FedProx's pull towards the model as received when `proximal_mu` > 0 and SCAFFOLD's
    `correction`; the model is updated in place."""
    steps = Steps(model, cfg, precision, torch.Generator().manual_seed(seed), task, proximal_mu, correction)
    return fit(steps, data, scaler_state)


def train_stats(
    losses: list[torch.Tensor],
    outputs: list[torch.Tensor],
    labels: list[torch.Tensor],
    num_examples: int,
    wall: float,
    peak_mb: float | None,
    steps: int,
    task: Task = DEFAULT_TASK,
) -> TrainStats:
    """Tally the kept per-step mean losses, logits and labels once, after the loop (each loss
    is its batch's mean, so weighting by batch size gives the mean over every example seen)."""
    seen = sum(len(y) for y in labels)
    if seen:
        sizes = torch.tensor([len(y) for y in labels], dtype=torch.float32)
        loss_mean = float((torch.stack(losses).float().cpu() * sizes).sum()) / seen
        accuracy = task.accuracy(torch.cat(outputs), torch.cat(labels))
    else:
        loss_mean, accuracy = float("nan"), float("nan")
    return TrainStats(
        loss=loss_mean,
        accuracy=accuracy,
        num_examples=num_examples,
        steps=steps,
        samples_per_s=seen / wall if wall > 0 else 0.0,
        wall_time_s=wall,
        peak_gpu_mem_mb=peak_mb,
        examples_seen=seen,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, data: Examples, precision: Precision, task: Task | None = None, batch_size: int = 512
) -> tuple[float, dict[str, float]]:
    """(mean loss, {metric name: value} for every metric of `task`) over `data`; `task`
    defaults to cross-entropy and accuracy. Empty data: nan for the loss and each metric.

    The loss accumulates on the device (batch mean x batch size, see `Task.loss`); the
    logits (N x classes, small next to the inputs) are kept and moved to the CPU once,
    where the metrics see the whole split at once (AUROC and F1 do not average over batches).
    An out-of-memory error halves the batch (a capped client on a shared GPU).
    """
    task = task or DEFAULT_TASK
    if len(data) == 0:
        return float("nan"), {name: float("nan") for name in task.names}
    device = precision.device
    model.eval()
    with GPU_TENANTS.hold() if device.type == "cuda" else contextlib.nullcontext():  # see LoopClock
        on_device = to_device(data, device)
        loss_sum = torch.zeros((), device=device)
        outputs: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        start = 0
        while start < len(data):
            try:
                xb = model_inputs(on_device.x[start : start + batch_size], precision)
                yb = on_device.y[start : start + batch_size]
                with autocast(precision):
                    logits = model(xb).float()
            except Exception as err:  # noqa: BLE001 - anything but out-of-memory is re-raised
                if not is_oom(err) or batch_size == 1:
                    raise
                batch_size //= 2  # and the same examples again, in halves
                release(device)
                continue
            loss_sum += task.loss(logits, yb).float() * len(yb)
            kept, kept_y = task.keep(logits, yb)
            outputs.append(kept)
            targets.append(kept_y)
            start += len(yb)
        loss = float(loss_sum) / len(data)
        return loss, task.metrics(torch.cat(outputs).cpu(), torch.cat(targets).cpu())

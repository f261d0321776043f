"""Local DP-SGD (privacy=local): each ClientApp trains with Opacus and accounts its own ε.

The guarantee is sample-level and per client: one example of one client's data. Every
step Poisson-samples that client's examples with rate q = batch_size / n (Opacus's
`UniformWithReplacementSampler`, the sampler inside `DPDataLoader`), clips each example's
gradient to `privacy.clip_norm` and adds N(0, (σ · clip_norm)²) noise (`DPOptimizer`).
Batches are index gathers on the device, as in `app.training`, rather than a DataLoader
that collates example by example and copies every batch to the device.

The client's RDP accountant history [(σ, q, steps)] lives in its Context state
(`ACCOUNTANT_STATE`), so the ε it reports every round (`dp-epsilon` at `privacy.delta`)
is cumulative over every round it trained in. A Context dies with a restarted SuperNode
and with the run (a resumed run is a new Flower run), so every reply also carries the
history (`dp-history-*`, merged per (σ, q)); the server keeps it per node, checkpoints it
and sends it back (`PRIOR_KEY`), and a node whose Context has no history continues from
that record instead of counting from zero.
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from opacus.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights
from opacus.optimizers import DPOptimizer
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from opacus.validators import ModuleValidator
from torch import nn

from app.config import ConfigError, PrivacyConfig, TrainConfig
from app.data import ImageTensors
from app.training import (
    Precision,
    TrainStats,
    autocast,
    make_optimizer,
    model_inputs,
    start_clock,
    synchronize,
    to_device,
    train_stats,
)
from strategies.opacus_logging import remove_opacus_root_handler

log = logging.getLogger("flwr.fedgpu." + __name__)
remove_opacus_root_handler()  # Opacus calls logging.basicConfig on import

ACCOUNTANT_STATE = "local-dp-accountant"  # ConfigRecord in context.state: noise-multipliers, sample-rates, steps
PRIOR_KEY = "dp-prior-history"  # message config: JSON {history key: [[σ, q, steps], ...]} the server recorded
HISTORY_METRICS = ("dp-history-sigma", "dp-history-q", "dp-history-steps")  # reply: the merged history
ROUNDS_KEY = "federation.rounds"  # message config: the rounds the server plans (needed by privacy.target_epsilon)
# Beyond this the noise (std σ · clip_norm on a sum of ~batch_size clipped gradients) swamps any signal:
# a target that needs more is treated as unreachable rather than silently training on noise.
MAX_NOISE_MULTIPLIER = 100.0

# Opacus's hook on the first layer fires on its output gradient (images never require grad),
# which is all it needs; torch warns about it once per process.
warnings.filterwarnings(
    "ignore", message="Full backward hook is firing when gradients are computed", category=UserWarning
)


class PrivacyBudgetSpent(RuntimeError):
    """This node has taken all the DP-SGD steps its privacy.target_epsilon was planned for."""


def make_private_compatible(model: nn.Module) -> nn.Module:
    """The model Opacus can train, built the same way on the server and on every client.

    ModuleValidator.fix swaps layers without per-example gradients (BatchNorm → GroupNorm,
    which drops the running-statistics buffers), so the server's global model must go
    through this too or its state_dict keys will not match the clients'. In-place
    activations are switched off: they would modify the output of a hooked layer, which
    Opacus's backward hooks forbid. Neither change touches parameters that already exist.
    """
    before = {name: type(m).__name__ for name, m in model.named_modules()}
    if not ModuleValidator.is_valid(model):
        model = ModuleValidator.fix(model)
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ConfigError(f"privacy.name=local: Opacus cannot train this model: {errors[0]}")
    swaps = Counter(
        f"{before[name]} → {type(m).__name__}"
        for name, m in model.named_modules()
        if name in before and before[name] != type(m).__name__
    )
    if swaps:
        log.info("privacy=local: ModuleValidator.fix replaced %s", ", ".join(f"{n} x {s}" for s, n in swaps.items()))
    in_place = [m for m in model.modules() if getattr(m, "inplace", False)]
    for m in in_place:
        m.inplace = False
    if in_place:
        log.debug("privacy=local: %d in-place activation(s) switched to out-of-place", len(in_place))
    return model


def sample_rate(num_examples: int, batch_size: int) -> float:
    """Poisson inclusion probability per step; batches average `batch_size` examples."""
    return min(1.0, batch_size / num_examples)


def steps_per_round(num_examples: int, cfg: TrainConfig) -> int:
    """About `epochs` passes over the data: n // batch_size Poisson steps per epoch (Opacus: 1 / q)."""
    return cfg.epochs * max(1, num_examples // cfg.batch_size)


@lru_cache(maxsize=64)
def noise_for_target(target_epsilon: float, delta: float, q: float, steps: int) -> float:
    """The smallest σ (Opacus's binary search, RDP) that keeps `steps` steps at rate q within ε.

    Raises ConfigError naming privacy.target_epsilon when no σ up to MAX_NOISE_MULTIPLIER does.
    """
    try:
        sigma = get_noise_multiplier(
            target_epsilon=target_epsilon, target_delta=delta, sample_rate=q, steps=steps, accountant="rdp"
        )
    except ValueError:  # Opacus gives up past σ = 1e6
        sigma = math.inf
    if sigma > MAX_NOISE_MULTIPLIER:
        raise ConfigError(
            f"privacy.target_epsilon={target_epsilon} cannot be reached: {steps} DP-SGD steps at sample rate "
            f"{q:.3g} (delta={delta}) need a noise multiplier above {MAX_NOISE_MULTIPLIER:g}; raise "
            "privacy.target_epsilon or lower federation.rounds / train.epochs"
        )
    return sigma


def noise_for_round(privacy: PrivacyConfig, record: dict, q: float, round_steps: int) -> tuple[float, int | None]:
    """(σ for this round, planned steps over the run or None when σ is configured directly)."""
    if privacy.target_epsilon <= 0:
        return privacy.noise_multiplier, None
    if ROUNDS_KEY not in record:
        raise ConfigError(
            f"privacy.target_epsilon={privacy.target_epsilon} needs the planned number of rounds, but the "
            f"message config has no {ROUNDS_KEY!r}; is the ServerApp from this app?"
        )
    planned = int(record[ROUNDS_KEY]) * round_steps
    return noise_for_target(privacy.target_epsilon, privacy.delta, q, planned), planned


def load_accountant(state: RecordDict) -> RDPAccountant:
    """This node's accountant, with the history of every earlier round."""
    accountant = RDPAccountant()
    if ACCOUNTANT_STATE in state:
        rec = state[ACCOUNTANT_STATE]
        accountant.history = [
            (float(s), float(q), int(n))
            for s, q, n in zip(rec["noise-multipliers"], rec["sample-rates"], rec["steps"], strict=True)
        ]
    return accountant


def history_key(partition: int | None, node_id: int) -> str:
    """Whose history: the simulated partition (node ids change between simulations) or the
    deployed node (with node authentication its id is tied to its registered key)."""
    return f"partition-{partition}" if partition is not None else f"node-{node_id}"


def merge_history(history: Iterable[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """RDP adds up over steps of the same (σ, q): merged entries give exactly the same ε."""
    steps: Counter[tuple[float, float]] = Counter()
    for sigma, q, n in history:
        steps[(float(sigma), float(q))] += int(n)
    return [(sigma, q, n) for (sigma, q), n in steps.items()]


def history_metrics(accountant: RDPAccountant) -> dict[str, list[float] | list[int]]:
    """The reply's copy of this node's whole (merged) history, for the server to keep."""
    merged = merge_history(accountant.history)
    return {
        HISTORY_METRICS[0]: [s for s, _, _ in merged],
        HISTORY_METRICS[1]: [q for _, q, _ in merged],
        HISTORY_METRICS[2]: [n for _, _, n in merged],
    }


def history_from_metrics(metrics: Mapping) -> list[tuple[float, float, int]] | None:
    """The history a reply carries (None if it carries none or a malformed one)."""
    try:
        sigmas, rates, steps = (list(metrics[k]) for k in HISTORY_METRICS)
        return merge_history(zip(sigmas, rates, steps, strict=True))
    except (KeyError, TypeError, ValueError):
        return None


def seed_accountant(state: RecordDict, record: Mapping, key: str) -> None:
    """A node with no history of its own (a fresh Context) continues from the server's record."""
    if ACCOUNTANT_STATE in state or PRIOR_KEY not in record:
        return
    prior = json.loads(str(record[PRIOR_KEY])).get(key)
    if prior:
        accountant = RDPAccountant()
        accountant.history = merge_history(prior)
        save_accountant(state, accountant)
        steps = sum(n for _, _, n in accountant.history)
        log.info("privacy=local: %s continues its accountant from the server's record (%d steps)", key, steps)


def save_accountant(state: RecordDict, accountant: RDPAccountant) -> None:
    sigmas, rates, steps = zip(*accountant.history, strict=True)
    state[ACCOUNTANT_STATE] = ConfigRecord(
        {
            "noise-multipliers": [float(s) for s in sigmas],
            "sample-rates": [float(q) for q in rates],
            "steps": [int(n) for n in steps],
        }
    )


def per_sample_module(model: nn.Module, example: torch.Tensor) -> tuple[AbstractGradSampleModule, bool]:
    """(wrapper computing per-example gradients, whether it is Opacus's hooks mode).

    Hooks are Opacus's default, the fastest here (~6x ExpandedWeights on a CPU CNN) and
    the mode that runs under autocast. They forbid in-place changes to a hooked layer's
    output, which some forwards make (torchvision ResNet's `out += identity`); those
    models fall back to ExpandedWeights. One probe forward decides.
    """
    hooked = GradSampleModule(model)
    hooked.disable_hooks()  # the probe's activations must not reach the first step
    try:
        hooked(example)
    except RuntimeError as err:
        if "inplace" not in str(err):
            raise
        hooked.to_standard_module()
        log.info(
            "privacy=local: %s changes a layer output in place, which Opacus's backward hooks forbid; "
            "per-example gradients by ExpandedWeights instead (fp32, slower)",
            type(model).__name__,
        )
        return GradSampleModuleExpandedWeights(model), False
    hooked.enable_hooks()
    return hooked, True


def private_precision(precision: Precision, hooks: bool) -> Precision:
    """bf16 autocast where Opacus supports it (hooks mode); fp32 otherwise, said once per round."""
    if precision.amp == "off" or (hooks and precision.amp == "bf16"):
        return precision
    why = (
        "fp16 needs a GradScaler, which cannot unscale Opacus's per-example gradients before clipping"
        if hooks
        else "ExpandedWeights does not run under autocast"
    )
    log.info("privacy=local: train.amp=%s falls back to fp32: %s", precision.amp, why)
    return Precision(device=precision.device, amp="off")


def dp_generators(device: torch.device, seed: int | None = None) -> tuple[torch.Generator, torch.Generator]:
    """(Poisson sampling on the CPU, noise on `device`), seeded from the OS's entropy unless a test
    passes `seed`. Never from the run's seed: a server that knows it could replay the noise and the
    batch draws, and neither the noise nor the subsampling amplification would protect anything."""
    sampling, noise = np.random.SeedSequence(seed).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(sampling)), torch.Generator(device=device).manual_seed(int(noise))


def _nchw(x: torch.Tensor) -> torch.Tensor:
    """Opacus 1.6 unfolds conv activations with as_strided on NCHW strides: channels_last ones (on
    CUDA, or a 1-channel batch whose strides also read as channels_last) give wrong per-example
    gradients, silently. Canonical NCHW inputs on an NCHW model keep every activation NCHW."""
    return x.clone(memory_format=torch.contiguous_format)


def _noise_only_step(optimizer: DPOptimizer, model: nn.Module) -> None:
    """A Poisson batch can be empty: the step still happens (noise only) and is accounted."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad_sample = p.new_zeros((0, *p.shape))
    optimizer.step()


def _grad_samples_to_fp32(model: nn.Module) -> None:
    """Opacus takes per-example norms in the grad samples' dtype; bf16 norms are off by up to
    ~0.4%, enough for a clipped gradient to exceed clip_norm. Clip in fp32 instead."""
    for p in model.parameters():
        if getattr(p, "grad_sample", None) is not None and p.grad_sample.dtype != torch.float32:
            p.grad_sample = p.grad_sample.float()


def train_private(
    model: nn.Module,
    data: ImageTensors,
    cfg: TrainConfig,
    privacy: PrivacyConfig,
    precision: Precision,
    state: RecordDict,
    record: dict,
    seed: int | None = None,
    key: str = "",
) -> tuple[TrainStats, dict[str, float | int | list[float] | list[int]]]:
    """One round of DP-SGD on this node's data; `model` (unwrapped) is updated in place.

    Returns the usual TrainStats and the reply's DP metrics: `dp-epsilon` (cumulative over
    this node's rounds, at privacy.delta), `dp-noise-multiplier` (σ this round) and
    `dp-steps` (cumulative DP-SGD steps). The accountant in `state` is updated once the
    round's steps are taken, before any reply is sent (a lost reply still counts: conservative).
    train.grad_clip does not apply: privacy.clip_norm bounds every example's gradient.
    `seed` (tests only) fixes the sampling and the noise; see `dp_generators`. `key`
    (`history_key`) names this node in the server's record of histories.
    """
    n = len(data)
    if n == 0:
        raise ValueError("privacy=local: this node has no training examples")
    if privacy.delta >= 1 / n:
        log.warning(
            "privacy.delta=%g >= 1/%d (this node's examples): a mechanism that leaks one whole example with "
            "probability delta would satisfy this guarantee; use delta well below %.2g",
            privacy.delta,
            n,
            1 / n,
        )
    q, round_steps = sample_rate(n, cfg.batch_size), steps_per_round(n, cfg)
    sigma, planned = noise_for_round(privacy, record, q, round_steps)
    seed_accountant(state, record, key)
    accountant = load_accountant(state)
    spent = sum(steps for _, _, steps in accountant.history)
    if planned is not None and spent + round_steps > planned:
        raise PrivacyBudgetSpent(
            f"privacy.target_epsilon={privacy.target_epsilon}: this node has taken {spent} of its {planned} planned "
            f"DP-SGD steps ({ROUNDS_KEY}={record[ROUNDS_KEY]}); another {round_steps} would exceed the budget"
        )
    device = precision.device
    on_device = to_device(data, device)
    model.to(memory_format=torch.contiguous_format).train()  # see _nchw
    wrapped, hooks = per_sample_module(model, _nchw(model_inputs(on_device.x[:1], precision)))
    precision = private_precision(precision, hooks)
    sampling, noise = dp_generators(device, seed)
    optimizer = DPOptimizer(
        make_optimizer(model, cfg),
        noise_multiplier=sigma,
        max_grad_norm=privacy.clip_norm,
        expected_batch_size=min(cfg.batch_size, n),
        generator=noise,
    )
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=q))
    sampler = UniformWithReplacementSampler(num_samples=n, sample_rate=q, generator=sampling, steps=round_steps)
    losses: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    start = start_clock(device)
    try:
        for batch in sampler:
            optimizer.zero_grad(set_to_none=True)
            if not batch:
                _noise_only_step(optimizer, model)
                continue
            idx = torch.tensor(batch, device=device)
            xb, yb = _nchw(model_inputs(on_device.x[idx], precision)), on_device.y[idx]
            with autocast(precision):
                logits = wrapped(xb)
                loss = F.cross_entropy(logits, yb)
            loss.backward()
            if precision.dtype is not None:
                _grad_samples_to_fp32(model)
            optimizer.step()
            losses.append(loss.detach())
            outputs.append(logits.detach())
            labels.append(yb)
        synchronize(device)
        wall = time.perf_counter() - start
    finally:
        optimizer.zero_grad(set_to_none=True)
        wrapped.to_standard_module()  # hooks and per-example attributes off the caller's model
    save_accountant(state, accountant)
    stats = train_stats(losses, outputs, labels, n, wall, device, steps=round_steps)
    metrics: dict[str, float | int | list[float] | list[int]] = {
        "dp-epsilon": float(accountant.get_epsilon(privacy.delta)),
        "dp-noise-multiplier": float(sigma),
        "dp-steps": spent + round_steps,
        **history_metrics(accountant),
    }
    return stats, metrics

"""Local DP-SGD in the ClientApp (privacy=local): each client trains with Opacus and accounts its own ε.

The guarantee is sample-level and per client: one example of one client's data. Every
step Poisson-samples that client's examples with rate q = batch_size / n (Opacus's
`UniformWithReplacementSampler`, the sampler inside `DPDataLoader`), clips each example's
gradient to `privacy.clip_norm` and adds N(0, (σ · clip_norm)²) noise (`DPOptimizer`).
The steps run in the one training loop (`app.task.training.fit`, with `DpSgdSteps`):
batches are index gathers on the device rather than a DataLoader that collates example
by example and copies every batch to the device. n itself (and so q, the step count and
`num-examples`) is public, as in Opacus and standard DP-SGD.

The client's RDP accountant history [(σ, q, steps)] lives in its Context state
(`ACCOUNTANT_STATE`), so the ε it reports every round (`dp-epsilon` at `privacy.delta`)
is cumulative over every round it trained in. σ and the round's steps come from
`app.privacy.accounting.plan_round`; a fresh Context continues from the server's record
of its history (`seed_accountant`; see `app.privacy.accounting` for that record).
"""

from __future__ import annotations

import json
import logging
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict
from opacus.accountants import RDPAccountant
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from opacus.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights
from opacus.optimizers import DPOptimizer
from opacus.utils.module_utils import trainable_modules
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from opacus.validators import ModuleValidator
from torch import nn

from app.config.schema import ConfigError, PrivacyConfig, TrainConfig
from app.privacy.accounting import MalformedHistory, check_history, history_metrics, plan_round
from app.protocol import DP_EPSILON, DP_NOISE_MULTIPLIER, DP_STEPS, PRIOR_KEY
from app.task.data import Examples
from app.task.metrics import Task
from app.task.training import Precision, Steps, TrainStats, fit, model_inputs
from strategies.opacus_logging import remove_opacus_root_handler

log = logging.getLogger("flwr.fedgpu." + __name__)
remove_opacus_root_handler()  # Opacus calls logging.basicConfig on import

ACCOUNTANT_STATE = "local-dp-accountant"  # ConfigRecord in context.state: noise-multipliers, sample-rates, steps

# Opacus's hook on the first layer fires on its output gradient (images never require grad),
# which is all it needs; torch warns about it once per process.
warnings.filterwarnings(
    "ignore", message="Full backward hook is firing when gradients are computed", category=UserWarning
)


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
    if errors := unsupported_layers(model):
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(f"privacy.name=local: Opacus cannot train layer {errors[0]}{more}")
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


def unsupported_layers(model: nn.Module) -> list[str]:
    """`ModuleValidator.validate`'s findings, each with the layer's name (Opacus's own list
    leaves the name out). Frozen layers are not checked: they compute no gradients."""
    return [
        f"{name or '(the model)'} ({type(module).__name__}): {error}"
        for name, module in trainable_modules(model)
        if type(module) in ModuleValidator.VALIDATORS
        for error in ModuleValidator.VALIDATORS[type(module)](module)
    ]


def sample_rate(num_examples: int, batch_size: int) -> float:
    """Poisson inclusion probability per step; batches average `batch_size` examples."""
    return min(1.0, batch_size / num_examples)


def steps_per_round(num_examples: int, cfg: TrainConfig) -> int:
    """About `epochs` passes over the data: n // batch_size Poisson steps per epoch (Opacus: 1 / q)."""
    return cfg.epochs * max(1, num_examples // cfg.batch_size)


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


def seed_accountant(state: RecordDict, record: Mapping, keys: Sequence[str]) -> None:
    """A node with no history of its own (a fresh Context) continues from the server's record.

    `keys`: the names the server may file this node under (`history_key` of its partition, of
    its node id: a contested partition claim leaves it under its node id); the server sends a
    node at most one of them. A malformed record is refused (MalformedHistory, an error reply):
    training on from a count the node cannot trust could take its ε past what it reports.
    """
    if ACCOUNTANT_STATE in state or PRIOR_KEY not in record:
        return
    key = keys[0] if keys else ""
    try:
        priors = json.loads(str(record[PRIOR_KEY]))
        if not isinstance(priors, dict):
            raise MalformedHistory("not a JSON object")
        key = next((k for k in keys if k in priors), key)
        prior = check_history(priors.get(key, []))
    except ValueError as err:  # json.JSONDecodeError and MalformedHistory
        raise MalformedHistory(f"the server's {PRIOR_KEY} for {key} is malformed: {err}") from err
    if prior:
        accountant = RDPAccountant()
        accountant.history = prior
        save_accountant(state, accountant)
        steps = sum(n for _, _, n in prior)
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


class DpSgdSteps(Steps):
    """DP-SGD's parts of the training loop (`app.task.training.fit`).

    Per-example gradients through `per_sample_module`; Opacus's DPOptimizer clips and noises
    them and its step hook counts every step, empty batches' noise-only ones too, in
    `accountant`; Poisson batches at rate q; AMP only where Opacus supports it
    (`private_precision`). train.grad_clip does not apply: privacy.clip_norm bounds every
    example's gradient. `seed` (tests only) fixes the sampling and the noise (`dp_generators`).
    `task`: its loss (default cross-entropy) must be the batch mean, which is what Opacus's
    hooks assume (loss_reduction="mean") when they scale the per-example gradients.
    """

    unsplittable = "DP-SGD cannot split a batch (Opacus clips the per-example gradients of the whole batch)"

    def __init__(
        self,
        model: nn.Module,
        data: Examples,
        cfg: TrainConfig,
        precision: Precision,
        clip_norm: float,
        sigma: float,
        q: float,
        num_steps: int,
        accountant: RDPAccountant,
        seed: int | None = None,
        task: Task | None = None,
    ) -> None:
        self.q, self.num_steps = q, num_steps
        device = precision.device
        model.to(memory_format=torch.contiguous_format).train()  # see _nchw
        self.wrapped, hooks = per_sample_module(model, _nchw(model_inputs(data.x[:1].to(device), precision)))
        sampling, noise = dp_generators(device, seed)
        super().__init__(model, cfg, private_precision(precision, hooks), sampling, task)
        self.net = self.wrapped
        self.optimizer = DPOptimizer(
            self.optimizer,
            noise_multiplier=sigma,
            max_grad_norm=clip_norm,
            expected_batch_size=min(cfg.batch_size, len(data)),
            generator=noise,
        )
        self.optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=q))

    fixed_shapes = False  # Poisson batch sizes vary every step: cuDNN would autotune each new one

    def batch_sizes(self, n: int) -> list[int]:
        return []  # no warm-up: Poisson sizes are drawn during the loop

    def batches(self, n: int) -> Iterator[torch.Tensor]:
        sampler = UniformWithReplacementSampler(
            num_samples=n, sample_rate=self.q, generator=self.generator, steps=self.num_steps
        )
        for batch in sampler:
            yield torch.tensor(batch, dtype=torch.long, device=self.precision.device)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return _nchw(model_inputs(x, self.precision))

    def before_step(self, scaler: torch.amp.GradScaler | None) -> None:
        if self.precision.dtype is not None:
            _grad_samples_to_fp32(self.model)

    def empty_step(self) -> None:
        _noise_only_step(self.optimizer, self.model)

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.wrapped.to_standard_module()  # hooks and per-example attributes off the caller's model


def train_private(
    model: nn.Module,
    data: Examples,
    cfg: TrainConfig,
    privacy: PrivacyConfig,
    precision: Precision,
    state: RecordDict,
    record: dict,
    seed: int | None = None,
    keys: Sequence[str] = (),
    task: Task | None = None,
) -> tuple[TrainStats, dict[str, float | int | list[float] | list[int]]]:
    """One round of DP-SGD on this node's data; `model` (unwrapped) is updated in place.

    Returns the usual TrainStats and the reply's DP metrics: `dp-epsilon` (cumulative over
    this node's rounds, at privacy.delta), `dp-noise-multiplier` (σ this round) and
    `dp-steps` (cumulative DP-SGD steps). With privacy.target_epsilon the round takes only
    the steps that keep the accountant's ε within it (`plan_round`; PrivacyBudgetExhausted when
    none fits). The accountant in `state` is updated once the round's steps are taken,
    before any reply is sent (a lost reply still counts: conservative).
    `seed`: see `DpSgdSteps`. `keys` (`history_key`s) name this node in the server's record
    of histories (`seed_accountant`). `task`: the loss to train with (default cross-entropy).
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
    q = sample_rate(n, cfg.batch_size)
    seed_accountant(state, record, keys)
    accountant = load_accountant(state)
    spent = sum(steps for _, _, steps in accountant.history)
    sigma, round_steps = plan_round(privacy, record, q, steps_per_round(n, cfg), accountant.history)
    steps = DpSgdSteps(model, data, cfg, precision, privacy.clip_norm, sigma, q, round_steps, accountant, seed, task)
    stats = fit(steps, data)
    save_accountant(state, accountant)
    metrics: dict[str, float | int | list[float] | list[int]] = {
        DP_EPSILON: float(accountant.get_epsilon(privacy.delta)),
        DP_NOISE_MULTIPLIER: float(sigma),
        DP_STEPS: spent + round_steps,
        **history_metrics(accountant),
    }
    return stats, metrics

"""Local DP-SGD (privacy=local): each ClientApp trains with Opacus and accounts its own ε.

The guarantee is sample-level and per client: one example of one client's data. Every
step Poisson-samples that client's examples with rate q = batch_size / n (Opacus's
`UniformWithReplacementSampler`, the sampler inside `DPDataLoader`), clips each example's
gradient to `privacy.clip_norm` and adds N(0, (σ · clip_norm)²) noise (`DPOptimizer`).
Batches are index gathers on the device, as in `app.task.training`, rather than a DataLoader
that collates example by example and copies every batch to the device. n itself (and so
q, the step count and `num-examples`) is public, as in Opacus and standard DP-SGD.

The client's RDP accountant history [(σ, q, steps)] lives in its Context state
(`ACCOUNTANT_STATE`), so the ε it reports every round (`dp-epsilon` at `privacy.delta`)
is cumulative over every round it trained in. With `privacy.target_epsilon` the
accountant's ε is the limit (`plan_round`): σ spreads what is left of the target over
the planned steps left, and no step is taken that would take ε past the target, so a
resume with more `federation.rounds` cannot overspend.

A Context dies with a restarted SuperNode and with the run (a resumed run is a new
Flower run), so every reply also carries the history (`dp-history-*`, merged per (σ, q)).
The server (`HistoryLedger`) files it under who the server knows the node is, never
under what the reply claims: the authenticated node id (deployment), or the partition
the node is bound to (simulation, strategies/partitions.py: first claim binds). It keeps
a history only if it is well-formed and a monotone extension of what it holds for that
key (no (σ, q) pair lost, no step count shrinking), checkpoints the record, and
summarises every client's ε from it with its own accountant, whatever became of the
update. A node whose Context has no history continues from the server's record
(`PRIOR_KEY`, checked before use), and each node is sent only what can be its own:
- a node bound to a partition, or one the record names as the last writer of a key
  (deployed nodes keep their ids across runs): that history alone;
- any other node (a resumed simulation gives every node a new id, and the server learns
  a node's partition only from its first reply): the histories of the partitions no node
  holds yet and whose last writer is not connected, from which it takes its own. Until
  every node has replied once after a resumed simulation, the first nodes thus see the
  (σ, q, steps) of unclaimed partitions, i.e. their public n; nothing else.
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict
from opacus.accountants import RDPAccountant
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from opacus.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights
from opacus.optimizers import DPOptimizer
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from opacus.validators import ModuleValidator
from torch import nn

from app.config.schema import ConfigError, PrivacyConfig, TrainConfig
from app.task.data import ImageTensors
from app.task.training import (
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
PRIOR_KEY = "dp-prior-history"  # message config: JSON {history key: [[σ, q, steps], ...]}, see the module doc
HISTORY_METRICS = ("dp-history-sigma", "dp-history-q", "dp-history-steps")  # reply: the merged history
ROUNDS_KEY = "federation.rounds"  # message config: the rounds the server plans (needed by privacy.target_epsilon)
# Beyond this the noise (std σ · clip_norm on a sum of ~batch_size clipped gradients) swamps any signal:
# a target that needs more is treated as unreachable rather than silently training on noise.
MAX_NOISE_MULTIPLIER = 100.0
EPSILON_TOLERANCE = 0.01  # σ search: ε lands in [target - this, target] (Opacus's get_noise_multiplier default)
# One entry per (σ, q) a node ever trained with: σ changes only when a round is re-planned (a resume with
# other federation.rounds), so real histories stay tiny; each entry costs the server ~15 ms of accounting.
MAX_HISTORY_ENTRIES = 256

History = list[tuple[float, float, int]]

# Opacus's hook on the first layer fires on its output gradient (images never require grad),
# which is all it needs; torch warns about it once per process.
warnings.filterwarnings(
    "ignore", message="Full backward hook is firing when gradients are computed", category=UserWarning
)


class PrivacyBudgetSpent(RuntimeError):
    """Another DP-SGD step would take this node's ε past privacy.target_epsilon (or its plan is done)."""


class MalformedHistory(ValueError):
    """An accountant history that is not a record of DP-SGD steps, or not an extension of the known one."""


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


# --- accounting: pure functions over histories [(σ, q, steps)] ----------------------------------


def epsilon(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """ε at `delta` of a history: Opacus's RDPAccountant on exactly these entries."""
    accountant = RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta))


def after_steps(history: Sequence[tuple[float, float, int]], sigma: float, q: float, steps: int) -> History:
    """The accountant's history after `steps` more steps at (σ, q), merged as RDPAccountant.step merges."""
    out = list(history)
    if out and out[-1][:2] == (sigma, q):
        return [*out[:-1], (sigma, q, out[-1][2] + steps)]
    return [*out, (sigma, q, steps)] if steps else out


def affordable_steps(history: History, sigma: float, q: float, limit: int, target: float, delta: float) -> int:
    """The most steps (<= limit) at (σ, q) after `history` whose ε stays <= target.

    Exact: each candidate is scored by the accountant on the very history it would hold
    (`after_steps`), and ε only grows with steps (every step adds RDP >= 0 at every order),
    so a bisection finds the largest one.
    """
    if epsilon(after_steps(history, sigma, q, limit), delta) <= target:
        return limit
    if epsilon(history, delta) > target:
        return 0
    lo, hi = 0, limit  # ε(lo) <= target < ε(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if epsilon(after_steps(history, sigma, q, mid), delta) <= target:
            lo = mid
        else:
            hi = mid
    return lo


@lru_cache(maxsize=64)
def noise_for_target(
    target_epsilon: float, delta: float, q: float, steps: int, history: tuple[tuple[float, float, int], ...] = ()
) -> float:
    """The smallest σ (to EPSILON_TOLERANCE, never over) with which `steps` more steps at rate q
    after `history` keep the accountant's ε within the target: Opacus's get_noise_multiplier
    bisection, on the whole history rather than from zero.

    Raises ConfigError naming privacy.target_epsilon when no σ up to MAX_NOISE_MULTIPLIER does.
    """

    def eps(sigma: float) -> float:
        return epsilon([*history, (sigma, q, steps)], delta)

    low, high, eps_high = 0.0, MAX_NOISE_MULTIPLIER, eps(MAX_NOISE_MULTIPLIER)
    if eps_high > target_epsilon:
        raise ConfigError(
            f"privacy.target_epsilon={target_epsilon} cannot be reached: {steps} DP-SGD steps at sample rate "
            f"{q:.3g} (delta={delta}) need a noise multiplier above {MAX_NOISE_MULTIPLIER:g}; raise "
            "privacy.target_epsilon or lower federation.rounds / train.epochs"
        )
    while target_epsilon - eps_high > EPSILON_TOLERANCE:
        mid = (low + high) / 2
        if (e := eps(mid)) < target_epsilon:
            high, eps_high = mid, e
        else:
            low = mid
    return high


def plan_round(
    privacy: PrivacyConfig, record: Mapping, q: float, round_steps: int, history: History
) -> tuple[float, int]:
    """(σ, steps) for this round.

    With privacy.noise_multiplier: that σ for the whole round. With privacy.target_epsilon
    the accountant's ε is the limit, not a step count: σ stays what the node trained with
    while it still fits the planned steps left (`federation.rounds` x this round's steps,
    minus those taken), otherwise it is re-planned over them from the whole history (a
    resume with more rounds); and the round takes only the steps that keep ε <= target.
    Raises PrivacyBudgetSpent when not one more step fits.
    """
    if privacy.target_epsilon <= 0:
        return privacy.noise_multiplier, round_steps
    if ROUNDS_KEY not in record:
        raise ConfigError(
            f"privacy.target_epsilon={privacy.target_epsilon} needs the planned number of rounds, but the "
            f"message config has no {ROUNDS_KEY!r}; is the ServerApp from this app?"
        )
    target, delta = privacy.target_epsilon, privacy.delta
    planned = int(record[ROUNDS_KEY]) * round_steps
    left = planned - sum(n for _, _, n in history)
    spent = f"this node's ε is {epsilon(history, delta):.4g} after {planned - left} DP-SGD steps"
    if left <= 0:
        raise PrivacyBudgetSpent(
            f"privacy.target_epsilon={target}: {spent}, all it planned ({ROUNDS_KEY}={record[ROUNDS_KEY]})"
        )
    last = history[-1] if history else None
    if last is not None and last[1] == q and epsilon(after_steps(history, last[0], q, left), delta) <= target:
        sigma = last[0]
    else:
        try:
            sigma = noise_for_target(target, delta, q, left, tuple(history))
        except ConfigError as err:
            if not history:
                raise
            raise PrivacyBudgetSpent(f"privacy.target_epsilon={target}: {spent}; the rest cannot fund more") from err
    steps = affordable_steps(history, sigma, q, min(round_steps, left), target, delta)
    if steps == 0:
        raise PrivacyBudgetSpent(f"privacy.target_epsilon={target}: {spent}; one more step would exceed it")
    return sigma, steps


def merge_history(history: Iterable[tuple[float, float, int]]) -> History:
    """RDP adds up over steps of the same (σ, q): merged entries give exactly the same ε."""
    steps: Counter[tuple[float, float]] = Counter()
    for sigma, q, n in history:
        steps[(float(sigma), float(q))] += int(n)
    return [(sigma, q, n) for (sigma, q), n in steps.items()]


def _positive_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_history(entries: object) -> History:
    """The merged history, or MalformedHistory: anything but [σ, q, steps] entries with a finite
    σ > 0, 0 < q <= 1 and an integer steps >= 0 could not have come from DP-SGD (a negative step
    count would subtract ε), and more than MAX_HISTORY_ENTRIES pairs is a forgery or a flood."""
    if not isinstance(entries, (list, tuple)):
        raise MalformedHistory(f"a history is a list of [σ, q, steps], not {type(entries).__name__}")
    if len(entries) > MAX_HISTORY_ENTRIES:
        raise MalformedHistory(f"{len(entries)} entries, more than {MAX_HISTORY_ENTRIES}")
    for entry in entries:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise MalformedHistory(f"entry {entry!r} is not [σ, q, steps]")
        sigma, q, steps = entry
        if not _positive_number(sigma):
            raise MalformedHistory(f"noise multiplier {sigma!r} is not a finite number > 0")
        if not _positive_number(q) or q > 1:
            raise MalformedHistory(f"sample rate {q!r} is not in (0, 1]")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise MalformedHistory(f"step count {steps!r} is not an integer >= 0")
    return merge_history(entries)


def extension_problem(old: History, new: History) -> str | None:
    """Why `new` is not `old` plus more steps (None if it is): DP-SGD steps are never undone."""
    steps = {(sigma, q): n for sigma, q, n in new}
    for sigma, q, n in old:
        if (sigma, q) not in steps:
            return f"(σ={sigma:g}, q={q:g}) with {n} recorded steps is missing"
        if steps[(sigma, q)] < n:
            return f"(σ={sigma:g}, q={q:g}) has {steps[(sigma, q)]} steps, fewer than the {n} recorded"
    return None


def history_key(partition: int | None, node_id: int) -> str:
    """Whose history: the partition a simulated node is bound to (node ids change between
    simulations) or the deployed node (with node authentication its id is tied to its key)."""
    return f"partition-{partition}" if partition is not None else f"node-{node_id}"


def history_metrics(accountant: RDPAccountant) -> dict[str, list[float] | list[int]]:
    """The reply's copy of this node's whole (merged) history, for the server to keep."""
    merged = merge_history(accountant.history)
    return {
        HISTORY_METRICS[0]: [s for s, _, _ in merged],
        HISTORY_METRICS[1]: [q for _, q, _ in merged],
        HISTORY_METRICS[2]: [n for _, _, n in merged],
    }


def history_from_metrics(metrics: Mapping) -> History:
    """The history a reply carries; MalformedHistory if it carries none or a malformed one."""
    columns = [metrics.get(k) for k in HISTORY_METRICS]
    if not all(isinstance(c, list) for c in columns):
        raise MalformedHistory(f"no accountant history ({', '.join(HISTORY_METRICS)} as lists)")
    if len({len(c) for c in columns}) != 1:
        raise MalformedHistory("the dp-history-* lists differ in length")
    return check_history(list(zip(*columns, strict=True)))


# --- the client's side -------------------------------------------------------------------------


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


# --- the server's side ---------------------------------------------------------------------------


class HistoryLedger:
    """The server's record of every local-DP client's accountant history (see the module doc).

    Keys come from the server (`history_key` of the node's bound partition or its node id),
    never from a reply. Each client's ε is computed here from the kept history, not taken
    from the ε the reply states. `owners` remembers which node last extended each key, so a
    deployed node (same id in the next run) is sent its own history even before it replies.
    """

    def __init__(self, delta: float, state: Mapping[str, Any] | None = None) -> None:
        self.delta = delta
        state = state or {}
        self.histories: dict[str, History] = {k: check_history(v) for k, v in state.get("histories", {}).items()}
        self.owners: dict[str, int] = {k: int(v) for k, v in state.get("owners", {}).items()}
        self._epsilons: dict[str, float] = {}

    def record(self, key: str, node_id: int, metrics: Mapping) -> None:
        """Keep the history a reply of `node_id` carries under `key`; MalformedHistory if it is
        malformed or not a monotone extension of the one already kept (which then stays)."""
        new = history_from_metrics(metrics)
        if problem := extension_problem(self.histories.get(key, []), new):
            raise MalformedHistory(f"not an extension of the recorded history of {key}: {problem}")
        self.histories[key], self.owners[key] = new, node_id
        self._epsilons.pop(key, None)

    def epsilons(self) -> dict[str, float]:
        """Each client's cumulative ε at `delta`, from its kept history."""
        for key, history in self.histories.items():
            if key not in self._epsilons:
                self._epsilons[key] = epsilon(history, self.delta)
        return dict(self._epsilons)

    def prior(
        self, node_id: int, partition: int | None, unbound: Iterable[int], connected: Collection[int]
    ) -> dict[str, str]:
        """The message config entry (PRIOR_KEY) for one node: only histories that can be its own.

        An unknown node (not bound, writer of nothing on record) gets the partitions nobody holds
        yet whose last writer is not connected: in a resumed simulation every id is new.
        """
        if partition is not None:
            keys = [history_key(partition, node_id)]
        else:
            keys = [history_key(None, node_id)] + [k for k, owner in self.owners.items() if owner == node_id]
            if len(keys) == 1:
                keys += [k for p in unbound if self.owners.get(k := history_key(p, node_id)) not in connected]
        histories = {k: [list(e) for e in self.histories[k]] for k in dict.fromkeys(keys) if k in self.histories}
        return {PRIOR_KEY: json.dumps(histories)} if histories else {}

    def state(self) -> dict[str, Any]:
        """For the checkpoint (run_state): plain lists and ints."""
        return {
            "histories": {k: [list(e) for e in h] for k, h in self.histories.items()},
            "owners": dict(self.owners),
        }


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
    keys: Sequence[str] = (),
) -> tuple[TrainStats, dict[str, float | int | list[float] | list[int]]]:
    """One round of DP-SGD on this node's data; `model` (unwrapped) is updated in place.

    Returns the usual TrainStats and the reply's DP metrics: `dp-epsilon` (cumulative over
    this node's rounds, at privacy.delta), `dp-noise-multiplier` (σ this round) and
    `dp-steps` (cumulative DP-SGD steps). With privacy.target_epsilon the round takes only
    the steps that keep the accountant's ε within it (`plan_round`; PrivacyBudgetSpent when
    none fits). The accountant in `state` is updated once the round's steps are taken,
    before any reply is sent (a lost reply still counts: conservative).
    train.grad_clip does not apply: privacy.clip_norm bounds every example's gradient.
    `seed` (tests only) fixes the sampling and the noise; see `dp_generators`. `keys`
    (`history_key`s) name this node in the server's record of histories (`seed_accountant`).
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

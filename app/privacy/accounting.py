"""Local DP's accounting (privacy=local): the RDP maths over accountant histories, and the
server's per-node record of them.

A history is what Opacus's RDPAccountant keeps: [(σ, q, steps)], one entry per noise
multiplier σ and sample rate q a node trained with. Each ClientApp accounts its own ε
(`app.privacy.dp_sgd`); with `privacy.target_epsilon` the accountant's ε is the limit
(`plan_round`): σ spreads what is left of the target over the planned steps left, and no
step is taken that would take ε past the target, so a resume with more `federation.rounds`
cannot overspend.

A node's Context dies with a restarted SuperNode and with the run (a resumed run is a new
Flower run), so every reply also carries the history (`HISTORY_METRICS`, merged per (σ, q)).
The server (`HistoryBook`) files it under who the server knows the node is, never
under what the reply claims: the authenticated node id (deployment), or the partition
the node is bound to (simulation, strategies/partitions.py: first claim binds). It keeps
a history only if it is well-formed, a monotone extension of what it holds for that
key (no (σ, q) pair lost, no step count shrinking), what it added matches what the server
prescribed for the tasks it sent that node (`Prescription`: σ, q, steps), and its ε can be
computed (`step_rdp`: nothing a node sends raises out of the accounting); it checkpoints the
record, and summarises every client's ε from it with its own accountant, whatever became of
the update. A node whose Context has no history continues from the server's record
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
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as opacus_rdp

from app.config.schema import Config, ConfigError, PrivacyConfig
from app.protocol import HISTORY_METRICS, PRIOR_KEY, ROUNDS_KEY
from strategies.budget import PrivacyBudgetExhausted
from strategies.opacus_logging import remove_opacus_root_handler

log = logging.getLogger("flwr.fedgpu." + __name__)
remove_opacus_root_handler()  # Opacus calls logging.basicConfig on import

# Beyond this the noise (std σ · clip_norm on a sum of ~batch_size clipped gradients) swamps any signal:
# a target that needs more is treated as unreachable rather than silently training on noise.
MAX_NOISE_MULTIPLIER = 100.0
EPSILON_TOLERANCE = 0.01  # σ search: ε lands in [target - this, target] (Opacus's get_noise_multiplier default)
# One entry per (σ, q) a node ever trained with: σ changes only when a round is re-planned (a resume with
# other federation.rounds), so real histories stay tiny. Each new (σ, q) pair costs one Opacus RDP
# computation (5-300 ms, `step_rdp`, cached); a longer history costs only a sum of cached vectors.
MAX_HISTORY_ENTRIES = 256
# A step count beyond this cannot be a DP-SGD record (and steps x RDP must stay an exact float product).
MAX_STEPS = 2**53
ORDERS: tuple[float, ...] = tuple(RDPAccountant.DEFAULT_ALPHAS)  # the RDP orders RDPAccountant.get_epsilon uses

History = list[tuple[float, float, int]]


class MalformedHistory(ValueError):
    """An accountant history that is not a record of DP-SGD steps, or not an extension of the known one.

    `computed`: the (σ, q) pairs it added whose RDP the server computed before refusing it (what
    the refusal cost; `LocalPrivacy` charges them to the node's allowance)."""

    computed: int = 0


@lru_cache(maxsize=8192)
def step_rdp(sigma: float, q: float) -> np.ndarray:
    """The RDP of one DP-SGD step at (σ, q), at every order of ORDERS: Opacus's compute_rdp, computed
    once per pair (5-300 ms each; the cache holds 8192 pairs, ~10 MB).

    Exact for any step count: RDP composes additively, and Opacus's own compute_rdp returns this very
    vector times `steps`. Any failure of Opacus's maths on the values (σ² underflowing to 0 raises
    ZeroDivisionError, overflowing raises OverflowError) or a result that is not an RDP vector (NaN)
    is MalformedHistory: nothing a node sends raises anything else out of the accounting. RDP is
    never negative; Opacus's rounding gives -1e-16 at some orders for q below ~1e-6, set to 0 here.
    """
    try:
        rdp = np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(ORDERS)), float)
    except Exception as err:  # noqa: BLE001 - Opacus's maths fail in several ways on extreme values
        raise MalformedHistory(f"(σ={sigma!r}, q={q!r}) cannot be accounted: {type(err).__name__}: {err}") from None
    if rdp.shape != (len(ORDERS),) or np.isnan(rdp).any():
        raise MalformedHistory(f"(σ={sigma!r}, q={q!r}) has no valid RDP (NaN)")
    if (rdp < 0).any():  # rounding (~1e-16) at q below ~1e-6; times 2^53 steps it would subtract ε
        rdp = np.maximum(rdp, 0.0)
    rdp.setflags(write=False)  # shared by every history holding the pair
    return rdp


def history_rdp(history: Sequence[tuple[float, float, int]]) -> np.ndarray | float:
    """The RDP of a whole history at every order: Σ steps x step_rdp(σ, q), summed from 0 in the
    history's order, as RDPAccountant.get_privacy_spent sums, so the float result is the same."""
    total: np.ndarray | float = 0
    for sigma, q, steps in history:
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 0 <= steps <= MAX_STEPS:
            raise MalformedHistory(f"step count {steps!r} is not an integer in [0, 2^53]")
        total = total + step_rdp(sigma, q) * steps
    return total


def epsilon(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """ε at `delta` of a history: exactly what Opacus's RDPAccountant gives on these entries, with
    each (σ, q)'s RDP computed once (`step_rdp`). MalformedHistory if it cannot be computed."""
    if not history:
        return 0.0
    eps, _ = opacus_rdp.get_privacy_spent(orders=list(ORDERS), rdp=history_rdp(history), delta=delta)
    return float(eps)


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
    Raises PrivacyBudgetExhausted when not one more step fits.
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
        raise PrivacyBudgetExhausted(
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
            raise PrivacyBudgetExhausted(
                f"privacy.target_epsilon={target}: {spent}; the rest cannot fund more"
            ) from err
    steps = affordable_steps(history, sigma, q, min(round_steps, left), target, delta)
    if steps == 0:
        raise PrivacyBudgetExhausted(f"privacy.target_epsilon={target}: {spent}; one more step would exceed it")
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
    σ > 0, 0 < q <= 1 and an integer 0 <= steps <= MAX_STEPS could not have come from DP-SGD (a
    negative step count would subtract ε), and more than MAX_HISTORY_ENTRIES pairs is a forgery or
    a flood. Well-formed is not yet accountable: `HistoryBook.check` also computes its ε and
    holds it to what the server prescribed (`Prescription`)."""
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
        if steps > MAX_STEPS:
            raise MalformedHistory(f"step count {steps} is more than 2^53")
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


def growth(old: History, new: History) -> History:
    """The (σ, q, steps added) of every pair of `new` (an extension of `old`) that gained steps."""
    recorded = {(sigma, q): n for sigma, q, n in old}
    return [(sigma, q, n - recorded.get((sigma, q), 0)) for sigma, q, n in new if n > recorded.get((sigma, q), 0)]


# q as the client computes it (dp_sgd.sample_rate) may differ from ours by float rounding only.
RATE_TOLERANCE = 1e-9
# The accountant's ε at the target, as the client's planning checks it, up to summation order.
TARGET_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Allowance:
    """What one node may have added to its history in this run, as far as the server knows it.

    `tasks`: training tasks the server sent the node in this run (each carries one (σ, q) and at
    most `Prescription.steps_per_task` steps); `steps`: the step increase already accepted from the
    node in this run; `pairs`: the (σ, q) pairs that gained steps in its accepted histories and in
    refused ones whose RDP was computed (each task buys one RDP computation, no more); `examples`: the
    most training examples the node can hold (the strategy's weight cap: its partition's training
    size in simulation, `federation.max_examples_per_node` in deployment)."""

    examples: int
    tasks: int
    steps: int = 0
    pairs: int = 0


@dataclass(frozen=True)
class Prescription:
    """What the server prescribes every local-DP training task, which each new part of a history
    must match (`problem`). The client (app/privacy/dp_sgd.py) trains a task at one (σ, q):

    - σ: privacy.noise_multiplier, exactly; with privacy.target_epsilon σ is planned
      (`plan_round`): any σ in (0, MAX_NOISE_MULTIPLIER], and the history's ε may not exceed the
      target (planning never takes a step past it; `HistoryBook.check` computes ε);
    - q = min(1, batch_size / n) (`sample_rate`) for its n training examples, n a whole number
      no larger than the node's cap (`Allowance.examples`): so q >= batch_size / cap. In
      simulation the cap is its partition's training size as the server computes it, which is an
      upper bound rather than n itself: the server splits the data over the nodes connected at
      the start, the ClientApp over num-partitions (`test_per_client_epsilon_survives_a_resume...`
      resumes with a node missing); a deployed node's n is its own claim, held to
      federation.max_examples_per_node;
    - at most epochs x max(1, n // batch_size) steps (`steps_per_round`; fewer under a target).
    Tasks whose reply never arrived still count (the node took their steps), so a reply may
    carry the steps of every task sent to it since its last accepted history.
    """

    noise_multiplier: float
    target_epsilon: float
    batch_size: int
    epochs: int
    max_examples: int  # federation.max_examples_per_node: the n a node without a partition may have

    @classmethod
    def of(cls, cfg: Config) -> Prescription:
        p = cfg.privacy
        return cls(
            p.noise_multiplier,
            p.target_epsilon,
            int(cfg.train.batch_size),
            cfg.train.epochs,
            cfg.federation.max_examples_per_node,
        )

    def steps_per_task(self, examples: int) -> int:
        """The most DP-SGD steps one task can take with `examples` training examples (dp_sgd.steps_per_round)."""
        return self.epochs * max(1, examples // self.batch_size)

    def problem(self, grown: History, allowance: Allowance) -> str | None:
        """Why the pairs that gained steps (`growth`) are not what the server prescribed (None if they are)."""
        if not grown:
            return None
        added = sum(n for _, _, n in grown)
        tasks, per_task = allowance.tasks, self.steps_per_task(allowance.examples)
        if tasks == 0:
            return f"{added} more DP-SGD steps, but no training task was sent to this node in this run"
        sent = f"{tasks} training task(s) sent to this node in this run"
        if allowance.pairs + len(grown) > tasks:
            return (
                f"{len(grown)} (σ, q) pair(s) gained steps ({allowance.pairs} before), but a task trains at one "
                f"(σ, q) and there were {sent}"
            )
        if allowance.steps + added > tasks * per_task:
            return (
                f"{added} more DP-SGD steps ({allowance.steps} before), more than the {tasks} x {per_task} of the "
                f"{sent} (train.epochs={self.epochs} x max(1, {allowance.examples} examples // "
                f"train.batch_size={self.batch_size}))"
            )
        for sigma, q, _ in grown:
            if problem := self.sigma_problem(sigma) or self.rate_problem(q, allowance):
                return problem
        return None

    def sigma_problem(self, sigma: float) -> str | None:
        if self.target_epsilon > 0:
            if not 0 < sigma <= MAX_NOISE_MULTIPLIER:
                return f"σ={sigma!r} is not in (0, {MAX_NOISE_MULTIPLIER:g}], where privacy.target_epsilon plans σ"
            return None
        if not math.isclose(sigma, self.noise_multiplier, rel_tol=RATE_TOLERANCE):
            return f"σ={sigma!r}, but privacy.noise_multiplier={self.noise_multiplier!r}"
        return None

    def rate_problem(self, q: float, allowance: Allowance) -> str | None:
        batch, n = self.batch_size, allowance.examples
        if q < min(1.0, batch / n) * (1 - RATE_TOLERANCE):
            return (
                f"q={q!r} is below train.batch_size / {n}: more than the {n} training examples this node can "
                "hold (its partition's, or federation.max_examples_per_node)"
            )
        if q < 1 and abs((m := batch / q) - round(m)) > RATE_TOLERANCE * m:
            return f"q={q!r} is not train.batch_size={batch} / n for a whole number n of examples"
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


class HistoryBook:
    """The server's record of every local-DP client's accountant history (see the module doc).

    Keys come from the server (`history_key` of the node's bound partition or its node id),
    never from a reply. Each client's ε is computed here from the kept history, not taken
    from the ε the reply states. `owners` remembers which node last extended each key, so a
    deployed node (same id in the next run) is sent its own history even before it replies.

    Nothing a node sends raises out of here but MalformedHistory: a history is kept only once its
    ε has been computed (finite) and, with a `prescription` and an `Allowance`, only if what it
    added matches what the server prescribed. A checkpoint's histories are checked entry by entry
    on load; an entry that cannot be accounted is dropped with a log line (a record written by an
    older version, which kept any finite σ > 0, must not stop a resume for good).

    Cost: each (σ, q) pair's RDP is computed once (`step_rdp`) and each key's ε is cached with the
    history it is of, so a round costs one sum of cached vectors per key whose history changed.
    """

    def __init__(
        self, delta: float, state: Mapping[str, Any] | None = None, prescription: Prescription | None = None
    ) -> None:
        self.delta, self.prescription = delta, prescription
        state = state if isinstance(state, Mapping) else {}
        histories, owners = state.get("histories", {}), state.get("owners", {})
        self.histories: dict[str, History] = {}
        self._epsilons: dict[str, tuple[tuple[tuple[float, float, int], ...], float]] = {}  # key -> (history, ε)
        for key, entries in histories.items() if isinstance(histories, Mapping) else []:
            if kept := self._loaded(str(key), entries):
                self.histories[str(key)] = kept
        self.owners: dict[str, int] = {}
        for key, owner in owners.items() if isinstance(owners, Mapping) else []:
            if isinstance(owner, int) and not isinstance(owner, bool):
                self.owners[str(key)] = owner

    def _loaded(self, key: str, entries: object) -> History:
        """A checkpointed history with every entry that cannot be accounted dropped (logged)."""
        if not isinstance(entries, (list, tuple)):
            log.warning("checkpoint: local-DP history of %s is not a list (%s); dropped", key, type(entries).__name__)
            return []
        kept: History = []
        for entry in entries:
            try:
                ((sigma, q, steps),) = check_history([entry])
                if not math.isfinite(epsilon([(sigma, q, max(steps, 1))], self.delta)):
                    raise MalformedHistory("its ε is not finite")
            except Exception as err:  # noqa: BLE001 - a record must not stop the resume, whatever it holds
                log.warning("checkpoint: local-DP history of %s: entry %r dropped: %s", key, entry, err)
                continue
            kept.append((sigma, q, steps))
        try:
            kept = check_history(kept)
            eps = epsilon(kept, self.delta)
            if not math.isfinite(eps):
                raise MalformedHistory(f"its ε is {eps}")
        except MalformedHistory as err:
            log.warning("checkpoint: local-DP history of %s dropped: %s", key, err)
            return []
        self._epsilons[key] = (tuple(kept), eps)
        return kept

    def check(self, key: str, metrics: Mapping, allowance: Allowance | None = None) -> tuple[History, History, float]:
        """(the history a reply carries, what it added to the one kept under `key`, its ε), or
        MalformedHistory: malformed, not a monotone extension of the kept one, not what the
        server prescribed (with a prescription and `allowance`), or not accountable (its ε cannot
        be computed or is not finite; under privacy.target_epsilon, exceeds the target). The
        cheap checks come first: only a history that passed them costs RDP computations, one per
        (σ, q) pair it added (`MalformedHistory.computed` when it is refused after all)."""
        computed = 0
        try:
            new = history_from_metrics(metrics)
            old = self.histories.get(key, [])
            if problem := extension_problem(old, new):
                raise MalformedHistory(f"not an extension of the recorded history of {key}: {problem}")
            grown = growth(old, new)
            p = self.prescription
            if p is not None and allowance is not None and (problem := p.problem(grown, allowance)):
                raise MalformedHistory(f"not what the server prescribed: {problem}")
            computed = len(grown)
            eps = epsilon(new, self.delta)
            if not math.isfinite(eps):
                raise MalformedHistory(f"its ε is {eps}")
            if p is not None and p.target_epsilon > 0 and grown and eps > p.target_epsilon * (1 + TARGET_TOLERANCE):
                raise MalformedHistory(f"its ε {eps:.6g} exceeds privacy.target_epsilon={p.target_epsilon:g}")
        except Exception as err:  # noqa: BLE001 - whatever a node's values make fail is a refusal, never a crash
            refusal = (
                err
                if isinstance(err, MalformedHistory)
                else MalformedHistory(f"cannot be accounted: {type(err).__name__}: {err}")
            )
            refusal.computed = computed
            raise refusal from None
        return new, grown, eps

    def record(self, key: str, node_id: int, metrics: Mapping, allowance: Allowance | None = None) -> History:
        """Keep the history a reply of `node_id` carries under `key` (see `check`; on MalformedHistory
        the one already kept stays); returns what it added (`growth`)."""
        new, grown, eps = self.check(key, metrics, allowance)
        self.histories[key], self.owners[key] = new, node_id
        self._epsilons[key] = (tuple(new), eps)
        return grown

    def epsilons(self) -> dict[str, float]:
        """Each client's cumulative ε at `delta`, from its kept history (cached per key with the
        history it is of: only keys whose history changed are summed again)."""
        out = {}
        for key, history in self.histories.items():
            cached = self._epsilons.get(key)
            if cached is None or cached[0] != tuple(history):
                cached = self._epsilons[key] = (tuple(history), epsilon(history, self.delta))
            out[key] = cached[1]
        return out

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

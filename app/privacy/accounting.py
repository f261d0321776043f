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
import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from opacus.accountants import RDPAccountant

from app.config.schema import ConfigError, PrivacyConfig
from app.protocol import HISTORY_METRICS, PRIOR_KEY, ROUNDS_KEY
from strategies.opacus_logging import remove_opacus_root_handler

remove_opacus_root_handler()  # Opacus calls logging.basicConfig on import

# Beyond this the noise (std σ · clip_norm on a sum of ~batch_size clipped gradients) swamps any signal:
# a target that needs more is treated as unreachable rather than silently training on noise.
MAX_NOISE_MULTIPLIER = 100.0
EPSILON_TOLERANCE = 0.01  # σ search: ε lands in [target - this, target] (Opacus's get_noise_multiplier default)
# One entry per (σ, q) a node ever trained with: σ changes only when a round is re-planned (a resume with
# other federation.rounds), so real histories stay tiny; each entry costs the server ~15 ms of accounting.
MAX_HISTORY_ENTRIES = 256

History = list[tuple[float, float, int]]


class PrivacyBudgetSpent(RuntimeError):
    """Another DP-SGD step would take this node's ε past privacy.target_epsilon (or its plan is done)."""


class MalformedHistory(ValueError):
    """An accountant history that is not a record of DP-SGD steps, or not an extension of the known one."""


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

"""Contribution scores of one synchronous round or FedBuff version (`ledger.contribution`): each
node's leave-one-out or Shapley value for the server's validation metric. This module builds the game
(app/ledger/contribution.py solves it), after Sun et al. 2019 (norm bounding), Lin et al. 2019 and
Fraboni et al. 2021 (free-riders). The game: a coalition's model is the model before the step plus its
members' parts of the released step, with the aggregation's own shares (`step_shares`, never
renormalised); each update is bounded at the step's median norm and split into its projection on the
last public global steps (at most PUBLIC_STEPS) and its private part; a node scores its private part's
value plus the rest's only where negative. Assumption: the public steps are the ones this process saw.
Central DP is refused (app/config/validate.py). Why, and the robust rules: docs/ledger.md#contribution-scores
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from app.config.schema import LedgerConfig
from app.ledger.contribution import CachedValue, leave_one_out, shapley
from strategies.replies import ValidReply
from strategies.tensor_ops import TensorDict

CPU = torch.device("cpu")
PUBLIC_STEPS = 4  # global steps kept as public directions (FedBuff's stale updates saw older ones)
PRIVATE_TOLERANCE = 1e-4  # a private part below this fraction of its update is rounding: zero


def flat(state: TensorDict, keys: Sequence[str], base: TensorDict | None = None) -> torch.Tensor:
    """`state`'s `keys` (minus `base`'s, subtracted in float64) as one float32 vector: the update
    space the scores work in."""
    parts = []
    for k in keys:
        t = state[k].detach().to(CPU, torch.float64).reshape(-1)
        if base is not None:
            t = t - base[k].detach().to(CPU, torch.float64).reshape(-1)
        parts.append(t.float())
    return torch.cat(parts) if parts else torch.zeros(0)


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.double(), b.double()))


def bound_norms(updates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each update clipped to the median L2 norm of `updates` (longer ones scaled down to it)."""
    if not updates:
        return []
    norms = [_dot(u, u) ** 0.5 for u in updates]
    bound = statistics.median(norms)
    return [u * (bound / n) if n > bound else u for u, n in zip(updates, norms, strict=True)]


def orthonormal(steps: Sequence[torch.Tensor], tolerance: float = 1e-6) -> list[torch.Tensor]:
    """An orthonormal basis of the span of `steps` (Gram-Schmidt in float64, twice over for
    stability; a step that adds no new direction is dropped)."""
    basis: list[torch.Tensor] = []
    for step in steps:
        v = step.double()
        size = float(v.norm())
        if size == 0.0:
            continue
        for _ in range(2):
            for q in basis:
                q64 = q.double()
                v -= torch.dot(v, q64) * q64
        if float(v.norm()) > tolerance * size:
            basis.append((v / v.norm()).float())
    return basis


def split_public(update: torch.Tensor, basis: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the update's projection on the span of the orthonormal `basis`, the rest); a rest smaller
    than PRIVATE_TOLERANCE of the update is the rounding of a public update: exact zeros."""
    u = update.double()
    public = torch.zeros_like(u)
    for q in basis:
        q64 = q.double()
        public += torch.dot(u, q64) * q64
    private = u - public
    if float(private.norm()) <= PRIVATE_TOLERANCE * float(u.norm()):
        private.zero_()
    return public.float(), private.float()


def step_shares(entries: dict[int, ValidReply], robust: dict[str, Any] | None, lr: float = 1.0) -> dict[int, float]:
    """entry -> its share of the released step: a mean's capped weight over the total; a robust
    rule's kept replies alike (by the staleness factor `scale`), its excluded ones 0 (null
    players); nothing when the rule skipped the step. Times the server learning rate `lr`."""
    if robust is None:
        weights = {i: r.weight for i, r in entries.items()}
    elif robust.get("policy") == "skip":
        return {}
    else:
        excluded = set(robust.get("excluded") or [])
        weights = {i: 0.0 if r.node_id in excluded else r.scale for i, r in entries.items()}
    total = sum(weights.values())
    return {i: lr * w / total for i, w in weights.items()} if total > 0 else {}


class RoundScores:
    """Scores per step, and their running totals per node; remembers the last models released,
    whose differences are the public steps."""

    def __init__(self, cfg: LedgerConfig, metric_of: Callable[[TensorDict], float], seed: int) -> None:
        self.cfg, self.metric_of = cfg, metric_of
        self.rng = random.Random(seed)
        self.totals: dict[int, float] = {}
        self.evaluations = 0
        self._last: torch.Tensor | None = None  # the model before the previous step, flat
        self._steps: deque[torch.Tensor] = deque(maxlen=PUBLIC_STEPS)  # newest last

    def score(
        self, previous: TensorDict, valid: list[ValidReply], robust: dict[str, Any] | None = None
    ) -> dict[int, float]:
        """node id -> this round's score (empty without a valid reply); `robust`: the robust
        rule's report (`strategy.robust_row()`), None under a mean."""
        replies = dict(enumerate(valid))
        shares = step_shares(replies, robust)
        return self._by_node(self._score(previous, replies, shares, {i: previous for i in replies}, 1), replies)

    def score_buffer(
        self, previous: TensorDict, buffer: list[ValidReply], server_lr: float, robust: dict[str, Any] | None = None
    ) -> dict[int, float]:
        """node id -> this FedBuff version's score, summed over the node's updates in the buffer
        (a fast node may have two there), each taken from the model it trained from; `robust`:
        the buffer rule's report (None: the mean buffer)."""
        entries = dict(enumerate(buffer))
        shares = step_shares(entries, robust, server_lr)
        bases = {i: r.base if r.base is not None else previous for i, r in entries.items()}
        recent = 1 + max((r.staleness for r in buffer), default=0)
        return self._by_node(self._score(previous, entries, shares, bases, recent), entries)

    def _public_basis(self, now: torch.Tensor, recent: int) -> list[torch.Tensor]:
        """Record the step that led to `now` (the model before this step) and return an orthonormal
        basis of the last `recent` public steps."""
        if self._last is not None and self._last.shape == now.shape:
            step = now - self._last
            if float(step.norm()) > 0:
                self._steps.append(step)
        self._last = now
        return orthonormal(list(self._steps)[-recent:])

    def _score(
        self,
        previous: TensorDict,
        replies: dict[int, ValidReply],
        shares: dict[int, float],
        bases: dict[int, TensorDict],
        recent: int,
    ) -> dict[int, float]:
        """entry -> score in the game of the module docstring."""
        keys = sorted(k for k, t in previous.items() if t.is_floating_point())
        start = flat(previous, keys)
        basis = self._public_basis(start, recent)
        if not replies or not shares:
            return {}
        updates = [flat(replies[i].arrays, keys, bases[i]) for i in replies]
        parts: dict[tuple[int, str], torch.Tensor] = {}
        for i, update, bounded in zip(replies, updates, bound_norms(updates), strict=True):
            _, private = split_public(bounded, basis)
            for name, part in (("private", private), ("unearned", update - private)):
                if shares.get(i, 0.0) and bool(part.any()):  # a zero part is a null player: left out, scored 0
                    parts[(i, name)] = part * shares[i]
        players = sorted(parts)

        def model(coalition: frozenset[tuple[int, str]]) -> TensorDict:
            v = start.clone()
            for p in sorted(coalition):  # one order: the same coalition gives the same bits
                v += parts[p]
            out, offset = dict(previous), 0
            for k in keys:
                n = previous[k].numel()
                out[k] = v[offset : offset + n].reshape(previous[k].shape).to(previous[k].dtype)
                offset += n
            return out

        def value(coalition: frozenset[tuple[int, str]]) -> float:
            return self.metric_of(model(coalition) if coalition else previous)

        game: dict[tuple[int, str], float] = {}
        if players:
            cached = CachedValue(value)
            if self.cfg.contribution == "loo":
                game = leave_one_out(cached, players)
            else:
                game = shapley(cached, players, self.cfg.shapley_permutations, self.rng, self.cfg.shapley_tolerance)
            self.evaluations += cached.evaluations
        return {i: game.get((i, "private"), 0.0) + min(0.0, game.get((i, "unearned"), 0.0)) for i in replies}

    def _by_node(self, scores: dict[int, float], replies: dict[int, ValidReply]) -> dict[int, float]:
        """Entry scores summed per node, and added to the running totals."""
        out: dict[int, float] = {}
        for entry, s in scores.items():
            node = replies[entry].node_id
            out[node] = out.get(node, 0.0) + s
        for node, s in out.items():
            self.totals[node] = self.totals.get(node, 0.0) + s
        return out

"""Norm bounding of the plain means (`strategy.norm_bound`): an update far larger than the
recently accepted ones is rejected (or clipped) before it reaches FedAvg's mean, FedBuff's mean
buffer or a region's mean.

Sun et al. 2019, "Can You Really Backdoor Federated Learning?", https://arxiv.org/abs/1911.07963:
bounding each update's L2 norm defeats boosted model replacement. A fixed bound would be one more
number to tune per model and task; here the bound is `multiple` × the median of the norms of the
last `HISTORY` updates the model took, so it follows the run (updates shrink as training converges).

- The update is Δ = reply − the model it trained from, over the floating-point tensors, summed in
  float64 one tensor at a time (no float32 overflow, no model-sized copy): one pass per reply, made
  as the reply is screened, so a streamed round (`streaming.MeanFold`) decides before it folds.
- Cold start: before the run has accepted any update there is no median, and the reference is the
  norm of the model the update trained from (a step of more than `multiple` times the model's own
  size is not a training step). A model that is all zeros has no size: its first updates pass.
- The reference changes only between steps (`commit`, once a step is applied), so within a round
  (or between two FedBuff versions) the verdicts do not depend on arrival order: a streamed and a
  gathered round decide alike, and a run is deterministic.
- An honest run never meets the bound at the default multiple (docs/strategies.md#norm-bounding):
  nothing is rejected or clipped and its figures are bit for bit those without it.
- The history is the strategy's state: checkpointed, so a resumed run bounds as an uninterrupted one.

Non-finite replies are left to the finiteness screening (their norm is NaN or Inf and says nothing).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from strategies.node_names import NodeNames, label
from strategies.replies import ValidReply
from strategies.tensor_ops import TensorDict

log = logging.getLogger("flwr.fedgpu." + __name__)

HISTORY = 50  # accepted update norms the median is taken over
REASON = "update norm"  # every rejection's reason starts so (the stall stop counts them)


CHUNK = 1 << 18  # elements a pass works on at once: 1 MiB of float32, in cache, no model-sized temporary


def _squared_distance(t: torch.Tensor, b: torch.Tensor | None = None) -> float:
    """Σ (t − b)² (Σ t² without `b`), a chunk at a time: float32 arithmetic where the tensors are
    float32 (the common case: about one read of each), float64 for a chunk whose float32 sum
    overflows and for other dtypes. The chunks' sums add up in Python floats (float64), so the
    total does not overflow, and its precision (relative ~1e-6) is plenty for a bound."""
    t = t.reshape(-1)
    b = None if b is None else b.reshape(-1).to(t.device)
    fast = t.dtype == torch.float32 and (b is None or b.dtype == torch.float32)
    buf = torch.empty(min(CHUNK, t.numel()), dtype=torch.float32, device=t.device) if fast and b is not None else None
    total = 0.0
    for start in range(0, t.numel(), CHUNK):
        x = t[start : start + CHUNK]
        y = None if b is None else b[start : start + CHUNK]
        part = math.inf
        if fast:
            d = x if y is None else torch.sub(x, y, out=buf[: x.numel()])  # type: ignore[index]
            part = float(torch.dot(d, d))
        if not math.isfinite(part):
            d64 = x.to(torch.float64) if y is None else x.to(torch.float64) - y.to(torch.float64)
            part = float(torch.dot(d64, d64))
        total += part
    return total


def distance(model: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> float:
    """||model − base||₂ over the base's floating-point tensors, without a model-sized temporary."""
    return math.sqrt(sum(_squared_distance(model[k], b) for k, b in base.items() if b.is_floating_point()))


def size(model: Mapping[str, torch.Tensor]) -> float:
    """||model||₂ over its floating-point tensors."""
    return math.sqrt(sum(_squared_distance(t) for t in model.values() if t.is_floating_point()))


def clipped(model: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], factor: float) -> TensorDict:
    """base + factor · (model − base) on the base's floating-point tensors, in the model's dtypes; the
    rest as sent."""
    out: TensorDict = {}
    for key, t in model.items():
        b = base.get(key)
        if b is None or not b.is_floating_point():
            out[key] = t
            continue
        b64 = b.to(t.device, torch.float64)
        out[key] = (b64 + (t.to(torch.float64) - b64) * factor).to(t.dtype)
    return out


@dataclass(frozen=True)
class Verdict:
    """One update's norm against the step's bound."""

    norm: float  # ||Δ|| as sent
    bound: float | None  # multiple × reference; None: no reference (a zero model before any update)
    reference: str  # what the bound is a multiple of, for the reason

    @property
    def over(self) -> bool:
        """Out of bound (a NaN or Inf norm is not: the finiteness screening names those)."""
        return self.bound is not None and math.isfinite(self.norm) and self.norm > self.bound


class NormBound:
    """The bound and its history (module docstring).

    Parameters
    ----------
    multiple : the bound is this many times the reference (> 1)
    clip : an update over the bound is scaled down to it (logged, and reported in the row's
        `norm_clipped`) instead of rejected (`strategy.norm_bound_action=clip`)
    """

    def __init__(self, multiple: float, clip: bool = False) -> None:
        if not (multiple > 1 and math.isfinite(multiple)):
            raise ValueError(f"norm bound multiple {multiple} must be a finite number > 1")
        self.multiple, self.clip = multiple, clip
        self.history: deque[float] = deque(maxlen=HISTORY)
        self._pending: dict[int, float] = {}  # id(reply) -> the norm it entered the step with

    def describe(self) -> str:
        """For the strategy's summary line."""
        action = "clipped" if self.clip else "rejected"
        return f"updates over {self.multiple:g} x the median of the last {HISTORY} accepted update norms are {action}"

    def verdict(self, model: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> Verdict:
        """The update model − base against this step's bound."""
        if self.history:
            ref = statistics.median(self.history)
            what = f"the median {ref:.3g} of the last {len(self.history)} accepted update norms"
        else:
            ref = size(base)
            what = f"the model's own norm {ref:.3g} (no update accepted yet)"
        return Verdict(distance(model, base), self.multiple * ref if ref > 0 else None, what)

    def admit(
        self,
        reply: ValidReply,
        base: Mapping[str, torch.Tensor],
        clips: list[dict[str, Any]],
        names: NodeNames | None = None,
    ) -> str | None:
        """Bound `reply` (its arrays against `base`, the model it trained from): None when it goes on,
        else why it is rejected. Under action=clip an update over the bound is scaled down to it in
        place, logged, and its entry (node_id, norm, bound) appended to `clips`. The norm it goes on
        with is kept for `commit`."""
        v = self.verdict(reply.arrays, base)
        if not v.over:
            self._pending[id(reply)] = v.norm
            return None
        assert v.bound is not None
        why = f"{REASON} {v.norm:.3g} is over strategy.norm_bound={self.multiple:g} x {v.reference} (= {v.bound:.3g})"
        if not self.clip:
            return why
        reply.arrays = clipped(reply.arrays, base, v.bound / v.norm)
        self._pending[id(reply)] = v.bound
        clips.append({"node_id": reply.node_id, "norm": v.norm, "bound": v.bound})
        log.warning("%s: %s: clipped to it", label(reply.node_id, names), why)
        return None

    def commit(self, used: Iterable[ValidReply]) -> None:
        """A step was applied from `used`: their norms (as admitted: the bound when clipped) join the
        history, sorted (arrival order does not matter) and, past `HISTORY` of them, thinned to
        `HISTORY` evenly spaced order statistics (their median kept); whatever else was pending
        is dropped."""
        norms = sorted(n for r in used if (n := self._pending.get(id(r))) is not None and math.isfinite(n))
        if len(norms) > HISTORY:
            norms = [norms[i * (len(norms) - 1) // (HISTORY - 1)] for i in range(HISTORY)]
        self.history.extend(norms)
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        history = state.get("history", [])
        if not isinstance(history, list) or not all(isinstance(n, float) and math.isfinite(n) for n in history):
            raise ValueError("checkpoint's norm bound history must be a list of finite floats")
        self.history = deque(history, maxlen=HISTORY)
        self._pending.clear()

"""Streamed aggregation: each reply folded into a running sum as it arrives, then released.

Gathering a round's replies holds cohort x model bytes on the server; a weighted mean needs
only Σ wᵢ·xᵢ and Σ wᵢ. `MeanFold` keeps those in float64: one model-sized accumulator (twice the
float32 model) whatever the cohort. float64 changes two things against the gathered float32 mean
(`tensor_ops.weighted_mean`, summed in send order):

- the order replies arrive in no longer matters beyond float64 rounding (~1e-16 relative per
  addition; the result, rounded back to float32, agrees with the gathered mean to ~1e-7 relative,
  a float32 ulp or two), so a streamed run is reproducible to that tolerance, not bit for bit;
- no finite float32 input can overflow it (weights ≤ `replies.MAX_WEIGHT` = 2^53, values
  ≤ 3.4e38, so each term ≤ 6e54 and any cohort's sum stays far below float64's 1.8e308): a mean of
  finite, screened replies is always finite, so no reply is ever dropped for the step it would make
  (the gathered path's `finite_step`), and per-reply screening (NaN or Inf in a reply) is the only
  finiteness check needed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from strategies.replies import EncodedModel
from strategies.tensor_ops import TensorDict, stage


class MeanFold:
    """Σ wᵢ·xᵢ / Σ wᵢ over replies added one at a time, in float64, on `device`.

    A compressed reply (an `EncodedModel` of `base`) adds its update wᵢ·(xᵢ − base) without a
    dense copy (`add_update_to`); the base's share (Σ of those wᵢ, times base) is added once at
    the end. Integer tensors (BatchNorm counters) are averaged and rounded, as the gathered mean does.
    """

    def __init__(self, base: Mapping[str, torch.Tensor], device: torch.device) -> None:
        self.base, self.device = base, device
        self.acc: TensorDict = {k: torch.zeros(t.shape, dtype=torch.float64, device=device) for k, t in base.items()}
        self.total = 0.0  # Σ wᵢ
        self.encoded_total = 0.0  # Σ wᵢ of the replies added as updates of `base`

    def add(self, model: Mapping[str, torch.Tensor], weight: float) -> None:
        """acc += weight · model (a screened, finite reply)."""
        if isinstance(model, EncodedModel) and model.base is self.base:
            floats = {k: a for k, a in self.acc.items() if self.base[k].is_floating_point()}
            model.add_update_to(floats, weight)
            dense = {k: model[k] for k in self.acc.keys() - floats.keys()}  # integer buffers: sent as they are
            self.encoded_total += weight
        else:
            dense = dict(model)
        (staged,) = stage([dense], self.device)
        for k, t in staged.items():
            self.acc[k].add_(t, alpha=weight)
        self.total += weight

    def result(self) -> TensorDict | None:
        """The weighted mean in the base's dtypes (None: nothing was added); frees the accumulator."""
        if not self.total > 0:
            return None
        out: TensorDict = {}
        for k in list(self.acc):
            acc, ref = self.acc.pop(k), self.base[k]
            if self.encoded_total and ref.is_floating_point():
                acc.add_(ref.to(self.device), alpha=self.encoded_total)
            acc.div_(self.total)
            out[k] = (acc if ref.is_floating_point() else acc.round()).to(ref.dtype)
            del acc
        return out


class UpdateFold:
    """Σ wᵢ·(xᵢ − baseᵢ) / Σ wᵢ over updates added one at a time, in float64, on `device`: FedBuff's
    mean buffer streamed. Each reply trained from its own base version, so the update is taken at
    entry and neither the reply nor its base is kept; the accumulator is one float64 model whatever K.
    """

    def __init__(self, ref: Mapping[str, torch.Tensor], device: torch.device) -> None:
        self.ref, self.device = ref, device
        self.acc: TensorDict = {k: torch.zeros(t.shape, dtype=torch.float64, device=device) for k, t in ref.items()}
        self.total = 0.0  # Σ wᵢ

    def add(self, model: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], weight: float) -> None:
        """acc += weight · (model − base), a screened, finite reply against the version it trained from."""
        for k, acc in self.acc.items():
            (m, b) = stage([{k: model[k]}, {k: base[k]}], self.device)
            acc.add_(m[k], alpha=weight).sub_(b[k], alpha=weight)
        self.total += weight

    def mean(self) -> TensorDict:
        """The weighted mean update in FedBuff's update dtypes (float32; float64 for integer tensors)."""
        return {
            k: (acc / self.total).to(torch.float32 if self.ref[k].is_floating_point() else torch.float64)
            for k, acc in self.acc.items()
        }

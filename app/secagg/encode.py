"""A node's ring vector: its update (trained - received), weighted or clipped, the extras the round
asks for, quantized into the ring and, under distributed DP, with its share of the Skellam noise.

Plain secure aggregation weights the update by w = min(examples, max_weight) / max_weight (the
cap the server vouches for, applied here because the server never sees the count) and sums w,
w x loss and w x accuracy beside it, so the server divides sums by the sum of weights: FedAvg.
Distributed DP (Kairouz et al. 2021; Agarwal et al. 2021): every update counts 1, is clipped to
L2 <= C, rounded to nearest, and carries integer Skellam noise drawn here from the OS's CSPRNG;
no loss or accuracy is summed (they are outside every epsilon).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ConfigRecord

from app.protocol import (
    SECAGG_CLIP_NORM,
    SECAGG_CLIPPING,
    SECAGG_COUNT_NOISE,
    SECAGG_EXTRAS,
    SECAGG_MAX_WEIGHT,
    SECAGG_MODULUS,
    SECAGG_NOISE,
    SECAGG_QUANTIZATION,
)
from app.secagg.ring import ACCURACY, CLIPPED, LOSS, UNCLIPPED, WEIGHT, Layout, Ring


def ring_of(record: ConfigRecord) -> Ring:
    return Ring(float(record[SECAGG_CLIPPING]), int(record[SECAGG_QUANTIZATION]), int(record[SECAGG_MODULUS]))


def node_vector(
    trained: Mapping[str, torch.Tensor],
    received: Mapping[str, torch.Tensor],
    examples: int,
    loss: float,
    accuracy: float,
    record: ConfigRecord,
    generator: torch.Generator,
) -> np.ndarray:
    """This node's input to the secure sum (in [0, M), the ring's wire word), before masking."""
    ring, layout = ring_of(record), Layout.of(received, list(record[SECAGG_EXTRAS]))
    update = {k: trained[k].detach().cpu().double() - received[k].detach().cpu().double() for k in layout.keys}
    clip_norm, noise = float(record.get(SECAGG_CLIP_NORM, 0.0)), float(record.get(SECAGG_NOISE, 0.0))
    extras: dict[str, float] = {}
    if clip_norm > 0:
        norm = float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in update.values()]))) if update else 0.0
        scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
        update = {k: t.mul_(scale) for k, t in update.items()}
        extras[UNCLIPPED] = 1.0 if norm <= clip_norm else 0.0
        weight = 1.0
    else:
        cap = float(record[SECAGG_MAX_WEIGHT])
        weight = min(float(examples), cap) / cap
        update = {k: t.mul_(weight) for k, t in update.items()}
    c = ring.clipping_range
    numel = sum(t.numel() for t in update.values())
    beyond = sum(int((t.abs() > c).sum()) for t in update.values())
    extras |= {
        WEIGHT: weight,
        LOSS: weight * loss,
        ACCURACY: weight * accuracy,
        CLIPPED: weight * (beyond / numel if numel else 0.0),
    }
    vector = layout.flatten(update, extras)
    ints = ring.encode(vector, None if clip_norm > 0 else generator).astype(np.int64)
    if noise > 0 or UNCLIPPED in layout.extras:
        from app.privacy.skellam import os_rng, skellam_noise  # only under distributed DP

        rng = os_rng()
        n_update = layout.size - len(layout.extras)
        ints[:n_update] += skellam_noise((n_update,), noise, rng) if noise > 0 else 0
        if UNCLIPPED in layout.extras and (count_noise := float(record.get(SECAGG_COUNT_NOISE, 0.0))) > 0:
            at = n_update + layout.extras.index(UNCLIPPED)
            ints[at] += int(skellam_noise((1,), count_noise, rng)[0])
    return ring.reduce(ints)

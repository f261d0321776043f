"""Byzantine client simulation, run inside the ClientApp so attacks cross the network.

Which nodes are malicious is a seeded draw of `attack.num_malicious` partition ids
(`malicious_partitions`); the server computes the same draw and records it. Honest
nodes are untouched.

- sign_flip:  send global − s·Δ (Δ = the honest update)
- scale:      send global + s·Δ (model replacement)
- gaussian:   send global + N(0, s²) on every floating-point weight (no training)
- label_flip: train honestly on labels y → C − 1 − y
- inflate_weight: send global − s·Δ and claim `attack.claimed_examples` examples (a
  reversed update that only an uncapped sample weight makes decisive)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from app.config.registry import Registry
from app.config.schema import ATTACKS, AttackConfig

# What a model-poisoning client sends for one floating-point tensor: (trained t, global g,
# scale s, generator) -> tensor. None: the attack sends the trained model (label_flip trains
# on flipped labels; none is honest).
Poison = Callable[[torch.Tensor, torch.Tensor, float, torch.Generator], torch.Tensor]


def _reverse(t: torch.Tensor, g: torch.Tensor, s: float, _gen: torch.Generator) -> torch.Tensor:
    return g - s * (t - g)


def _scale(t: torch.Tensor, g: torch.Tensor, s: float, _gen: torch.Generator) -> torch.Tensor:
    return g + s * (t - g)


def _gaussian(t: torch.Tensor, g: torch.Tensor, s: float, gen: torch.Generator) -> torch.Tensor:
    return g + s * torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device, t.dtype)


_POISONS: Registry[Poison | None] = Registry(
    "attack.name",
    ATTACKS,
    {
        "none": None,
        "label_flip": None,
        "sign_flip": _reverse,
        "inflate_weight": _reverse,
        "scale": _scale,
        "gaussian": _gaussian,
    },
)
MODEL_POISONING = tuple(name for name in ATTACKS if _POISONS[name] is not None)


def malicious_partitions(seed: int, num_partitions: int, num_malicious: int) -> list[int]:
    """The partition ids of the malicious nodes, deterministic by seed."""
    if num_malicious > num_partitions:
        raise ValueError(f"attack.num_malicious={num_malicious} exceeds the {num_partitions} nodes")
    draw = np.random.default_rng([seed, 0xB12]).permutation(num_partitions)[:num_malicious]
    return sorted(int(i) for i in draw)


def is_malicious(cfg: AttackConfig, seed: int, partition_id: int | None, num_partitions: int) -> bool:
    """Only simulated nodes (with a partition id) are ever made malicious."""
    if cfg.name == "none" or cfg.num_malicious == 0 or partition_id is None:
        return False
    return partition_id in malicious_partitions(seed, num_partitions, cfg.num_malicious)


def flip_labels(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Class c becomes num_classes - 1 - c; N x K 0/1 targets (multi-label) are inverted."""
    return 1 - y if y.dim() == 2 else num_classes - 1 - y


def reported_examples(cfg: AttackConfig, num_examples: int) -> float:
    """The num-examples a malicious node reports: its real count, except under inflate_weight."""
    return cfg.claimed_examples if cfg.name == "inflate_weight" else num_examples


def poison(
    trained: dict[str, torch.Tensor], global_model: dict[str, torch.Tensor], cfg: AttackConfig, seed: int
) -> dict[str, torch.Tensor]:
    """The state a model-poisoning client sends instead of its trained model."""
    fn = _POISONS[cfg.name]
    if fn is None:
        raise ValueError(f"attack.name={cfg.name!r} does not poison models")
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key, t in trained.items():
        g = global_model[key].to(t.device)
        out[key] = fn(t, g, cfg.scale, generator) if t.is_floating_point() else t
    return out

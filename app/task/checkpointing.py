"""Gradient checkpointing (`train.gradient_checkpointing`): keep fewer activations for the
backward pass and recompute them there, trading compute for memory.

Transformers have their own switch (`gradient_checkpointing_enable`, layer by layer). Other
models are checkpointed block by block with `torch.utils.checkpoint`: every composite block in
a Sequential or ModuleList (ResNet's BasicBlocks, MobileNet's inverted residuals), or, for a
model made of one Sequential of single layers (the built-in CNN), that Sequential in about
sqrt(n) segments (`checkpoint_sequential`). The blocks' `forward` is wrapped in place, so the
state_dict keys, and so the messages, do not change. Checkpointing acts in training mode only
(evaluation keeps no activations).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

log = logging.getLogger("flwr.fedgpu." + __name__)


def _wrap(module: nn.Module, run: Callable[..., Any]) -> None:
    """Route `module`'s forward through `run` while training (the instance attribute shadows the class's)."""
    plain = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        return run(plain, *args, **kwargs) if module.training and torch.is_grad_enabled() else plain(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def _blocks(model: nn.Module) -> list[nn.Module]:
    """Composite blocks (with parameters and children) that sit in a Sequential or ModuleList."""
    found = []
    for container in model.modules():
        if isinstance(container, nn.Sequential | nn.ModuleList):
            found += [m for m in container if any(True for _ in m.children()) and any(True for _ in m.parameters())]
    return found


def enable_checkpointing(model: nn.Module) -> str:
    """Turn gradient checkpointing on for `model`; returns what was checkpointed, for the log."""
    inner = getattr(model, "inner", None)
    if inner is not None and hasattr(inner, "gradient_checkpointing_enable"):  # app.task.hf.TextModel
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return "transformers' own, layer by layer"
    blocks = _blocks(model)
    for block in blocks:
        _wrap(block, lambda f, *a, **k: checkpoint(f, *a, use_reentrant=False, **k))
    if blocks:
        return f"{len(blocks)} blocks"
    flat = [m for m in model.modules() if isinstance(m, nn.Sequential) and len(m) > 2]
    if not flat:
        raise ValueError(
            f"train.gradient_checkpointing: {type(model).__name__} has no blocks to checkpoint (no Sequential or "
            "ModuleList of layers); turn it off, or build the model from such containers"
        )
    seq = max(flat, key=len)
    segments = max(2, round(math.sqrt(len(seq))))
    _wrap(seq, lambda f, x: checkpoint_sequential(seq, segments, x, use_reentrant=False))
    return f"a Sequential of {len(seq)} layers in {segments} segments"

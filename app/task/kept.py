"""Tensors a node keeps between rounds (compression's error-feedback residual, SCAFFOLD's control
variate): in its Context's state and, with a `state-dir` (deployed nodes), also in a file, so that
a restarted node (a new Context) takes them up again."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("flwr.fedgpu." + __name__)

TensorDict = dict[str, torch.Tensor]


def load_kept(path: Path) -> TensorDict | None:
    """The tensors saved at `path`; None without the file, or with a torn or foreign one."""
    if not path.exists():
        return None
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - a torn or foreign file: start from zero, as without one
        log.warning("%s: cannot read the saved tensors (%s); starting from zero", path, err)
        return None


def save_kept(path: Path, tensors: TensorDict) -> None:
    """Written to a temporary file and renamed: a crash mid-write leaves the previous tensors."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({k: v.detach().cpu() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)

"""Ditto's node side (Li et al. 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization"): beside the global model it trains for the federation, each node keeps a
personal model v, trained every round on its own data with the proximal pull lambda (v - w)
towards the global model w it received, and never sent. Federated evaluation reports both
models on the node's validation split (`eval-personal-<metric>` beside `eval-<metric>`).

v lives in the node's Context state and, with a `state-dir`, in a file there (it outlives a
restarted node); a node's first v is the global model it first received.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from app.config.schema import TrainConfig
from app.task.data import Examples
from app.task.kept import load_kept, save_kept
from app.task.metrics import Task
from app.task.training import Precision, Steps, TrainStats, fit

TensorDict = dict[str, torch.Tensor]
STATE = "ditto-personal"  # ArrayRecord in the node's Context state: v
PERSONAL = "personal-"  # eval-personal-<metric>: the personal model's evaluation


def personal_file(state_dir: str, run_id: int) -> Path:
    """Where a node with a state directory keeps v for run `run_id`."""
    return Path(state_dir) / f"ditto-personal-run{run_id}.pt"


def personal_state(state: RecordDict, saved: Path | None, received: TensorDict) -> TensorDict:
    """v: the Context's, else the file's, else the global model `received` (a first round, or
    another model)."""
    kept = state[STATE].to_torch_state_dict() if STATE in state else (load_kept(saved) if saved else None)
    if kept is None or kept.keys() != received.keys() or any(kept[k].shape != t.shape for k, t in received.items()):
        return {k: t.detach().clone() for k, t in received.items()}
    return kept


def personal_model(model: nn.Module, personal: TensorDict) -> nn.Module:
    """A copy of `model` (its frozen parts as they are) holding v in its sent tensors."""
    twin = copy.deepcopy(model)
    device = next(twin.parameters()).device
    twin.load_state_dict({k: v.to(device) for k, v in personal.items()}, strict=False)
    return twin


def train_personal(
    model: nn.Module,
    personal: TensorDict,
    received: TensorDict,
    data: Examples,
    cfg: TrainConfig,
    precision: Precision,
    seed: int,
    task: Task,
    lam: float,
) -> tuple[TensorDict, TrainStats]:
    """One round of v's training: `cfg`'s epochs on `data` with lambda (v - w) added to every
    step's gradient, w the global model `received`; v's new tensors and the loop's statistics."""
    twin = personal_model(model, personal)
    device = next(twin.parameters()).device
    anchor = {k: t.to(device) for k, t in received.items()}
    stats = fit(Steps(twin, cfg, precision, torch.Generator().manual_seed(seed), task, lam, anchor=anchor), data)
    trained = twin.state_dict()
    return {k: trained[k].detach().cpu().clone() for k in personal}, stats


def keep_personal(state: RecordDict, saved: Path | None, personal: TensorDict) -> None:
    state[STATE] = ArrayRecord({k: v.detach().cpu() for k, v in personal.items()})
    if saved is not None:
        save_kept(saved, personal)

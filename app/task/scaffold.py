"""SCAFFOLD's node side (Karimireddy et al. 2020, option II): the node's control variate c_i, the
correction c - c_i added to every step's gradient (`Steps`), and after training the new variate
c_i+ = c_i - c + (x - y) / (K lr), x the model received, y the model trained, K the optimizer
steps taken, lr the round's learning rate (with SGD momentum b, lr / (1 - b): the distance a
constant gradient moves the model per step, without which c_i is 1 / (1 - b) times too large
and training diverges). The reply carries c_i+ - c_i beside the model
(keys `SCAFFOLD_DELTA` + name); the server (strategies/scaffold.py) moves c by their mean.

Only the model's trainable parameters have a variate: a floating buffer (BatchNorm's running
statistics) gets no correction and reports no change. Adam's steps have no such step size:
SCAFFOLD is refused with train.optimizer other than sgd.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from app.task.kept import load_kept

log = logging.getLogger("flwr.fedgpu." + __name__)

TensorDict = dict[str, torch.Tensor]
STATE = "scaffold-ci"  # ArrayRecord in the node's Context state: c_i


def variate_file(state_dir: str, run_id: int) -> Path:
    """Where a node with a state directory keeps c_i for run `run_id` (it survives a restart)."""
    return Path(state_dir) / f"scaffold-variate-run{run_id}.pt"


def node_variate(state: RecordDict, saved: Path | None, server_c: TensorDict) -> TensorDict:
    """c_i: the Context's, else the file's, else zeros (a node's first round); zeros too when its
    keys or shapes are not c's (another model)."""
    in_state = STATE in state
    kept = state[STATE].to_torch_state_dict() if in_state else (load_kept(saved) if saved else None)
    if kept is None or kept.keys() != server_c.keys() or any(kept[k].shape != c.shape for k, c in server_c.items()):
        return {k: torch.zeros_like(c) for k, c in server_c.items()}
    if not in_state:  # a new Context with the file of an earlier one: the node restarted mid-run
        log.info("SCAFFOLD: control variate taken up from %s (sha256 %s)", saved, digest(kept))
    return {k: v.to(server_c[k].dtype) for k, v in kept.items()}


def digest(tensors: TensorDict) -> str:
    """SHA-256 of the tensors' names and bytes in name order: which variate a node took up."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def corrections(model: nn.Module, server_c: TensorDict, variate: TensorDict, device: torch.device) -> TensorDict:
    """Parameter name -> c - c_i, on `device`, for the model's trainable parameters that c covers."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: (server_c[k] - variate[k]).to(device) for k in server_c if k in trainable}


def new_variate(
    variate: TensorDict,
    server_c: TensorDict,
    received: TensorDict,
    trained: TensorDict,
    corrected: set[str],
    steps: int,
    lr: float,
) -> tuple[TensorDict, TensorDict]:
    """(c_i+, c_i+ - c_i): option II for the `corrected` parameters; the rest (buffers, frozen
    tensors) keep c_i. No step taken (an empty partition): no change."""
    new = dict(variate)
    if steps > 0 and lr > 0:
        for k in corrected:
            drift = (received[k].double() - trained[k].detach().cpu().double()) / (steps * lr)
            new[k] = (variate[k].double() - server_c[k].double() + drift).to(variate[k].dtype)
    return new, {k: new[k] - variate[k] for k in variate}


def keep(state: RecordDict, variate: TensorDict) -> None:
    state[STATE] = ArrayRecord({k: v.detach().cpu() for k, v in variate.items()})

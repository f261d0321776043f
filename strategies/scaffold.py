"""SCAFFOLD (Karimireddy et al. 2020): FedAvg with control variates that correct each node's drift
on skewed data. The server keeps c (zeros at first, one tensor per floating model key) and sends
it with every training task (`SCAFFOLD_C`); a node trains with c - c_i added to its gradients and
replies with its model and the change of its own variate, c_i+ - c_i (`SCAFFOLD_DELTA` + key,
app/task/scaffold.py). The new model is this FedAvg's (the sample-weighted mean, then any server
optimizer: the paper's global step size is `server_optimizer=sgd`'s η); c moves by |S| / N times
the plain mean of the round's accepted changes (S: the nodes whose replies were used, N: the
nodes connected when the round was sent), as in the paper. c is saved in the checkpoint.

The server reads each c_i change in the clear, an exact statistic of a node's training: it is
refused with every kind of DP and with secure aggregation (app/config/validate.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from strategies.fedavg import FedAvg
from strategies.keys import SCAFFOLD_C, SCAFFOLD_DELTA
from strategies.replies import Screened
from strategies.tensor_ops import TensorDict

log = logging.getLogger("flwr.fedgpu." + __name__)


class Scaffold(FedAvg):
    """FedAvg with SCAFFOLD's server control variate (module docstring)."""

    streams = False  # each reply's change of c_i is kept until the round's mean of them

    def __init__(self, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self.c: TensorDict = {}  # the server's control variate
        self.population = 0  # N: the nodes connected when the round was sent

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's tasks, each with c; replies must hold the change of c_i for every key of c."""
        self.population = len(list(grid.get_node_ids()))
        messages = list(super().configure_train(server_round, arrays, config, grid))
        floating = {k: t for k, t in self._global.items() if t.is_floating_point()}
        if self.c.keys() != floating.keys():  # the first round (or another model): c = 0
            self.c = {k: torch.zeros_like(t, device=self.device) for k, t in floating.items()}
        record = ArrayRecord({k: v.cpu() for k, v in self.c.items()})
        for message in messages:
            message.content[SCAFFOLD_C] = record
        for key in self.c:  # a change of c_i is shaped as its tensor
            self._specs[SCAFFOLD_DELTA + key] = self._specs[key]
        return messages

    def combine(self, server_round: int, screened: Screened) -> TensorDict | None:
        """FedAvg's model from the replies' models; then c += |S| / N x mean of their c_i changes."""
        deltas: dict[int, TensorDict] = {}
        for reply in screened.valid:
            keys = [k for k in reply.arrays if k.startswith(SCAFFOLD_DELTA)]
            deltas[reply.node_id] = {k[len(SCAFFOLD_DELTA) :]: reply.arrays.pop(k) for k in keys}
        new = super().combine(server_round, screened)
        used = [deltas[r.node_id] for r in screened.valid if r.node_id not in self.train_report.excluded]
        if new is not None and used:
            scale = len(used) / max(self.population, len(used))
            for key, c in self.c.items():
                mean = sum(d[key].to(self.device, torch.float64) for d in used) / len(used)
                self.c[key] = (c.double() + scale * mean).to(c.dtype)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "scaffold_c": {k: v.cpu() for k, v in self.c.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.c = {k: v.to(self.device) for k, v in state.get("scaffold_c", {}).items()}

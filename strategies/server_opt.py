"""Server optimizers (Reddi et al. 2021, "Adaptive Federated Optimization"): the round's aggregate
is not the new model but a pseudo-gradient step from the current one.

With Δ = aggregate − current (the round's mean update, whatever rule made the aggregate):

- `sgd`:      x + η Δ                                       (η = 1: FedAvg)
- `momentum`: v = β v + Δ (v₁ = Δ); x + η v                 (FedAvgM, Hsu et al. 2019)
- `adam`:     m = β₁ m + (1 − β₁) Δ, v = β₂ v + (1 − β₂) Δ²; x + η_t m / (√v + τ),
              η_t = η √(1 − β₂^(t+1)) / (1 − β₁^(t+1))      (FedAdam)
- `yogi`:     m as adam, v = v − (1 − β₂) Δ² sign(v − Δ²); x + η m / (√v + τ)   (FedYogi)
- `adagrad`:  m as adam, v = v + Δ²; x + η m / (√v + τ)     (FedAdagrad; β₁ = 0 in the paper)

Each is the definition of Flower 1.42's own FedAvgM, FedAdam, FedYogi and FedAdagrad, m and v
starting at zero, adam's bias correction with t the server round as Flower's (the paper has
none), so the same replies give the same model (tests/test_server_opt.py). Floating-point
tensors only: an integer tensor (BatchNorm's counter) takes the aggregate as it is. m and v
live on the aggregation device and go into the checkpoint (`state_dict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from strategies.tensor_ops import TensorDict

SERVER_OPTIMIZERS = ("none", "sgd", "momentum", "adam", "yogi", "adagrad")
Moments = tuple[TensorDict, TensorDict]  # (m, v) after a step
# η when strategy.server_lr is 0 (auto): Flower 1.42's defaults for its FedAdam, FedYogi and FedAdagrad
DEFAULT_LR = {"sgd": 1.0, "momentum": 1.0, "adam": 0.1, "yogi": 0.01, "adagrad": 0.1}


@dataclass
class ServerOptimizer:
    """One optimizer's settings and its state across rounds."""

    name: str
    lr: float
    momentum: float = 0.9  # β, `momentum` only
    beta1: float = 0.9  # β₁ of adam, yogi, adagrad
    beta2: float = 0.99  # β₂ of adam, yogi
    tau: float = 1e-3  # τ: the adaptivity floor
    m: TensorDict = field(default_factory=dict)  # first moment (the velocity under `momentum`)
    v: TensorDict = field(default_factory=dict)  # second moment

    def __post_init__(self) -> None:
        if self.name not in DEFAULT_LR:
            raise ValueError(f"server optimizer {self.name!r}: one of {', '.join(DEFAULT_LR)}")

    def step(self, current: TensorDict, aggregate: TensorDict, t: int) -> TensorDict:
        """The new model from the `current` one and the round's `aggregate`; `t`: the round."""
        new, moments = self.propose(current, aggregate, t)
        self.commit(moments)
        return new

    def propose(self, current: TensorDict, aggregate: TensorDict, t: int) -> tuple[TensorDict, Moments]:
        """`step` without keeping its m and v (`commit` does): FedBuff tries a step, and again
        without the updates that made it non-finite, before it keeps one."""
        out: TensorDict = {}
        m, v = dict(self.m), dict(self.v)
        for key, target in aggregate.items():
            base = current[key].to(target.device)
            if not target.is_floating_point():
                out[key] = target
                continue
            delta = target.double() - base.double()
            out[key] = (base.double() + self._direction(key, delta, t, m, v)).to(target.dtype)
        return out, (m, v)

    def commit(self, moments: Moments) -> None:
        self.m, self.v = moments

    def _direction(self, key: str, delta: torch.Tensor, t: int, ms: TensorDict, vs: TensorDict) -> torch.Tensor:
        """η times the optimizer's step direction for one tensor, updating its m and v in `ms`, `vs`."""
        if self.name == "sgd":
            return self.lr * delta
        if self.name == "momentum":
            velocity = ms[key] * self.momentum + delta if key in ms else delta.clone()
            ms[key] = velocity
            return self.lr * velocity
        m = ms.get(key, torch.zeros_like(delta)) * self.beta1 + (1 - self.beta1) * delta
        v = vs.get(key, torch.zeros_like(delta))
        square = delta * delta
        if self.name == "adam":
            v = self.beta2 * v + (1 - self.beta2) * square
            lr = self.lr * math.sqrt(1 - self.beta2 ** (t + 1)) / (1 - self.beta1 ** (t + 1))
        elif self.name == "yogi":
            v = v - (1 - self.beta2) * square * torch.sign(v - square)
            lr = self.lr
        else:  # adagrad
            v = v + square
            lr = self.lr
        ms[key], vs[key] = m, v
        return lr * m / (v.sqrt() + self.tau)

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "m": {k: t.cpu() for k, t in self.m.items()},
            "v": {k: t.cpu() for k, t in self.v.items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        if state.get("name") != self.name:
            raise ValueError(
                f"the checkpoint's server optimizer is {state.get('name')!r}, this run's {self.name!r}: "
                "resume with the same strategy.server_optimizer"
            )
        self.m = {k: t.to(device) for k, t in state["m"].items()}
        self.v = {k: t.to(device) for k, t in state["v"].items()}

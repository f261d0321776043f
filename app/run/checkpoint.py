"""Checkpoints: everything needed to continue a run exactly where it stopped.

One file per run (`checkpoint.pt`), replaced atomically after every round: model
arrays, the round just finished, strategy state, RNG states (the strategy's node sampler;
Python's, NumPy's and torch's global ones for the rest) and the run's elapsed time.
Loaded with `weights_only=True`, so a checkpoint cannot execute code.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1

log = logging.getLogger("flwr.fedgpu." + __name__)


@dataclass
class Checkpoint:
    state_dict: dict[str, torch.Tensor]
    round: int
    strategy_state: dict[str, Any]
    rng: dict[str, Any]
    wall_time_s: float
    run_state: dict[str, Any] = field(default_factory=dict)  # the run's own (e.g. local-DP histories per node)


def capture_rng(sampler: random.Random | None = None) -> dict[str, Any]:
    """The global RNG states, and `sampler`'s (a strategy's node sampler) when given."""
    np_state = np.random.get_state(legacy=False)
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if sampler is not None:
        rng["sampler"] = sampler.getstate()
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _python_state(saved: tuple) -> tuple:
    """A saved `random.getstate()` as `setstate` takes it (the middle part may come back a list)."""
    version, state, gauss = saved
    return version, tuple(state), gauss


def restore_rng(rng: dict[str, Any], sampler: random.Random | None = None) -> None:
    """Set the global RNG states, and `sampler`'s when given (from a checkpoint made before the
    strategies had their own sampler: the global `random` state, which they drew from then)."""
    random.setstate(_python_state(rng["python"]))
    if sampler is not None:
        sampler.setstate(_python_state(rng.get("sampler", rng["python"])))
    n = rng["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    torch.set_rng_state(rng["torch"])
    restore_cuda_rng(rng.get("cuda", []))


def restore_cuda_rng(states: list[torch.Tensor]) -> None:
    """Set the saved CUDA RNG states of the devices this process sees; never raise on a count mismatch."""
    # Dropping states is safe: the server's strategies draw only from their samplers and CPU generators.
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i, state in enumerate(states[:count]):
        torch.cuda.set_rng_state(state, device=i)
    if len(states) != count:
        log.info(
            "Resume: the checkpoint holds %d CUDA RNG state(s) and %d GPU(s) are visible; "
            "GPUs without a saved state keep their own, extra states are dropped",
            len(states),
            count,
        )


def non_finite_entries(tree: Any, prefix: str = "") -> list[str]:  # noqa: ANN401 - any nesting of dicts and lists
    """The paths of the floating-point tensors holding NaN or Inf anywhere in `tree`."""
    if isinstance(tree, torch.Tensor):
        return [prefix] if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else []
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in non_finite_entries(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(tree, (list, tuple)):
        return [p for i, v in enumerate(tree) for p in non_finite_entries(v, f"{prefix}[{i}]")]
    return []


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    """Write to a temporary file, then rename: a crash never leaves half a checkpoint.

    A model (or strategy state, e.g. FedBuff's momentum) holding NaN or Inf is never written:
    ValueError, and the previous checkpoint stays. The strategies refuse every step that would
    make the model non-finite, so this is the last line, not the check.
    """
    bad = non_finite_entries(ckpt.state_dict) + [f"strategy_state.{p}" for p in non_finite_entries(ckpt.strategy_state)]
    if bad:
        raise ValueError(
            f"round {ckpt.round}: the model to checkpoint holds NaN or Inf in {bad[:10]}; not written "
            f"({path} keeps the last finite round)"
        )
    payload = {
        "format": FORMAT_VERSION,
        "state_dict": {k: v.detach().cpu() for k, v in ckpt.state_dict.items()},
        "round": ckpt.round,
        "strategy_state": ckpt.strategy_state,
        "rng": ckpt.rng,
        "wall_time_s": ckpt.wall_time_s,
        "run_state": ckpt.run_state,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> Checkpoint:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - unpickling errors come in many types
        raise ValueError(f"resume={path}: not a readable checkpoint ({err})") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise ValueError(f"resume={path}: not a checkpoint of this app (format {FORMAT_VERSION})")
    if bad := non_finite_entries(payload.get("state_dict")) + non_finite_entries(payload.get("strategy_state")):
        raise ValueError(
            f"resume={path}: the checkpoint's model holds NaN or Inf in {bad[:10]} (written before "
            "non-finite models were refused); resume from an earlier copy or start anew"
        )
    return Checkpoint(
        state_dict=payload["state_dict"],
        round=int(payload["round"]),
        strategy_state=payload["strategy_state"],
        rng=payload["rng"],
        wall_time_s=float(payload["wall_time_s"]),
        run_state=payload.get("run_state", {}),
    )

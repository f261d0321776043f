"""A node's training on all its local GPUs: DistributedDataParallel inside one SuperNode.

Many sites are one server with 2-8 GPUs. With `train.local_devices` above one, the ClientApp
starts one worker process per device for the task (NCCL on CUDA, gloo on the CPU, where tests
run it), rendezvous through a file in a private temporary directory (no port to pick), and
rank 0 hands the trained model back. Every rank draws the same seeded shuffle and takes a
strided slice of each global batch, weighting its loss by its share of that batch, so the
ranks' mean gradient is the whole batch's: the step equals single-device training with the
same batch, up to float summation order (models whose layers act per example, as the
default CNN's GroupNorm; BatchNorm normalises per rank). Workers are started per task: a
deployed SuperNode starts a fresh ClientApp process per message anyway, so nothing outlives
it to keep warm. A worker that dies ends the task with an error naming the rank;
`torch.multiprocessing` then stops the other ranks, so the node never hangs in a collective.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel

from app.config.schema import ConfigError, ModelConfig, TaskConfig, TrainConfig
from app.task.data import DataSpec, Examples
from app.task.metrics import Task
from app.task.models import build_model, freeze
from app.task.training import Precision, Steps, TrainStats, batch_indices, fit, prepare_model

log = logging.getLogger("flwr.fedgpu." + __name__)

RENDEZVOUS_TIMEOUT = timedelta(minutes=5)  # a rank that never arrives fails the task instead of hanging it


def local_devices(setting: Any, device: torch.device) -> list[torch.device]:  # noqa: ANN401 - auto | int | list
    """The devices `train.local_devices` names for a node whose training device is `device`:
    `auto` is every visible GPU (one device on a CPU), N the first N (CPU: N gloo ranks, for
    tests), a list those CUDA indices (relative to CUDA_VISIBLE_DEVICES)."""
    if device.type != "cuda":
        count = 1 if setting == "auto" else (setting if isinstance(setting, int) else len(setting))
        return [torch.device("cpu")] * count
    visible = torch.cuda.device_count()
    indices = (
        list(range(visible))
        if setting == "auto"
        else list(range(setting))
        if isinstance(setting, int)
        else [int(i) for i in setting]
    )
    if not indices or max(indices) >= visible or len(set(indices)) != len(indices):
        raise ConfigError(
            f"train.local_devices={setting!r}: this process sees {visible} CUDA device(s) "
            f"(indices 0..{visible - 1}, relative to CUDA_VISIBLE_DEVICES); name distinct visible ones or use auto"
        )
    return [torch.device("cuda", i) for i in indices]


class DdpSteps(Steps):
    """One rank's part of each global batch: the same seeded shuffle on every rank, this rank's
    strided slice of each batch, its loss weighted by the slice's share of the batch (DDP
    averages the ranks' gradients). A rank whose slice is empty (a global batch smaller than
    the world) runs one example at weight 0, as every rank must join each gradient all-reduce."""

    unsplittable = (
        "local DDP cannot split a batch (ranks halving on their own would disagree on the number of all-reduces)"
    )

    def __init__(
        self, model: nn.Module, cfg: TrainConfig, precision: Precision, seed: int, task: Task, work: Work
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        super().__init__(model, cfg, precision, generator, task, work.proximal_mu, work.correction)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cuda = precision.device.type == "cuda"
        self.net = DistributedDataParallel(model, device_ids=[precision.device] if cuda else None)

    def epoch(self, n: int) -> Iterator[torch.Tensor]:
        for idx in batch_indices(n, self.cfg.batch_size, self.generator, self.precision.device):
            mine = idx[self.rank :: self.world]
            self.weight = len(mine) * self.world / len(idx)
            yield mine if len(mine) else idx[:1]

    def batch_sizes(self, n: int) -> list[int]:
        return [max(1, len(range(self.rank, size, self.world))) for size in super().batch_sizes(n)]


@dataclass(frozen=True)
class Work:
    """What each rank needs to rebuild the task: configs, not live objects (spawned processes
    import the app afresh; a model or a user loss need not pickle)."""

    model: ModelConfig
    spec: DataSpec
    task: TaskConfig
    train: TrainConfig
    precision: Precision
    seed: int
    scaler_state: dict[str, float | int] | None
    proximal_mu: float = 0.0  # FedProx: every rank pulls towards the model as received
    correction: dict[str, torch.Tensor] | None = None  # SCAFFOLD: c - c_i per parameter, the same on every rank


def train_on_devices(
    model: nn.Module,
    data: Examples,
    work: Work,
    devices: list[torch.device],
) -> TrainStats:
    """Train `model` (updated in place, as `train` does) on `devices` with DDP; the stats are
    the whole node's (every rank's examples, the slowest rank's time, the largest peak)."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory(prefix="fedgpu-ddp-") as tmp:
        out = Path(tmp) / "rank0.pt"
        context = mp.start_processes(
            _rank_main,
            args=(len(devices), devices, tmp, work, state, data, out),
            nprocs=len(devices),
            join=False,
            start_method="spawn",
        )
        try:
            while not context.join():
                pass
        except ProcessException as err:
            said = _last_words(Path(tmp), err.error_index)
            raise RuntimeError(
                f"local DDP training failed on rank {err.error_index} of {len(devices)} ({devices[err.error_index]}): "
                f"{err}; the other ranks were stopped" + (f"; its last output: {said}" if said else "")
            ) from err
        finally:
            _echo_logs(Path(tmp), len(devices))
        result = torch.load(out, weights_only=False)
    model.load_state_dict(result["state"])
    return TrainStats(**result["stats"])


def _rank_main(
    rank: int,
    world: int,
    devices: list[torch.device],
    tmp: str,
    work: Work,
    state: dict[str, torch.Tensor],
    data: Examples,
    out: Path,
) -> None:
    _log_to(Path(tmp) / f"rank{rank}.log")
    device = devices[rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    init = f"file://{os.path.join(tmp, 'rendezvous')}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=RENDEZVOUS_TIMEOUT)
    try:
        precision = replace(work.precision, device=device)
        model = build_model(work.model, work.spec)
        freeze(model, work.model.trainable)
        if work.train.gradient_checkpointing:
            from app.task.checkpointing import enable_checkpointing

            enable_checkpointing(model)
        model.load_state_dict(state)
        model = prepare_model(model, precision)
        torch.manual_seed(work.seed)
        steps = DdpSteps(model, work.train, precision, work.seed, Task.from_config(work.task, work.spec), work)
        stats = fit(steps, data, work.scaler_state)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, asdict(stats))
        if rank == 0:
            merged = merge_stats(gathered)
            torch.save({"state": {k: v.cpu() for k, v in model.state_dict().items()}, "stats": merged}, out)
        # No rank closes its connections while a peer may still be inside a collective: a gloo
        # peer that sees its socket close mid-operation aborts its process (seen once in CI).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _log_to(path: Path) -> None:
    """Send this rank's stderr (Python's and C++'s: a gloo or NCCL abort writes there) to
    `path`, so that the parent can name why a rank died and echo the ranks' warnings."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def _last_words(tmp: Path, rank: int, lines: int = 5) -> str:
    """The last lines rank `rank` wrote to stderr, joined on one line."""
    path = tmp / f"rank{rank}.log"
    if not path.exists():
        return ""
    tail = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(tail[-lines:])


def _echo_logs(tmp: Path, world: int) -> None:
    """Hand what the ranks wrote to stderr on to this process's stderr, each line under its rank."""
    for rank in range(world):
        path = tmp / f"rank{rank}.log"
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                sys.stderr.write(f"[ddp rank {rank}] {line}\n")


def merge_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One node's TrainStats from its ranks': loss and accuracy weighted by the examples each
    rank saw, the slowest rank's wall time, the largest peak memory, rank 0's scaler."""
    first = per_rank[0]
    seen = [r["examples_seen"] for r in per_rank]
    total = sum(seen)
    wall = max(r["wall_time_s"] for r in per_rank)
    peaks = [r["peak_gpu_mem_mb"] for r in per_rank if r["peak_gpu_mem_mb"] is not None]

    def mean(key: str) -> float:
        return sum(r[key] * s for r, s in zip(per_rank, seen, strict=True)) / total if total else float("nan")

    return {
        **first,
        "loss": mean("loss"),
        "accuracy": mean("accuracy"),
        "examples_seen": total,
        "samples_per_s": total / wall if wall > 0 else 0.0,
        "wall_time_s": wall,
        "peak_gpu_mem_mb": max(peaks) if peaks else None,
        "skipped_steps": max(r["skipped_steps"] for r in per_rank),
    }

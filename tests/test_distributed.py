"""Local DDP inside one node (app/task/distributed.py): gloo ranks on the CPU train the same
model as one process with the same global batch; a rank that dies fails the task with its
name and leaves the node able to train the next task; the settings are checked."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from app.config.compose import load_config
from app.config.schema import ConfigError, DatasetConfig, ModelConfig, TaskConfig, TrainConfig
from app.protocol import ClientSettings, to_client_record
from app.task.data import DataSpec, Examples, load_splits, materialize
from app.task.distributed import Work, local_devices, merge_stats, train_on_devices
from app.task.models import build_model
from app.task.training import TrainStats, resolve_precision, train

DIGITS = DataSpec((1, 8, 8), 10)
CPU = resolve_precision("off", torch.device("cpu"))
KILL = "FEDGPU_TEST_KILL_RANK"


class DiesOnRank(nn.Module):
    """The default CNN, whose forward ends its process on the rank named in $FEDGPU_TEST_KILL_RANK."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_model(ModelConfig(), DIGITS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and os.environ.get(KILL) == str(dist.get_rank()):
            print("rank going down", file=sys.stderr, flush=True)
            os._exit(3)  # as the OOM killer or a segfault would: no exception, no clean-up
        return self.net(x)


def dies_on_rank() -> nn.Module:
    return DiesOnRank()


@pytest.fixture(scope="module")
def digits() -> Examples:
    data = materialize(load_splits(DatasetConfig(), seed=0)[0])
    return Examples(data.x[:100], data.y[:100])


def _work(cfg: TrainConfig, model: ModelConfig | None = None) -> Work:
    return Work(model or ModelConfig(), DIGITS, TaskConfig(), cfg, CPU, seed=5, scaler_state=None)


def test_two_gloo_ranks_equal_one_process_and_a_rank_that_dies_fails_only_its_task(digits, monkeypatch):
    """A rank killed mid-task fails that task by name and with its last words on stderr, with
    nothing half-trained coming back;
    the node's next task trains on two ranks and equals one process with the same global
    batch: 100 examples in batches of 30 (30, 30, 30, 10), slices of 15 or 5 per rank, their
    losses weighted so that the ranks' mean gradient is the batch's."""
    cfg = TrainConfig(epochs=2, batch_size=30, lr=0.05)
    dying = ModelConfig(name="custom", target=f"{__name__}.dies_on_rank")
    torch.manual_seed(0)
    ddp, single = dies_on_rank(), dies_on_rank()
    single.load_state_dict(ddp.state_dict())
    before = {k: v.clone() for k, v in ddp.state_dict().items()}
    two = local_devices(2, torch.device("cpu"))
    monkeypatch.setenv(KILL, "1")
    with pytest.raises(
        RuntimeError,
        match=r"local DDP training failed on rank 1 of 2 \(cpu\).*other ranks were stopped; its last output: rank going down",
    ):
        train_on_devices(ddp, digits, _work(cfg, dying), two)
    assert all(torch.equal(v, before[k]) for k, v in ddp.state_dict().items())
    monkeypatch.delenv(KILL)
    stats = train_on_devices(ddp, digits, _work(cfg, dying), two)
    expected = train(single, digits, cfg, CPU, seed=5)
    for key, value in single.state_dict().items():  # the mean gradient summed in another order
        torch.testing.assert_close(ddp.state_dict()[key], value, rtol=1e-4, atol=1e-5)
    assert (stats.steps, stats.num_examples, stats.examples_seen) == (expected.steps, 100, expected.examples_seen)
    assert stats.loss == pytest.approx(expected.loss, rel=1e-4) and stats.accuracy == pytest.approx(expected.accuracy)


def test_local_devices_resolve_to_visible_devices(monkeypatch):
    cpu = torch.device("cpu")
    assert local_devices("auto", cpu) == [cpu] and local_devices(3, cpu) == [cpu] * 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cuda = torch.device("cuda")
    assert local_devices("auto", cuda) == [torch.device("cuda", i) for i in range(4)]
    assert local_devices(2, cuda) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert local_devices([3, 1], cuda) == [torch.device("cuda", 3), torch.device("cuda", 1)]
    for bad in (5, [0, 4], [1, 1]):
        with pytest.raises(ConfigError, match="sees 4 CUDA device"):
            local_devices(bad, cuda)


def test_the_nodes_stats_merge_the_ranks_by_examples_seen():
    def rank(loss, acc, seen, wall, peak):
        return TrainStats(loss, acc, 100, 4, seen / wall, wall, peak, examples_seen=seen).__dict__

    merged = merge_stats([rank(1.0, 0.5, 60, 2.0, 10.0), rank(2.0, 1.0, 40, 4.0, None)])
    assert merged["loss"] == pytest.approx(1.4) and merged["accuracy"] == pytest.approx(0.7)
    assert merged["examples_seen"] == 100 and merged["wall_time_s"] == 4.0 and merged["samples_per_s"] == 25.0
    assert merged["peak_gpu_mem_mb"] == 10.0 and merged["steps"] == 4 and merged["num_examples"] == 100


def test_a_device_list_crosses_the_wire_as_a_list():
    cfg, _ = load_config("train.local_devices=[0,1]")
    assert ClientSettings.from_record(to_client_record(cfg)).train.local_devices == [0, 1]


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ("train.local_devices=0", "allowed: auto"),
        ("train.local_devices=[-1]", "allowed: auto"),
        ("train.local_devices=2 privacy=local", "Poisson-sampled"),
    ],
)
def test_bad_local_devices_are_refused(overrides, reason):
    with pytest.raises(ConfigError, match=f"train.local_devices.*{reason}"):
        load_config(overrides)

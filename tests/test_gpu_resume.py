"""Resuming a GPU server: FedBuff's momentum comes back on the aggregation device, and
CUDA RNG states saved on more GPUs than the resuming process sees are restored for
the devices that exist. No GPU is needed: `meta` tensors and a faked `torch.cuda`."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from app.run import checkpoint as ckpt_mod
from app.run.checkpoint import Checkpoint, capture_rng, load_checkpoint, restore_rng, save_checkpoint
from strategies.central_dp import CentralDP, DPFedBuff
from strategies.fedbuff import FedBuff
from strategies.staleness import staleness_fn

META = torch.device("meta")


def _fedbuff(**kwargs) -> FedBuff:
    defaults = {"buffer_size": 3, "max_staleness": 2, "staleness": staleness_fn("polynomial", 0.5), "server_lr": 1.0}
    return FedBuff(**{**defaults, "server_momentum": 0.9, **kwargs})


def _state(velocity: dict[str, torch.Tensor] | None) -> dict:
    return {"strategy": "FedBuff", "version": 4, "tasks_sent": 9, "discarded_total": 1, "velocity": velocity}


# --- FedBuff velocity ------------------------------------------------------------------
def test_loaded_velocity_moves_to_the_aggregation_device_and_keeps_its_dtype():
    s = _fedbuff(device=META)
    s.load_state_dict(_state({"w": torch.ones(2, 3, dtype=torch.float64), "b": torch.ones(3)}))
    assert s.version == 4 and s.tasks_sent == 9 and s.discarded_total == 1
    assert {k: (v.device, v.dtype) for k, v in s.velocity.items()} == {
        "w": (META, torch.float64),
        "b": (META, torch.float32),
    }


def test_velocity_survives_a_checkpoint_file_onto_another_device(tmp_path):
    """Saved from a CPU strategy, loaded with map_location="cpu", into a strategy aggregating on `meta`."""
    source = _fedbuff()
    source.velocity = {"w": torch.arange(6.0).reshape(2, 3)}
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, Checkpoint({"w": torch.zeros(2, 3)}, 4, source.state_dict(), capture_rng(), 1.0))
    resumed = _fedbuff(device=META)
    resumed.load_state_dict(load_checkpoint(path).strategy_state)
    assert resumed.velocity["w"].device == META and resumed.velocity["w"].shape == (2, 3)


def test_no_velocity_stays_none():
    s = _fedbuff(device=META)
    s.load_state_dict(_state(None))
    assert s.velocity is None and _fedbuff().state_dict()["velocity"] is None


@pytest.mark.parametrize("velocity", [[torch.ones(3)], {"w": 1.0}, "velocity"])
def test_a_velocity_that_is_not_a_dict_of_tensors_is_refused(velocity):
    with pytest.raises(ValueError, match="dict of tensors"):
        _fedbuff().load_state_dict(_state(velocity))


def test_saved_velocity_is_a_cpu_copy_untouched_by_later_steps():
    s = _fedbuff()
    s.velocity = {"w": torch.ones(3)}
    saved = s.state_dict()["velocity"]
    s.velocity["w"].add_(5.0)  # an in-place step after the checkpoint
    assert saved["w"].device.type == "cpu" and saved["w"] is not s.velocity["w"]
    torch.testing.assert_close(saved["w"], torch.ones(3))


def test_saved_velocity_of_a_device_strategy_is_on_the_cpu(monkeypatch):
    """A velocity on a non-CPU device (`meta` standing in for cuda:0) is saved on the CPU.

    `.to("cpu")` of a meta tensor cannot copy data, so the copy out of `meta` is faked:
    it gives zeros of the same shape and dtype on the CPU."""
    real_to = torch.Tensor.to

    def to(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.is_meta and torch.device(args[0] if args else kwargs["device"]).type == "cpu":
            return torch.zeros(self.shape, dtype=self.dtype)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    s = _fedbuff(device=META)
    s.velocity = {"w": torch.empty(2, 3, device=META, dtype=torch.float64)}
    saved = s.state_dict()["velocity"]
    assert saved["w"].device.type == "cpu" and saved["w"].dtype == torch.float64 and saved["w"].shape == (2, 3)


def test_dp_fedbuff_state_carries_the_velocity_the_same_way():
    dp = CentralDP(noise_multiplier=1.0, clip_norm=1.0, delta=1e-5, sensitivity=2.0, generator=torch.Generator())
    source = DPFedBuff(dp=dp, buffer_size=2, staleness=staleness_fn("constant"), server_momentum=0.9)
    source.velocity = {"w": torch.ones(3)}
    state = source.state_dict()
    assert state["velocity"]["w"].device.type == "cpu" and state["velocity"]["w"] is not source.velocity["w"]
    dp2 = CentralDP(noise_multiplier=1.0, clip_norm=1.0, delta=1e-5, sensitivity=2.0, generator=torch.Generator())
    resumed = DPFedBuff(dp=dp2, buffer_size=2, staleness=staleness_fn("constant"), server_momentum=0.9, device=META)
    resumed.load_state_dict(state)
    assert resumed.velocity["w"].device == META


# --- CUDA RNG states -------------------------------------------------------------------
class FakeCuda:
    """`torch.cuda` with `devices` GPUs: records the states set, and refuses a missing device as CUDA does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, devices: int) -> None:
        self.devices = devices
        self.set: list[tuple[int, torch.Tensor]] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.devices)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_rng_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.set_rng_state_all)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", self.get_rng_state_all)

    def set_rng_state(self, new_state: torch.Tensor, device: int | str | torch.device = "cuda") -> None:
        index = device if isinstance(device, int) else (torch.device(device).index or 0)
        if index >= self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.set.append((index, new_state))

    def set_rng_state_all(self, new_states: list[torch.Tensor]) -> None:
        for i, state in enumerate(new_states):
            self.set_rng_state(state, i)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [torch.full((16,), i, dtype=torch.uint8) for i in range(self.devices)]


def _rng_saved_on(monkeypatch: pytest.MonkeyPatch, gpus: int) -> dict:
    with monkeypatch.context() as m:
        FakeCuda(m, gpus)
        return capture_rng()


def test_checkpoint_from_more_gpus_restores_only_the_visible_ones(monkeypatch, tmp_path, caplog):
    rng = _rng_saved_on(monkeypatch, 4)
    assert len(rng["cuda"]) == 4
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, Checkpoint({"w": torch.zeros(1)}, 1, {}, rng, 1.0))
    cuda = FakeCuda(monkeypatch, 1)  # resumed with CUDA_VISIBLE_DEVICES=0
    with caplog.at_level(logging.INFO, logger=ckpt_mod.log.name):
        restore_rng(load_checkpoint(path).rng)
    assert [i for i, _ in cuda.set] == [0]
    torch.testing.assert_close(cuda.set[0][1], rng["cuda"][0])
    assert len([r for r in caplog.records if "CUDA RNG" in r.getMessage()]) == 1


def test_checkpoint_from_fewer_gpus_sets_those_it_has(monkeypatch):
    rng = _rng_saved_on(monkeypatch, 2)
    cuda = FakeCuda(monkeypatch, 4)
    restore_rng(rng)
    assert [i for i, _ in cuda.set] == [0, 1]


def test_cpu_checkpoint_on_a_gpu_server_logs_and_sets_nothing(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rng = capture_rng()
    assert "cuda" not in rng
    cuda = FakeCuda(monkeypatch, 2)
    with caplog.at_level(logging.INFO, logger=ckpt_mod.log.name):
        restore_rng(rng)
    assert cuda.set == [] and any("CUDA RNG" in r.getMessage() for r in caplog.records)


def test_same_gpu_count_restores_every_state_silently(monkeypatch, caplog):
    rng = _rng_saved_on(monkeypatch, 2)
    cuda = FakeCuda(monkeypatch, 2)
    with caplog.at_level(logging.INFO, logger=ckpt_mod.log.name):
        restore_rng(rng)
    assert [i for i, _ in cuda.set] == [0, 1] and not any("CUDA RNG" in r.getMessage() for r in caplog.records)


def test_gpu_checkpoint_on_a_cpu_server_does_not_raise(monkeypatch):
    rng = _rng_saved_on(monkeypatch, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: pytest.fail("no GPU to set"))
    restore_rng(rng)


def test_cpu_rng_round_trips_through_a_checkpoint_file(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    sampler = random.Random(4)  # a strategy's node sampler
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, Checkpoint({"w": torch.zeros(1)}, 1, {}, capture_rng(sampler), 1.0))

    def draw() -> tuple:
        return random.random(), np.random.normal(), torch.rand(2).tolist(), sampler.random()

    first = draw()
    restore_rng(load_checkpoint(path).rng, sampler)
    assert draw() == first


def test_a_checkpoint_from_before_the_sampler_gives_it_the_global_random_state(tmp_path):
    """Strategies drew from the global `random` before they had a sampler: its saved state is
    what they continue from."""
    random.seed(5)
    rng = capture_rng()
    expected = random.random()
    sampler = random.Random(0)
    restore_rng(rng, sampler)
    assert "sampler" not in rng and sampler.random() == expected

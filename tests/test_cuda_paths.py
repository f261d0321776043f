"""The training loop's CUDA paths, checked on the CPU with mocks of `torch.cuda` where needed:
device indices, bf16 choice, memory layout, warm-up, timing on a stream of the loop's own,
peak memory only where it is the loop's own, deterministic mode, the GradScaler kept per node.
scripts/gpu_smoke.py proves the same on a real GPU."""

from __future__ import annotations

import threading

import pytest
import torch
from flwr.app import RecordDict
from torch import nn

from app.client_app import load_scaler_state, save_scaler_state
from app.config.schema import ConfigError, ModelConfig, TrainConfig
from app.privacy.dp_sgd import DpSgdSteps
from app.task import training
from app.task.data import DataSpec, Examples
from app.task.metrics import Task
from app.task.models import GlobalAvgPool, build_model
from app.task.training import (
    GPU_TENANTS,
    LoopClock,
    Precision,
    Steps,
    batch_indices,
    fit,
    resolve_device,
    resolve_precision,
    train,
    use_channels_last,
    warm_up,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda:0")
SPEC = DataSpec((1, 8, 8), 10)


def data(n: int = 40, seed: int = 0) -> Examples:
    g = torch.Generator().manual_seed(seed)
    return Examples(torch.randint(0, 256, (n, 1, 8, 8), generator=g, dtype=torch.uint8), torch.arange(n) % 10)


def fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int = 1, capability: tuple[int, int] = (8, 0)) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_cuda_index_beyond_the_visible_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, count=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert resolve_device("cuda:0") == CUDA and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"cuda:1.*sees 1 CUDA device.*CUDA_VISIBLE_DEVICES='3'"):
        resolve_device("cuda:1")


def test_auto_amp_picks_bf16_by_the_chosen_devices_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    """`is_bf16_supported()` says yes on Turing (emulated bf16): it must not decide."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (7, 5))
    assert resolve_precision("auto", torch.device("cuda:1")).amp == "fp16"
    assert asked == [torch.device("cuda:1")]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert resolve_precision("auto", CUDA).amp == "bf16"


def test_channels_last_only_for_models_without_groupnorm_on_cuda() -> None:
    cnn = build_model(ModelConfig(), SPEC)
    resnet = build_model(ModelConfig(name="resnet18", width=64), DataSpec((3, 32, 32), 10))
    assert not use_channels_last(cnn, "auto", CUDA)  # GroupNorm: CUDA kernels go back to NCHW
    assert use_channels_last(resnet, "auto", CUDA)
    assert not use_channels_last(resnet, "auto", CPU)
    assert use_channels_last(cnn, "on", CPU) and not use_channels_last(resnet, "off", CUDA)
    with pytest.raises(ConfigError, match="train.channels_last"):
        use_channels_last(cnn, "sometimes", CUDA)


def test_batch_sizes_are_exactly_the_sizes_the_loop_draws() -> None:
    cfg = TrainConfig(batch_size=16, epochs=1)
    for n in (1, 2, 15, 16, 17, 18, 40, 64):
        steps = Steps(nn.Linear(1, 1), cfg, Precision(CPU, "off"), torch.Generator().manual_seed(0))
        drawn = {len(b) for b in batch_indices(n, cfg.batch_size, torch.Generator().manual_seed(0), CPU)}
        assert set(steps.batch_sizes(n)) == drawn, n


class Bn(nn.Module):
    """BatchNorm (running statistics change in train mode) and dropout (draws from the RNG)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.LazyLinear(10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_warm_up_leaves_buffers_gradients_and_rng_as_they_were() -> None:
    model = Bn()
    model(torch.zeros(2, 1, 8, 8))  # materialise the lazy layer
    steps = Steps(model, TrainConfig(batch_size=16), Precision(CPU, "off"), torch.Generator().manual_seed(0))
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    calls = []
    model.register_forward_hook(lambda m, i, o: calls.append(len(i[0])))
    warm_up(steps, data(40))
    assert calls == [16, 8]  # each batch size once
    assert all(torch.equal(v, dict(model.named_buffers())[k]) for k, v in buffers.items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_warm_up_and_fit_use_the_tasks_loss() -> None:
    """The warm-up's backward passes use the same loss as the loop (a multi-label BCE model would
    fail, or warm up other kernels, with cross-entropy)."""
    seen: list[str] = []

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen.append("loss")
        return nn.functional.cross_entropy(logits, targets)

    task = Task(loss, [("accuracy", lambda logits, targets: 0.0)])
    model = build_model(ModelConfig(width=4), SPEC)
    steps = Steps(model, TrainConfig(batch_size=16, epochs=1), Precision(CPU, "off"), torch.Generator(), task)
    warm_up(steps, data(40))
    assert seen == ["loss", "loss"]  # batch sizes 16 and 8
    fit(steps, data(40))
    assert len(seen) == 2 + 3


def test_dp_sgd_neither_warms_up_nor_autotunes() -> None:
    """Poisson batch sizes vary every step: cuDNN would autotune each new size in the timer."""
    assert DpSgdSteps.fixed_shapes is False and DpSgdSteps.batch_sizes(None, 100) == []  # type: ignore[arg-type]


def flags_during_fit(cfg: TrainConfig) -> dict[str, bool]:
    model = build_model(ModelConfig(width=4), SPEC)
    seen: dict[str, bool] = {}

    def hook(*_: object) -> None:
        seen.update(
            benchmark=torch.backends.cudnn.benchmark,
            cudnn_deterministic=torch.backends.cudnn.deterministic,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )

    model.register_forward_hook(hook)
    train(model, data(), cfg, Precision(CPU, "off"), seed=0)
    return seen


def test_deterministic_mode_sets_the_kernel_flags_for_the_loop_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled())
    assert flags_during_fit(TrainConfig(epochs=1, deterministic=True)) == {
        "benchmark": False,
        "cudnn_deterministic": True,
        "deterministic": True,
    }
    import os

    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert flags_during_fit(TrainConfig(epochs=1, cudnn_benchmark=True))["benchmark"] is True
    assert flags_during_fit(TrainConfig(epochs=1))["benchmark"] is False  # off by default
    assert (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled()) == before


def test_models_pool_deterministically_and_like_adaptive_pooling() -> None:
    for model in (
        build_model(ModelConfig(), SPEC),
        build_model(ModelConfig(name="resnet18"), DataSpec((3, 32, 32), 10)),
    ):
        assert not any(isinstance(m, nn.AdaptiveAvgPool2d) for m in model.modules())
        assert any(isinstance(m, GlobalAvgPool) for m in model.modules())
    x = torch.randn(3, 5, 7, 6)
    torch.testing.assert_close(GlobalAvgPool()(x), nn.AdaptiveAvgPool2d(1)(x))


def test_deterministic_training_is_bit_identical_twice() -> None:
    states = []
    for _ in range(2):
        torch.manual_seed(0)
        model = build_model(ModelConfig(width=4), SPEC)
        train(model, data(), TrainConfig(epochs=1, deterministic=True), Precision(CPU, "off"), seed=3)
        states.append(model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_fp16_skipped_steps_are_counted_and_the_scaler_state_carries_over() -> None:
    """fp16 autocast also runs on the CPU, so the GradScaler logic is checked here: a scale
    so large that every gradient overflows makes steps be skipped; the next round starts
    from the scale the last one ended with instead of from 2**16 again."""
    model = build_model(ModelConfig(width=4), SPEC)
    cfg, fp16 = TrainConfig(epochs=1, batch_size=8), Precision(CPU, "fp16")
    huge = {
        "scale": 2.0**60,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 0,
    }
    first = train(model, data(), cfg, fp16, seed=0, scaler_state=huge)
    assert first.steps == 5 and 1 <= first.skipped_steps <= 5
    assert first.scaler_state["scale"] == 2.0**60 * 0.5**first.skipped_steps
    second = train(model, data(), cfg, fp16, seed=1, scaler_state=first.scaler_state)
    assert second.scaler_state["scale"] <= first.scaler_state["scale"]
    state = RecordDict()
    assert load_scaler_state(state) is None
    save_scaler_state(state, second.scaler_state)
    assert load_scaler_state(state) == second.scaler_state
    off = train(model, data(), cfg, Precision(CPU, "off"), seed=0)
    assert off.skipped_steps == 0 and off.scaler_state == {}


def test_tenants_say_whether_a_loop_had_the_gpu_to_itself() -> None:
    with GPU_TENANTS.hold() as alone:
        pass
    assert alone == [True]
    entered, release = threading.Event(), threading.Event()
    flags = {}

    def other() -> None:
        with GPU_TENANTS.hold() as flag:
            entered.set()
            release.wait(5)
        flags["other"] = flag[0]

    with GPU_TENANTS.hold() as mine:
        thread = threading.Thread(target=other)
        thread.start()
        entered.wait(5)
        release.set()
        thread.join(5)
    assert mine == [False] and flags == {"other": False}  # both overlapped


class FakeEvent:
    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self, stream: object) -> None:
        FakeEvent.clock += 1.5
        self.t = FakeEvent.clock

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1000.0


class FakeStream:
    def __init__(self, device: object = None) -> None:
        self.waited, self.synced = [], 0

    def wait_stream(self, other: object) -> None:
        self.waited.append(other)

    def synchronize(self) -> None:
        self.synced += 1


def fake_streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    calls: dict[str, list] = {"reset": [], "stream": []}
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "default")

    class StreamContext:
        def __init__(self, stream: object) -> None:
            calls["stream"].append(stream)

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls["reset"].append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 512 * 2**20)

    def device_wide(*_: object) -> None:
        raise AssertionError("torch.cuda.synchronize waits for every thread's work on the GPU")

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    return calls


def test_loop_clock_times_its_own_stream_with_events(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_streams(monkeypatch)
    with LoopClock(CUDA) as clock:
        clock.start()
        wall = clock.stop()
    assert wall == pytest.approx(1.5)  # one event step of the fake clock
    (stream,) = calls["stream"]
    assert isinstance(stream, FakeStream) and stream.waited == ["default"] and stream.synced == 1
    assert calls["reset"] == [CUDA] and clock.peak_mb == 512.0


def test_loop_clock_reports_no_peak_when_another_loop_shared_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_streams(monkeypatch)
    with GPU_TENANTS.hold():  # e.g. another node's thread, or the server's evaluation
        with LoopClock(CUDA) as clock:
            clock.start()
            clock.stop()
    assert clock.peak_mb is None and calls["reset"] == []  # never resets a neighbour's counter
    with LoopClock(CUDA) as first:
        with LoopClock(CUDA) as second:  # a neighbour starts while `first` runs
            pass
    assert first.peak_mb is None and second.peak_mb is None


def test_cpu_fit_reports_wall_time_and_no_gpu_peak() -> None:
    stats = fit(
        Steps(build_model(ModelConfig(width=4), SPEC), TrainConfig(epochs=1), Precision(CPU, "off"), torch.Generator()),
        data(),
    )
    assert stats.wall_time_s > 0 and stats.peak_gpu_mem_mb is None and stats.steps == 2


def test_fit_warms_up_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(training, "warm_up", lambda steps, d: calls.append(len(d)))
    train(build_model(ModelConfig(width=4), SPEC), data(), TrainConfig(epochs=1), Precision(CPU, "off"), seed=0)
    assert calls == []

"""Shared GPUs on the CPU: the memory cap's arithmetic, automatic batch sizes against a fake
memory model, and recovery from injected out-of-memory errors (app/task/gpu_memory.py,
app/task/batch_size.py, the micro-batches of app/task/training.py)."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
import torch
from flwr.app import RecordDict

import app.task.batch_size as batch_size_module
import app.task.gpu_memory as gpu_memory
from app.config.compose import load_config
from app.config.schema import ConfigError, DatasetConfig, ModelConfig, TrainConfig
from app.task.batch_size import largest_fitting, resolve_batch_size
from app.task.data import DataSpec, Examples, load_splits, materialize
from app.task.gpu_memory import MemoryCap, cap_memory, memory_share
from app.task.models import build_model
from app.task.training import Precision, Steps, evaluate, resolve_precision, smaller_micro_batch, train, warm_up

DIGITS = DataSpec((1, 8, 8), 10)
CPU = resolve_precision("off", torch.device("cpu"))
GiB, MiB = 2**30, 2**20


@pytest.fixture(scope="module")
def digits() -> Examples:
    data = materialize(load_splits(DatasetConfig(), seed=0)[0])
    return Examples(data.x[:96], data.y[:96])


# --- the largest batch that fits ---------------------------------------------------------


@pytest.mark.parametrize(("fixed", "per_example", "cap", "maximum"), [(100, 3, 1000, 1024), (0, 1, 10**6, 700)])
def test_the_search_finds_the_largest_fitting_batch_in_logarithmic_probes(fixed, per_example, cap, maximum):
    calls = []

    def fits(size: int) -> bool:  # a fake memory model: a fixed part and a part per example
        calls.append(size)
        return fixed + per_example * size <= cap

    expected = min(maximum, (cap - fixed) // per_example)
    assert largest_fitting(fits, maximum) == expected
    assert fits(expected) and (expected == maximum or not fits(expected + 1))
    assert len(calls) - 2 <= 2 * math.ceil(math.log2(maximum)) + 1


def test_the_search_says_0_when_not_even_one_example_fits():
    assert largest_fitting(lambda size: False, 512) == 0


def _steps_on(device: str):
    precision = Precision(torch.device(device), "off")
    model = build_model(ModelConfig(), DIGITS)
    return lambda cfg: Steps(model, cfg, precision, torch.Generator())


def test_auto_is_probed_once_per_model_shape_and_limit_and_kept_in_node_state(monkeypatch, digits):
    probed = []

    def fake_probe(steps, data, limit):
        probed.append((tuple(data.x.shape[1:]), limit))
        return limit // MiB  # one example per MiB of the limit

    monkeypatch.setattr(batch_size_module, "probe", fake_probe)
    state, cfg = RecordDict(), TrainConfig(batch_size="auto")
    cap = MemoryCap(share=0.25, limit_bytes=64 * MiB)
    resolve = lambda data, cap: resolve_batch_size(state, _steps_on("cuda"), cfg, ModelConfig(), data, cap)  # noqa: E731

    assert resolve(digits, cap) == 64 and resolve(digits, cap) == 64
    assert len(probed) == 1  # the second task read it from the node's state
    assert resolve(digits, MemoryCap(0.5, 80 * MiB)) == 80 and len(probed) == 2  # a new limit: probed again
    wide = Examples(torch.zeros(96, 1, 16, 16, dtype=torch.uint8), digits.y)
    assert resolve(wide, cap) == 64 and probed[-1][0] == (1, 16, 16)  # a new input shape: probed again
    assert resolve(Examples(digits.x[:40], digits.y[:40]), cap) == 40  # never more than the node's examples
    assert len(probed) == 3


def test_auto_on_a_cpu_is_the_configured_default_and_a_number_is_kept(monkeypatch, digits):
    monkeypatch.setattr(batch_size_module, "probe", lambda *a: pytest.fail("no probe on a CPU"))
    state = RecordDict()
    for size, expected in [("auto", TrainConfig().batch_size), (7, 7)]:
        cfg = TrainConfig(batch_size=size)
        assert resolve_batch_size(state, _steps_on("cpu"), cfg, ModelConfig(), digits, None) == expected


def test_auto_that_fits_nothing_is_a_clear_error(monkeypatch, digits):
    monkeypatch.setattr(batch_size_module, "probe", lambda *a: 0)
    cap = MemoryCap(share=0.01, limit_bytes=8 * MiB)
    with pytest.raises(RuntimeError, match="not even one example fits in 8 MiB"):
        resolve_batch_size(RecordDict(), _steps_on("cuda"), TrainConfig(batch_size="auto"), ModelConfig(), digits, cap)


# --- out-of-memory errors: micro-batches with the same effective batch -------------------------


class OomAbove(torch.nn.Module):
    """The model, raising CUDA's out-of-memory error for batches above `limit` examples."""

    def __init__(self, model: torch.nn.Module, limit: int) -> None:
        super().__init__()
        self.model, self.limit, self.raised = model, limit, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
        return self.model(x)


def _trained(digits, limit: int | None, batch: int = 32):
    torch.manual_seed(0)
    model = build_model(ModelConfig(), DIGITS)  # GroupNorm: per example, so micro-batches change nothing
    net = model if limit is None else OomAbove(model, limit)
    stats = train(net, digits, TrainConfig(epochs=2, batch_size=batch, lr=0.05), CPU, seed=0)
    return model.state_dict(), stats, net


def test_an_oom_in_the_warm_up_is_left_to_the_loop_and_other_errors_are_not(digits):
    """fit warms up on CUDA before its clock: an out-of-memory error there must not end the
    task (it did on an H200 under a 1.5 GiB cap) but leave the batch to the loop's micro-batches."""
    net = OomAbove(build_model(ModelConfig(), DIGITS), limit=10)
    steps = Steps(net, TrainConfig(batch_size=32), CPU, torch.Generator().manual_seed(0))
    warm_up(steps, digits)
    assert net.raised == 1 and all(p.grad is None for p in net.parameters())  # stopped at the first size
    broken = Steps(
        OomAbove(build_model(ModelConfig(), DIGITS), limit=-1), TrainConfig(batch_size=32), CPU, torch.Generator()
    )
    broken.net.forward = lambda x: (_ for _ in ()).throw(RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        warm_up(broken, digits)


def test_an_oom_halves_the_micro_batch_and_the_model_equals_the_run_without(digits):
    plain, plain_stats, _ = _trained(digits, None)
    recovered, stats, net = _trained(digits, limit=10)
    assert stats.oom_retries == 2 and net.raised == 2  # 32 -> 16 -> 8, once; later batches start at 8
    assert stats.micro_batch_size == 8 and plain_stats.oom_retries == 0 and plain_stats.micro_batch_size == 32
    assert stats.steps == plain_stats.steps and stats.num_examples == plain_stats.num_examples
    for key, value in plain.items():  # float sums in another order: equal to float error
        torch.testing.assert_close(recovered[key], value, rtol=1e-4, atol=1e-5)
    assert stats.loss == pytest.approx(plain_stats.loss, rel=1e-4)
    assert stats.accuracy == plain_stats.accuracy


def test_an_oom_with_one_example_per_micro_batch_is_raised_with_the_reason(digits):
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _trained(digits, limit=0)
    assert "one example per micro-batch" in "".join(caught.value.__notes__)


def test_other_errors_and_unsplittable_steps_are_not_retried():
    steps = Steps(torch.nn.Linear(2, 2), TrainConfig(), CPU, torch.Generator())
    with pytest.raises(ValueError, match="not memory"):
        smaller_micro_batch(steps, 32, 32, ValueError("not memory"))
    from app.privacy.dp_sgd import DpSgdSteps
    from app.task.distributed import DdpSteps

    assert "DP-SGD" in DpSgdSteps.unsplittable and "DDP" in DdpSteps.unsplittable and Steps.unsplittable is None
    steps.unsplittable = "DP-SGD cannot split a batch"  # as DP-SGD's and local DDP's steps
    with pytest.raises(torch.OutOfMemoryError) as caught:
        smaller_micro_batch(steps, 32, 32, torch.OutOfMemoryError("CUDA out of memory"))
    assert "DP-SGD cannot split a batch: lower train.batch_size" in "".join(caught.value.__notes__)
    assert (
        smaller_micro_batch(
            Steps(torch.nn.Linear(2, 2), TrainConfig(), CPU, torch.Generator()),
            32,
            20,
            RuntimeError("CUDA error: out of memory"),
        )
        == 10
    )


def test_evaluation_halves_its_batch_on_oom_and_gets_the_same_numbers(digits):
    torch.manual_seed(0)
    model = build_model(ModelConfig(), DIGITS)
    expected = evaluate(model, digits, CPU)
    loss, metrics = evaluate(OomAbove(model, limit=30), digits, CPU, batch_size=96)
    # Compared part by part: pytest.approx takes no nested structures since pytest 9.1.
    assert loss == pytest.approx(expected[0]) and metrics == pytest.approx(expected[1])
    assert metrics.keys() == expected[1].keys()


# --- the cap on a client's share of a GPU -------------------------------------------------------


class FakeCuda:
    """torch.cuda as a 24 GiB device whose process holds `used` bytes (NVML) of which PyTorch
    reserved `reserved`; records the cap set, and refuses a device without an index as torch
    does (a bare "cuda" failed on an H200 before the cap resolved the current device)."""

    def __init__(self, monkeypatch, used: int | None, reserved: int = 100 * MiB) -> None:
        self.fractions: list[float] = []
        self.devices: list[int] = []
        props = SimpleNamespace(total_memory=24 * GiB)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(gpu_memory, "process_gpu_memory", lambda device: used)

    def set_fraction(self, fraction: float, device) -> None:
        self.devices.append(torch._utils._get_device_index(device))  # raises on a bare "cuda", as torch does
        self.fractions.append(fraction)


def test_the_cap_is_the_share_less_what_the_process_holds_outside_pytorch(monkeypatch):
    cuda = FakeCuda(monkeypatch, used=612 * MiB)  # 512 MiB of CUDA context beyond the 100 reserved
    cap = cap_memory(torch.device("cuda"), 0.25)
    assert cuda.fractions == [pytest.approx(0.25 - 512 * MiB / (24 * GiB))] and cuda.devices == [0]
    assert cap.limit_bytes == int(cuda.fractions[0] * 24 * GiB) and cap.limit_bytes == 6 * GiB - 512 * MiB
    assert cap.metrics() == {"gpu-mem-share": 0.25, "gpu-mem-cap-mb": 6 * 1024 - 512}


def test_without_nvml_the_cap_assumes_a_default_context(monkeypatch):
    cuda = FakeCuda(monkeypatch, used=None)
    cap_memory(torch.device("cuda"), 0.5)
    assert cuda.fractions == [pytest.approx(0.5 - gpu_memory.DEFAULT_CONTEXT_BYTES / (24 * GiB))]


def test_a_share_smaller_than_the_context_is_refused_and_no_share_means_no_cap(monkeypatch):
    cuda = FakeCuda(monkeypatch, used=None)
    with pytest.raises(ConfigError, match="put fewer clients on each GPU"):
        cap_memory(torch.device("cuda"), 0.01)  # 245 MiB of 24 GiB < 512 MiB of context
    assert cap_memory(torch.device("cuda"), None) is None and cap_memory(torch.device("cpu"), 0.5) is None
    assert cuda.fractions == []


def test_the_share_is_the_configured_fraction_else_rays_fractional_reservation(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert memory_share(0.0) is None and memory_share(0.3) == 0.3
    assigned = {"CPU": 1.0, "GPU": 0.25}
    context = SimpleNamespace(get_assigned_resources=lambda: assigned)
    ray = SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)
    monkeypatch.setitem(sys.modules, "ray", ray)
    assert memory_share(0.0) == 0.25 and memory_share(0.5) == 0.5
    assigned["GPU"] = 1.0  # a whole GPU: nothing to share
    assert memory_share(0.0) is None


def test_the_gpu_cache_is_emptied_only_where_cuda_was_used(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    gpu_memory.release()
    gpu_memory.release(torch.device("cpu"))
    assert emptied == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    gpu_memory.release()
    assert emptied == [1]


# --- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key", "reason"),
    [
        ("train.batch_size=0", "train.batch_size", "integer >= 1 or auto"),
        ("train.batch_size=big", "train.batch_size", "integer >= 1 or auto"),
        ("train.batch_size=auto privacy=local", "train.batch_size", "sampling rate"),
        ("train.max_batch_size=0", "train.max_batch_size", ">= 1"),
        ("train.gpu_memory_fraction=1.5", "train.gpu_memory_fraction", r"\[0, 1\]"),
    ],
)
def test_bad_memory_settings_are_refused_with_the_key(overrides, key, reason):
    with pytest.raises(ConfigError, match=f"{key}.*{reason}"):
        load_config(overrides)


def test_auto_and_a_fraction_are_valid():
    cfg, _ = load_config("train.batch_size=auto train.gpu_memory_fraction=0.25 train.max_batch_size=256")
    assert cfg.train.batch_size == "auto" and cfg.train.gpu_memory_fraction == 0.25


def test_a_train_reply_reports_the_batch_size_it_used_and_its_oom_retries():
    from flwr.app import ArrayRecord, ConfigRecord, Message

    from app.client_app import app as client_app
    from app.protocol import to_client_record
    from app.task.data import spec_to_record
    from tests.helpers import context_for

    cfg, _ = load_config("train.epochs=1 train.batch_size=auto")
    global_state = build_model(cfg.model, DIGITS).state_dict()
    config = ConfigRecord({**to_client_record(cfg), **spec_to_record(DIGITS), "server-round": 1})
    ins = Message(
        RecordDict({"arrays": ArrayRecord(global_state), "config": config}), dst_node_id=1, message_type="train"
    )
    metrics = client_app(ins, context_for(0, 5)).content["metrics"]
    assert metrics["batch-size"] == 32 and metrics["oom-retries"] == 0  # auto on a CPU: the default
    assert "micro-batch-size" not in metrics and "gpu-mem-share" not in metrics  # no OOM, no GPU share

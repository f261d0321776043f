"""Client training: AMP modes on the CPU, device choice, models, telemetry without a GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from app.config.schema import ConfigError, DatasetConfig, ModelConfig, TrainConfig
from app.task.data import DataSpec, load_splits, materialize
from app.task.models import build_model
from app.task.telemetry import GpuTelemetry
from app.task.training import evaluate, prepare_model, resolve_device, resolve_precision, train

DIGITS = DataSpec(channels=1, height=8, width=8, num_classes=10)


@pytest.fixture(scope="module")
def digits():
    train_source, _ = load_splits(DatasetConfig(), seed=0)
    data = materialize(train_source)
    return type(data)(data.x[:256], data.y[:256])


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_training_on_cpu_lowers_the_loss(digits, amp):
    torch.manual_seed(0)
    precision = resolve_precision(amp, torch.device("cpu"))
    assert precision.amp == amp
    model = prepare_model(build_model(ModelConfig(), DIGITS), precision)
    before, _ = evaluate(model, digits, precision)
    stats = train(model, digits, TrainConfig(epochs=8, batch_size=32, lr=0.05), precision, seed=0)
    after, accuracy = evaluate(model, digits, precision)
    assert after < 0.7 * before
    assert stats.num_examples == 256 and stats.steps == 8 * 8 and stats.samples_per_s > 0
    assert stats.peak_gpu_mem_mb is None


def test_fp16_without_cuda_maps_to_bf16_with_a_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="flwr.fedgpu.app.task.training"):
        precision = resolve_precision("fp16", torch.device("cpu"))
    assert precision.amp == "bf16" and precision.dtype == torch.bfloat16
    assert "train.amp=fp16 needs CUDA" in caplog.text


def test_auto_precision_is_fp32_on_cpu():
    assert resolve_precision("auto", torch.device("cpu")).amp == "off"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_device_without_cuda_is_refused():
    assert resolve_device("auto").type == "cpu"
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        resolve_device("cuda:0")


def test_training_is_reproducible_for_a_seed(digits):
    def run() -> torch.Tensor:
        torch.manual_seed(1)
        precision = resolve_precision("off", torch.device("cpu"))
        model = prepare_model(build_model(ModelConfig(), DIGITS), precision)
        train(model, digits, TrainConfig(epochs=1), precision, seed=5)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    torch.testing.assert_close(run(), run())


def test_grad_clip_and_adam_paths_train(digits):
    precision = resolve_precision("off", torch.device("cpu"))
    model = prepare_model(build_model(ModelConfig(), DIGITS), precision)
    stats = train(model, digits, TrainConfig(epochs=1, optimizer="adam", lr=1e-3, grad_clip=1.0), precision, seed=0)
    assert stats.loss == stats.loss  # finite, not NaN


@pytest.mark.parametrize(
    ("model_name", "spec"),
    [
        ("cnn", DIGITS),
        ("cnn", DataSpec(1, 28, 28, 10)),
        ("resnet18", DataSpec(3, 32, 32, 10)),
        ("resnet18", DataSpec(1, 28, 28, 7)),
    ],
)
def test_models_fit_the_data_spec(model_name, spec):
    model = build_model(ModelConfig(name=model_name, width=64 if model_name == "resnet18" else 32), spec).eval()
    out = model(torch.rand(2, spec.channels, spec.height, spec.width))
    assert out.shape == (2, spec.num_classes)


def test_resnet18_is_adapted_for_small_images():
    model = build_model(ModelConfig(name="resnet18", width=64), DataSpec(3, 32, 32, 10))
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert 11_000_000 < sum(p.numel() for p in model.parameters()) < 11_300_000


def test_telemetry_is_absent_without_a_gpu():
    with GpuTelemetry(torch.device("cpu")) as telemetry:
        pass
    assert telemetry.metrics() == {"gpu-telemetry": 0.0}


def test_telemetry_never_crashes_when_nvml_fails(monkeypatch):
    def broken(_device):
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr("app.task.telemetry._nvml_handle", broken)
    with GpuTelemetry(torch.device("cuda")) as telemetry:
        pass
    assert telemetry.metrics() == {"gpu-telemetry": 0.0}


def test_telemetry_summarises_samples(monkeypatch):
    """With a fake NVML, the sampler thread runs and the summary is right."""
    import types

    readings = iter(range(1000))

    def fake_sample(self):
        v = float(next(readings))
        self.samples.util_pct.append(v)
        self.samples.mem_used_mb.append(100 + v)
        self.samples.temp_c.append(50 + v)
        self.samples.power_w.append(200.0)

    monkeypatch.setattr("app.task.telemetry._nvml_handle", lambda _d: types.SimpleNamespace())
    monkeypatch.setattr(GpuTelemetry, "_sample", fake_sample)
    with GpuTelemetry(torch.device("cuda"), interval_s=0.01) as telemetry:
        import time

        time.sleep(0.1)
    m = telemetry.metrics()
    n = len(telemetry.samples.util_pct)
    assert n >= 3 and m["gpu-telemetry"] == 1.0
    assert m["gpu-util-max-pct"] == n - 1 and m["gpu-util-mean-pct"] == pytest.approx((n - 1) / 2)
    assert m["gpu-mem-used-max-mb"] == 100 + n - 1 and m["gpu-power-mean-w"] == 200.0

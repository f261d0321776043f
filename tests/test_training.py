"""Client training: AMP modes on the CPU, device choice, models (GPU telemetry: tests/test_telemetry.py)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config.registry import Registry
from app.config.schema import (
    AMP_MODES,
    DATASETS,
    MODELS,
    OPTIMIZERS,
    PARTITIONS,
    ConfigError,
    DatasetConfig,
    ModelConfig,
    PartitionConfig,
    TrainConfig,
)
from app.task.data import DataSpec, load_splits, materialize, partition_indices
from app.task.models import build_model
from app.task.training import evaluate, make_optimizer, prepare_model, resolve_device, resolve_precision, train

ROOT = Path(__file__).resolve().parents[1]

DIGITS = DataSpec((1, 8, 8), 10)


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
    after, metrics = evaluate(model, digits, precision)
    assert after < 0.7 * before and list(metrics) == ["accuracy"] and 0.5 < metrics["accuracy"] <= 1.0
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
        ("cnn", DataSpec((1, 28, 28), 10)),
        ("resnet18", DataSpec((3, 32, 32), 10)),
        ("resnet18", DataSpec((1, 28, 28), 7)),
    ],
)
def test_models_fit_the_data_spec(model_name, spec):
    model = build_model(ModelConfig(name=model_name, width=64 if model_name == "resnet18" else 32), spec).eval()
    out = model(torch.rand(2, *spec.input_shape))
    assert out.shape == (2, spec.num_classes)


def test_resnet18_is_adapted_for_small_images():
    model = build_model(ModelConfig(name="resnet18", width=64), DataSpec((3, 32, 32), 10))
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert 11_000_000 < sum(p.numel() for p in model.parameters()) < 11_300_000


def test_there_is_one_training_loop():
    """Every backward pass in the app and the strategies is `app.task.training.forward_backward`:
    the loop `fit` (through `accumulate`), its untimed CUDA warm-up and the batch-size probe
    call it, and DP-SGD plugs its parts into that loop (app.privacy.dp_sgd.DpSgdSteps) rather
    than copying it."""
    found = []
    for path in sorted([*ROOT.glob("app/**/*.py"), *ROOT.glob("strategies/**/*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        for func in ast.walk(tree):
            if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(func):
                    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "backward":
                        found.append((path.relative_to(ROOT).as_posix(), func.name))
    assert found == [("app/task/training.py", "forward_backward")], found


@pytest.mark.parametrize(
    ("key", "act", "allowed"),
    [
        ("train.optimizer", lambda: make_optimizer(torch.nn.Linear(2, 2), TrainConfig(optimizer="lion")), OPTIMIZERS),
        ("train.amp", lambda: resolve_precision("fp8", torch.device("cpu")), AMP_MODES),
        ("model.name", lambda: build_model(ModelConfig(name="vit"), DIGITS), MODELS),
        ("dataset.name", lambda: load_splits(DatasetConfig(name="svhn"), 0), DATASETS),
        ("partition.name", lambda: partition_indices(np.zeros(8), 2, 0, PartitionConfig(name="shards"), 0), PARTITIONS),
    ],
)
def test_code_acting_on_a_name_refuses_others_with_the_schemas_list(key, act, allowed):
    """The ClientApp gets its settings from a message that validation never saw."""
    with pytest.raises(ConfigError, match=f"^{key}='[a-z0-9]+' is invalid: allowed: {', '.join(allowed)}$"):
        act()


def test_a_registry_must_implement_exactly_the_schemas_names():
    with pytest.raises(TypeError, match=r"train.optimizer: the schema allows \['adam', 'sgd'\], the implementations"):
        Registry("train.optimizer", ("sgd", "adam"), {"sgd": 1})
    with pytest.raises(TypeError, match="the implementations are \\['lion', 'sgd'\\]"):
        Registry("train.optimizer", ("sgd",), {"sgd": 1, "lion": 2})
    built = [type(make_optimizer(torch.nn.Linear(2, 2), TrainConfig(optimizer=o))).__name__ for o in OPTIMIZERS]
    assert [name.lower() for name in built] == list(OPTIMIZERS)  # each name builds its own optimizer

"""Memory and schedule on the node (issue 35, item 4): gradient checkpointing changes no
gradient, accumulated batches equal one large batch, max_steps counts optimizer steps, and the
learning-rate schedule is the closed form."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from app.config.schema import ModelConfig, TrainConfig
from app.task.checkpointing import enable_checkpointing
from app.task.data import DataSpec, Examples
from app.task.models import build_model
from app.task.training import resolve_precision, round_lr, train

CPU = resolve_precision("off", torch.device("cpu"))


def _images(n: int = 24) -> tuple[DataSpec, Examples]:
    g = torch.Generator().manual_seed(0)
    return DataSpec((1, 8, 8), 4), Examples(
        torch.randint(0, 256, (n, 1, 8, 8), generator=g, dtype=torch.uint8), torch.arange(n) % 4
    )


def _tokens() -> tuple[DataSpec, Examples]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 259, (12, 16), generator=g)
    return DataSpec((16,), 259, causal_lm=True), Examples(x, torch.roll(x, -1, 1))


TINY = {
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    ("model_cfg", "data"),
    [
        (ModelConfig(name="cnn", width=8), _images),
        (ModelConfig(name="torchvision", arch="resnet18"), _images),
        (ModelConfig(name="hf", config=TINY, peft="lora"), _tokens),
    ],
    ids=["cnn", "resnet18", "hf-lora"],
)
def test_gradient_checkpointing_trains_the_same_model(model_cfg: ModelConfig, data) -> None:  # noqa: ANN001
    from app.config.schema import TaskConfig
    from app.task.metrics import Task

    spec, examples = data()
    task = Task.from_config(
        TaskConfig(type="causal_lm", metrics=["token_accuracy"]) if spec.causal_lm else TaskConfig(), spec
    )
    torch.manual_seed(0)
    plain = build_model(model_cfg, spec)
    checked = copy.deepcopy(plain)
    what = enable_checkpointing(checked)
    assert what
    cfg = TrainConfig(epochs=1, batch_size=6, lr=0.05, momentum=0.0)
    a = train(plain, examples, cfg, CPU, seed=1, task=task)
    b = train(checked, examples, cfg, CPU, seed=1, task=task)
    assert a.loss == pytest.approx(b.loss, rel=1e-5)
    # Parameters only: a BatchNorm's running statistics are updated again when its block is
    # recomputed (a property of torch.utils.checkpoint, documented in docs/configuration.md).
    for (name, p), q in zip(plain.named_parameters(), checked.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_accumulated_batches_equal_one_large_batch() -> None:
    spec, data = _images(32)
    torch.manual_seed(0)
    one = build_model(ModelConfig(name="cnn", width=8), spec)
    accumulated = copy.deepcopy(one)
    cfg = TrainConfig(epochs=2, batch_size=8, lr=0.1, momentum=0.0)
    big = train(one, data, cfg, CPU, seed=3)
    small = train(accumulated, data, replace(cfg, batch_size=4, grad_accum_steps=2), CPU, seed=3)
    assert (big.steps, small.steps) == (8, 16)  # passes: two per optimizer step when accumulating
    for p, q in zip(one.parameters(), accumulated.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_max_steps_replaces_epochs_and_counts_optimizer_steps() -> None:
    spec, data = _images(24)
    model = build_model(ModelConfig(name="cnn", width=8), spec)
    stats = train(model, data, TrainConfig(epochs=1, batch_size=8, max_steps=7, grad_accum_steps=2), CPU, seed=0)
    assert stats.steps == 14 and stats.examples_seen == 14 * 8  # past one epoch (3 batches) into five more


def test_cosine_schedule_with_warm_up_is_the_closed_form() -> None:
    cfg = TrainConfig(lr=0.1, lr_schedule="cosine", warmup_rounds=2, min_lr_ratio=0.1)
    lrs = [round_lr(cfg, r, 10) for r in range(1, 11)]
    assert lrs[:2] == pytest.approx([0.05, 0.1])
    for r in range(3, 11):
        expected = 0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * (r - 3) / 7))
        assert lrs[r - 1] == pytest.approx(expected)
    assert lrs[-1] == pytest.approx(0.01) and lrs[2] == pytest.approx(0.1)
    assert round_lr(TrainConfig(lr=0.1, lr_schedule="constant"), 5, 10) == 0.1
    # the default: a cosine from lr in round 1 to 0.3 x lr in the last round
    assert [round_lr(TrainConfig(lr=0.1), r, 10) for r in (1, 10)] == pytest.approx([0.1, 0.03])

"""The task's loss and metrics (app/task/metrics.py): built-ins against closed forms on tiny
inputs, the user's own loss and metric, the config checks and the results' primary metric."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from app.config.schema import Config, ConfigError, LossConfig, TaskConfig, TrainConfig, check_columns
from app.config.validate import validate
from app.run.results import RunRecorder
from app.task.data import DataSpec, Examples
from app.task.metrics import DEFAULT_TASK, Task
from app.task.training import Precision, evaluate, train

CPU = Precision(torch.device("cpu"), "off")
CLASSES = DataSpec((4,), 3)


def task(*metrics: object, spec: DataSpec = CLASSES, loss: LossConfig | None = None) -> Task:
    """A task with these metrics (TaskConfig's default, accuracy, when none are given)."""
    return Task.from_config(TaskConfig(loss=loss or LossConfig(), metrics=list(metrics) or ["accuracy"]), spec)


def two_class_logits(scores: list[float]) -> torch.Tensor:
    """Logits whose softmax P(class 1) ranks the examples like `scores`."""
    return torch.stack([torch.zeros(len(scores)), torch.tensor(scores)], dim=1)


# --- the user's code, named as tests.test_metrics.<name> ------------------------------------------


def zero_loss() -> object:
    """A loss factory whose loss is 0 with zero gradients: training must leave the weights alone."""
    return lambda logits, targets: (logits * 0.0).sum()


def summed_cross_entropy() -> object:
    return torch.nn.CrossEntropyLoss(reduction="none")  # not a scalar: refused


def not_a_loss() -> int:
    return 3


def top2_hits(logits: torch.Tensor, targets: torch.Tensor, k: int = 2) -> float:
    """Top-k accuracy: a custom metric with a keyword argument."""
    assert logits.dtype == torch.float32 and logits.device.type == "cpu"
    return float((logits.topk(k, dim=1).indices == targets[:, None]).any(1).float().mean())


# --- built-in metrics --------------------------------------------------------------------------


def test_auroc_of_a_known_ranking_binary_and_one_class() -> None:
    # positives score 0.3 and 3, negatives -2 and 0.5: 3 of the 4 (positive, negative) pairs are ordered
    scores, y = [-2.0, 0.5, 0.3, 3.0], torch.tensor([0, 0, 1, 1])
    spec = DataSpec((4,), 2)
    assert task("auroc", spec=spec).metrics(two_class_logits(scores), y)["auroc"] == pytest.approx(0.75)
    binary = task("auroc", spec=DataSpec((4,), 1, multilabel=True))  # N x 1 targets, sigmoid scores
    assert binary.metrics(torch.tensor(scores)[:, None], y[:, None].float())["auroc"] == pytest.approx(0.75)
    # one class only: no ROC curve, nan rather than an exception
    assert math.isnan(
        task("auroc", spec=spec).metrics(two_class_logits(scores), torch.ones(4, dtype=torch.long))["auroc"]
    )


def test_auroc_multiclass_is_the_macro_mean_of_one_vs_rest_over_present_classes() -> None:
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [1.0, 1.5, 0.0], [0.0, 0.0, 2.0], [0.5, 0.0, 1.0]])
    y = torch.tensor([0, 1, 0, 2, 2])
    probs = torch.softmax(logits.double(), 1)

    def binary_auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
        pos, neg = scores[positive], scores[~positive]
        return float(
            (pos[:, None] > neg[None, :]).double().mean() + 0.5 * (pos[:, None] == neg[None, :]).double().mean()
        )

    expected = sum(binary_auc(probs[:, c], y == c) for c in range(3)) / 3
    assert task("auroc").metrics(logits, y)["auroc"] == pytest.approx(expected)
    # class 2 absent from the targets: its one-vs-rest AUROC is undefined and left out of the mean
    y01 = torch.tensor([0, 1, 0, 1, 0])
    expected01 = (binary_auc(probs[:, 0], y01 == 0) + binary_auc(probs[:, 1], y01 == 1)) / 2
    assert task("auroc").metrics(logits, y01)["auroc"] == pytest.approx(expected01)


def test_balanced_accuracy_and_macro_f1_of_a_known_confusion_matrix() -> None:
    y = torch.tensor([0, 0, 0, 1, 1, 2])
    predicted = torch.tensor([0, 0, 1, 1, 1, 1])
    logits = F.one_hot(predicted, 3).float()
    got = task("accuracy", "balanced_accuracy", "f1_macro").metrics(logits, y)
    assert got["accuracy"] == pytest.approx(4 / 6)
    assert got["balanced_accuracy"] == pytest.approx((2 / 3 + 1 + 0) / 3)  # recall per class
    # F1 per class: 2PR/(P+R): class 0 P=1 R=2/3 -> 0.8, class 1 P=1/2 R=1 -> 2/3, class 2 -> 0
    assert got["f1_macro"] == pytest.approx((0.8 + 2 / 3 + 0) / 3)


def test_multilabel_accuracy_counts_example_label_pairs_and_bce_equals_torchs() -> None:
    spec = DataSpec((4,), 2, multilabel=True)
    t = task("accuracy", "f1_macro", spec=spec)
    logits, targets = torch.tensor([[1.0, -1.0], [-1.0, -2.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert t.accuracy(logits, targets) == pytest.approx(3 / 4)
    # label 0: tp 1, no errors -> F1 1; label 1: tp 0 -> F1 0
    assert t.metrics(logits, targets) == {"accuracy": pytest.approx(0.75), "f1_macro": pytest.approx(0.5)}
    logits, targets = torch.randn(8, 3, generator=torch.Generator().manual_seed(0)), (torch.rand(8, 3) > 0.5).float()
    expected = torch.nn.BCEWithLogitsLoss()(logits, targets)
    torch.testing.assert_close(task(spec=DataSpec((4,), 3, multilabel=True)).loss(logits, targets), expected)


def test_default_task_is_cross_entropy_and_accuracy() -> None:
    logits, y = torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    torch.testing.assert_close(DEFAULT_TASK.loss(logits, y), F.cross_entropy(logits, y))
    assert DEFAULT_TASK.names == ("accuracy",) and DEFAULT_TASK.primary == "accuracy"
    assert task().names == ("accuracy",)  # TaskConfig's default


# --- the user's loss and metrics ---------------------------------------------------------------


def test_custom_loss_and_metric_by_dotted_path() -> None:
    t = task(
        {"_target_": "tests.test_metrics.top2_hits", "name": "top2", "k": 2},
        {"_target_": "tests.test_metrics.top2_hits", "k": 1},
        "accuracy",
        loss=LossConfig("torch.nn.CrossEntropyLoss", {"label_smoothing": 0.1}),
    )
    assert t.names == ("top2", "top2_hits", "accuracy") and t.primary == "top2"
    logits = torch.tensor([[3.0, 2.0, 0.0], [0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    y = torch.tensor([1, 0, 0])
    assert t.metrics(logits, y) == {"top2": pytest.approx(2 / 3), "top2_hits": pytest.approx(1 / 3), "accuracy": 1 / 3}
    torch.testing.assert_close(t.loss(logits, y), F.cross_entropy(logits, y, label_smoothing=0.1))


def test_training_uses_the_custom_loss() -> None:
    """A loss that is 0 everywhere has zero gradients: the weights stay as they were."""
    torch.manual_seed(0)
    data = Examples(torch.rand(32, 4), torch.randint(0, 3, (32,)))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    before = [p.detach().clone() for p in model.parameters()]
    cfg = TrainConfig(epochs=2, batch_size=8, lr=0.5, momentum=0.0)
    stats = train(model, data, cfg, CPU, seed=0, task=task(loss=LossConfig("tests.test_metrics.zero_loss")))
    assert stats.loss == 0.0 and stats.steps == 8
    for b, p in zip(before, model.parameters(), strict=True):
        torch.testing.assert_close(b, p)
    train(model, data, cfg, CPU, seed=0)  # the default cross-entropy does move them
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_evaluate_reports_every_metric_and_nan_without_examples() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    data = Examples(torch.rand(40, 4), torch.randint(0, 3, (40,)))
    t = task("auroc", "accuracy")
    loss, metrics = evaluate(model, data, CPU, t, batch_size=16)  # three batches, one short
    with torch.no_grad():
        logits = model(data.x)
    assert loss == pytest.approx(float(F.cross_entropy(logits, data.y)), rel=1e-5)
    assert metrics == pytest.approx(t.metrics(logits, data.y))
    assert list(metrics) == ["auroc", "accuracy"]
    loss, metrics = evaluate(model, Examples(data.x[:0], data.y[:0]), CPU, t)
    assert math.isnan(loss) and list(metrics) == ["auroc", "accuracy"] and all(map(math.isnan, metrics.values()))


@pytest.mark.parametrize(
    ("loss", "match"),
    [
        ("tests.test_metrics.not_a_loss", r"^task\.loss\._target_='tests\.test_metrics\.not_a_loss' returned a int"),
        ("tests.test_metrics.nowhere", r"^task\.loss\._target_='tests\.test_metrics\.nowhere': module"),
    ],
)
def test_a_loss_target_that_is_no_loss_is_refused_naming_the_key(loss: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        task(loss=LossConfig(loss))


def test_a_loss_that_is_not_the_batch_mean_is_refused() -> None:
    t = task(loss=LossConfig("tests.test_metrics.summed_cross_entropy"))
    with pytest.raises(
        ConfigError, match=r"^task\.loss\._target_: the loss returned \(4,\); it must return the batch mean"
    ):
        t.loss(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))


def test_metric_entries_are_checked_on_the_client_too() -> None:
    with pytest.raises(ConfigError, match=r"^task\.metrics\[1\]='top1' is invalid: allowed: accuracy, "):
        task("accuracy", "top1")
    with pytest.raises(ConfigError, match=r"^task\.metrics=.* names must be unique"):
        task("accuracy", {"_target_": "tests.test_metrics.top2_hits", "name": "accuracy"})
    with pytest.raises(ConfigError, match=r"^task\.metrics\[0\]\._target_='tests\.test_metrics\.gone'"):
        task({"_target_": "tests.test_metrics.gone"})


# --- server-side validation --------------------------------------------------------------------


def configured(metrics: list | None = None, **federation: object) -> Config:
    cfg = Config()
    if metrics is not None:
        cfg.task.metrics = metrics
    for key, value in federation.items():
        setattr(cfg.federation, key, value)
    return cfg


def test_validation_normalises_the_stopping_target() -> None:
    cfg = validate(configured(["auroc", "accuracy"]))
    assert (cfg.federation.target_metric, cfg.federation.target_value) == ("auroc", 0.0)
    cfg = validate(configured(["auroc", "accuracy"], target_accuracy=0.8))  # the older spelling
    assert (cfg.federation.target_metric, cfg.federation.target_value) == ("accuracy", 0.8)
    assert validate(cfg).federation.target_value == 0.8  # validating twice is harmless
    cfg = validate(configured([{"_target_": "my_pkg.m.dice"}], target_metric="dice", target_value=3.0))
    assert (cfg.federation.target_metric, cfg.federation.target_value) == ("dice", 3.0)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (configured([]), r"^task\.metrics=\[\] is invalid: name at least one metric"),
        (configured(["accuracy", "top5"]), r"^task\.metrics\[1\]='top5' is invalid: allowed: accuracy, balanced_acc"),
        (configured([{"name": "x"}]), r"^task\.metrics\[0\]\._target_=None is invalid: give the dotted path"),
        (configured(["accuracy", {"_target_": "m.accuracy"}]), r"^task\.metrics=.* names must be unique \(accuracy\)"),
        (configured([{"_target_": "m.f", "name": "loss"}]), r"^task\.metrics\[0\]\.name='loss' is invalid"),
        (configured(target_metric="auroc"), r"^federation\.target_metric='auroc' is invalid: allowed: .*\(accuracy\)"),
        (configured(["auroc"], target_accuracy=0.9), r"^federation\.target_accuracy=0\.9 is invalid: needs accuracy"),
        (configured(target_accuracy=0.9, target_value=0.8), r"^federation\.target_accuracy=0\.9 is invalid: it is the"),
        (configured(target_accuracy=1.5), r"^federation\.target_accuracy=1\.5 is invalid: must be in \[0, 1\]"),
        (configured(target_value=-1.0), r"^federation\.target_value=-1\.0 is invalid: must be a finite number >= 0"),
        (configured(target_value=95.0), r"^federation\.target_value=95\.0 is invalid: accuracy is at most 1"),
    ],
)
def test_validation_refuses_bad_metrics_and_targets_naming_the_key(cfg: Config, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


def test_validation_refuses_a_loss_target_that_is_no_dotted_path() -> None:
    cfg = Config()
    cfg.task.loss = LossConfig("CrossEntropyLoss")
    with pytest.raises(ConfigError, match=r"^task\.loss\._target_='CrossEntropyLoss' is invalid: give the dotted"):
        validate(cfg)


# --- results -----------------------------------------------------------------------------------


def test_summary_follows_the_primary_metric(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path / "run", primary="auroc")
    for rnd, (auroc, acc) in enumerate([(0.6, 0.5), (0.9, 0.55), (0.8, 0.7)], start=1):
        recorder.log_round({"round": rnd, "auroc": auroc, "accuracy": acc, "loss": 1.0 / rnd, "wall_time_s": rnd})
    summary = recorder.finish("completed", 3.0, {})
    assert summary["primary_metric"] == "auroc" and summary["final_metric"] == 0.8
    assert summary["best_metric"] == 0.9 and summary["best_round"] == 2
    assert summary["final_accuracy"] == 0.7 and summary["best_accuracy"] == 0.7  # kept: accuracy is a column
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["best_round"] == 2
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0

    only = RunRecorder(tmp_path / "only", primary="auroc")
    only.log_round({"round": 1, "auroc": float("nan"), "loss": 1.0, "wall_time_s": 1.0})  # nan: not evaluated
    summary = only.finish("completed", 1.0, {})
    assert summary["final_metric"] is None and "final_accuracy" not in summary


def test_multilabel_balanced_accuracy_is_the_mean_over_labels() -> None:
    t = task("balanced_accuracy", spec=DataSpec((4,), 2, multilabel=True))
    logits = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])
    targets = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # label 0: recall(1) = 1/2, recall(0) = 1/2 -> 1/2; label 1: recall(1) = 1, recall(0) = 2/3 -> 5/6
    assert t.metrics(logits, targets)["balanced_accuracy"] == pytest.approx((1 / 2 + 5 / 6) / 2)


@pytest.mark.parametrize("column", ["num_clients", "train", "epsilon", "client_epsilon_max", "bytes_up", "staleness"])
def test_a_metric_named_like_a_row_column_is_refused_naming_it(column: str) -> None:
    """It would be overwritten when the row is put together (issue 32, finding 9)."""
    with pytest.raises(ConfigError, match=rf"^task\.metrics\[1\]\.name='{column}' is invalid: '{column}' is already"):
        validate(configured(["accuracy", {"_target_": "my_pkg.m.f", "name": column}]))


def test_a_row_with_an_undeclared_column_is_refused() -> None:
    """check_columns holds the declaration whole: every in-process federation of the suite passes
    through it, so a new column that is not declared fails them."""
    check_columns({"round": 1, "accuracy": 0.5, "epsilon": 1.0, "dice": 0.2}, ["accuracy", "dice"])
    with pytest.raises(RuntimeError, match=r"\['new_column'\] are not declared"):
        check_columns({"round": 1, "accuracy": 0.5, "new_column": 3}, ["accuracy"])

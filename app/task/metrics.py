"""The learning task: the loss the clients train with and the metrics evaluation reports
(`task.loss`, `task.metrics`; conf/task/default.yaml).

A `Task` is built once per round from the TaskConfig and the data spec, on the ClientApp
and on the server alike. The user's callables are located and called through
`app.task.user_code` (never Hydra: the ClientApp must not import it), so every failure is
a ConfigError naming the key.

Conventions every caller relies on:
- the loss is the *mean* over the batch (a scalar): the training loop weights per-step
  losses by batch size, and Opacus's DP-SGD undoes a mean reduction to get per-example
  gradients (a sum would scale them by the batch size, and the noise would not match);
- every metric is "higher is better": the best round, `federation.target_value` and the
  reports take the maximum;
- metrics are computed once per evaluation on float32 CPU logits, so scikit-learn (imported
  lazily: a ClientApp process pays for it only when a metric needs it) sees whole splits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from app.config.registry import Registry
from app.config.schema import BUILTIN_METRICS, ConfigError, TaskConfig, metric_name
from app.task.data import DataSpec
from app.task.user_code import call, locate

IGNORE = -100  # a target position without a next token (PyTorch's ignore_index)

LOSS_KEY = "task.loss._target_"
METRICS_KEY = "task.metrics"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricFn = Callable[[torch.Tensor, torch.Tensor], float]


def _predictions(logits: torch.Tensor, multilabel: bool) -> torch.Tensor:
    """Predicted classes (N), or 0/1 predictions per label (N x K, logit > 0)."""
    return (logits > 0).to(torch.int64) if multilabel else logits.argmax(1)


def task_accuracy(logits: torch.Tensor, targets: torch.Tensor, multilabel: bool) -> float:
    """Classes: the fraction of argmax hits. Multi-label: the fraction of (example, label)
    pairs where (logit > 0) equals the target. nan without examples."""
    if len(targets) == 0:
        return float("nan")
    hits = (logits > 0) == (targets > 0.5) if multilabel else logits.argmax(1) == targets
    return float(hits.sum()) / hits.numel()  # counted exactly, divided in float64


def _mean_recall(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.stack([(pred[y == c] == c).double().mean() for c in y.unique()]).mean())


def _balanced_accuracy(logits: torch.Tensor, targets: torch.Tensor, multilabel: bool) -> float:
    """The mean recall over the classes present in the targets (scikit-learn's
    balanced_accuracy_score; computed here because that one warns about every predicted class
    the targets lack, which a skewed client split hits every round). Multi-label: the mean over
    labels of each label's balanced accuracy of (logit > 0)."""
    pred = _predictions(logits, multilabel)
    if not multilabel:
        return _mean_recall(pred, targets)
    y = (targets > 0.5).to(torch.int64)
    return float(np.mean([_mean_recall(pred[:, j], y[:, j]) for j in range(y.shape[1])]))


def _f1_macro(logits: torch.Tensor, targets: torch.Tensor, multilabel: bool) -> float:
    """Unweighted mean F1 over the classes in the targets or predictions (binary N x 1: both
    classes), or over the labels (multi-label); an undefined F1 (no such example) counts 0."""
    from sklearn.metrics import f1_score

    pred = _predictions(logits, multilabel).numpy()
    y = (targets > 0.5).to(torch.int64).numpy() if multilabel else targets.numpy()
    if multilabel and y.shape[1] == 1:
        y, pred = y[:, 0], pred[:, 0]
    return float(f1_score(y, pred, average="macro", zero_division=0))


def _auroc(logits: torch.Tensor, targets: torch.Tensor, multilabel: bool) -> float:
    """Area under the ROC curve, one-vs-rest and macro-averaged.

    Two classes: P(class 1) from the softmax; more: each class's softmax probability against
    the rest; multi-label (binary N x 1 included): each label's sigmoid. A class or label whose
    targets are all alike has no ROC curve: it is left out of the mean, and the result is nan
    when none is left (e.g. a split with one class only), never an exception mid-run.
    """
    from sklearn.metrics import roc_auc_score

    logits = logits.double()
    if not torch.isfinite(logits).all():
        return float("nan")
    if multilabel:
        scores, onehot = torch.sigmoid(logits).numpy(), (targets > 0.5).numpy()
    else:
        probs = torch.softmax(logits, dim=1)
        onehot = F.one_hot(targets, probs.shape[1]).bool().numpy()
        scores = probs.numpy()
        if probs.shape[1] == 2:
            scores, onehot = scores[:, 1:], onehot[:, 1:]
    per_column = [
        float(roc_auc_score(onehot[:, j], scores[:, j]))
        for j in range(scores.shape[1])
        if 0 < onehot[:, j].sum() < len(onehot)
    ]
    return float(np.mean(per_column)) if per_column else float("nan")


_BUILTINS: Registry[Callable[[torch.Tensor, torch.Tensor, bool], float]] = Registry(
    METRICS_KEY,
    BUILTIN_METRICS,
    {
        "accuracy": task_accuracy,
        "balanced_accuracy": _balanced_accuracy,
        "f1_macro": _f1_macro,
        "auroc": _auroc,
    },
)


class Task:
    """The configured loss and metrics for one kind of targets (classes, or multi-label)."""

    def __init__(self, loss_fn: LossFn | None, metrics: list[tuple[str, MetricFn]], multilabel: bool = False) -> None:
        if not metrics:
            raise ConfigError(f"{METRICS_KEY}=[] is invalid: name at least one metric")
        self._custom_loss = loss_fn
        self._metrics = metrics
        self.multilabel = multilabel
        self.names: tuple[str, ...] = tuple(name for name, _ in metrics)
        self.primary: str = self.names[0]  # the first metric: best round, stopping target, reports

    @classmethod
    def from_config(cls, cfg: TaskConfig, spec: DataSpec) -> Task:
        """Build the task: the loss `_target_` is called once here (with its kwargs; a factory
        that declares `num_classes` gets the spec's), each custom metric is located here, so a
        bad path fails before any training."""
        if spec.causal_lm:
            return LanguageModelTask([str(m) for m in cfg.metrics])
        loss_fn: LossFn | None = None
        if cfg.loss.target is not None:
            loss_fn = call(LOSS_KEY, cfg.loss.target, cfg.loss.kwargs, {"num_classes": spec.num_classes})
            if not callable(loss_fn) or isinstance(loss_fn, torch.Tensor):
                raise ConfigError(
                    f"{LOSS_KEY}={cfg.loss.target!r} returned a {type(loss_fn).__name__}: it must return a "
                    "loss function or module taking (logits, targets), e.g. torch.nn.CrossEntropyLoss"
                )
        metrics = [_metric(i, entry, spec.multilabel) for i, entry in enumerate(cfg.metrics)]
        names = [name for name, _ in metrics]
        if len(set(names)) != len(names):
            raise ConfigError(f"{METRICS_KEY}={cfg.metrics!r} is invalid: metric names must be unique, got {names}")
        return cls(loss_fn, metrics, spec.multilabel)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss (a scalar tensor, differentiable).

        Default: cross-entropy on class indices, BCE-with-logits on float 0/1 targets
        (multi-label; its mean over examples and labels). A custom loss gets fp32 logits
        (cheap: N x K) and must reduce to the batch mean; anything but a scalar is refused.
        """
        if self._custom_loss is None:
            if self.multilabel:
                return F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype))
            return F.cross_entropy(logits, targets)
        out = self._custom_loss(logits.float(), targets)
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConfigError(
                f"{LOSS_KEY}: the loss returned {shape}; it must return the batch mean as a scalar tensor "
                "(reduction='mean': DP-SGD and the loss statistics rely on it)"
            )
        return out

    def accuracy(self, logits: torch.Tensor, targets: torch.Tensor) -> float:
        """Task-aware accuracy (see `task_accuracy`); what the clients report as train-accuracy."""
        return task_accuracy(logits, targets, self.multilabel)

    def metrics(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Every configured metric by name, over whole-split logits and targets (moved to the CPU,
        logits as float32); nan for each when there are no examples."""
        if len(targets) == 0:
            return {name: float("nan") for name in self.names}
        logits, targets = logits.detach().float().cpu(), targets.detach().cpu()
        return {name: fn(logits, targets) for name, fn in self._metrics}

    def keep(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the loops keep of a batch for `accuracy` and `metrics` after the loop: the logits
        and targets themselves (N x classes: small)."""
        return logits, targets


class LanguageModelTask(Task):
    """Next-token prediction (task.type=causal_lm): cross-entropy over every position with a
    next token (IGNORE elsewhere), token accuracy and perplexity.

    N x T x vocabulary logits are far too large to keep for a whole split, so `keep` reduces
    each example to (correct tokens, tokens, summed negative log-likelihood) at once, and the
    metrics add those up: exact, whatever the batching. Perplexity is exp(mean token NLL), the
    one lower-is-better number here, so it may not be the primary metric (validation)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(None, [(name, _unused) for name in names])

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)

    def keep(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        valid = targets != IGNORE
        nll = F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
        hits = (logits.argmax(-1) == targets) & valid
        kept = torch.stack([hits.sum(1), valid.sum(1), nll.sum(1)], dim=1).double()
        return kept, targets[:, 0]

    def accuracy(self, logits: torch.Tensor, targets: torch.Tensor) -> float:
        tokens = float(logits[:, 1].sum())
        return float(logits[:, 0].sum()) / tokens if tokens else float("nan")

    def metrics(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        tokens = float(logits[:, 1].sum()) if len(logits) else 0.0
        if not tokens:
            return {name: float("nan") for name in self.names}
        values = {
            "token_accuracy": self.accuracy(logits, targets),
            "perplexity": math.exp(float(logits[:, 2].sum()) / tokens),
        }
        return {name: values[name] for name in self.names}


def _unused(logits: torch.Tensor, targets: torch.Tensor) -> float:
    raise AssertionError("LanguageModelTask computes its metrics itself")


def _metric(index: int, entry: Any, multilabel: bool) -> tuple[str, MetricFn]:  # noqa: ANN401
    """(name, fn(logits, targets) -> float) for one `task.metrics` entry."""
    key = f"{METRICS_KEY}[{index}]"
    if isinstance(entry, str):
        if entry not in BUILTIN_METRICS:
            raise ConfigError(
                f"{key}={entry!r} is invalid: allowed: {', '.join(BUILTIN_METRICS)}, or "
                "{_target_: my_pkg.module.metric, name: ...}"
            )
        builtin = _BUILTINS[entry]
        return entry, lambda logits, targets: builtin(logits, targets, multilabel)
    if not isinstance(entry, Mapping) or not isinstance(entry.get("_target_"), str):
        raise ConfigError(f"{key}={entry!r} is invalid: a built-in name or a mapping with a string _target_")
    path = entry["_target_"]
    target_key = f"{key}._target_"
    fn = locate(path, target_key)
    kwargs = {k: v for k, v in entry.items() if k not in ("_target_", "name")}

    def custom(logits: torch.Tensor, targets: torch.Tensor) -> float:
        """fn(logits, targets, **kwargs): float32 CPU logits, targets as the data has them."""
        try:
            return float(fn(logits, targets, **kwargs))
        except Exception as err:  # noqa: BLE001 - the user's code may raise anything; say where it came from
            raise ConfigError(f"{target_key}={path!r} failed: {type(err).__name__}: {err}") from err

    return metric_name(entry), custom


DEFAULT_TASK = Task(None, [("accuracy", lambda logits, targets: task_accuracy(logits, targets, False))])
"""Cross-entropy and accuracy on class labels: what callers that pass no task get."""

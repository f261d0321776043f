"""Ditto (strategy=ditto; app/task/ditto.py): a node's personal model trains with lambda (v - w)
added to its gradients (a hand-written loop), is kept on the node (its state directory across a
restart) and never sent, and federated evaluation, the rows and the report show both models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict
from torch import nn

from app.config.compose import load_config
from app.config.schema import ConfigError, TrainConfig
from app.run.results import read_rows
from app.task.data import Examples
from app.task.ditto import STATE, keep_personal, personal_file, personal_state, train_personal
from app.task.metrics import DEFAULT_TASK
from app.task.training import Precision
from app.tools.in_process import run_in_process

LAM, LR = 0.5, 0.1


def test_the_personal_model_trains_towards_the_global_one_as_ditto_writes_it() -> None:
    """Full-batch SGD, 3 steps: v <- v - lr (grad f(v) + lambda (v - w)), w the global model."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 3))
    data = Examples(torch.randn(16, 6), torch.randint(0, 3, (16,)))
    w = {k: v.detach().clone() for k, v in model.state_dict().items()}
    v0 = {k: t + 0.3 * torch.randn_like(t) for k, t in w.items()}
    cfg = TrainConfig(batch_size=16, epochs=3, lr=LR, momentum=0.0, weight_decay=0.0)
    new, stats = train_personal(model, v0, w, data, cfg, Precision(torch.device("cpu"), "off"), 0, DEFAULT_TASK, LAM)
    assert stats.steps == 3
    ref = {k: t.clone().requires_grad_(True) for k, t in v0.items()}
    for _ in range(3):
        loss = nn.functional.cross_entropy(data.x @ ref["0.weight"].T + ref["0.bias"], data.y)
        grads = torch.autograd.grad(loss, list(ref.values()))
        with torch.no_grad():
            for (k, p), g in zip(ref.items(), grads, strict=True):
                p -= LR * (g + LAM * (p - w[k]))
    for k in w:
        assert torch.allclose(new[k], ref[k].detach(), atol=1e-6), k
        assert torch.equal(model.state_dict()[k], w[k]), "the global model was touched"


def test_the_personal_model_is_kept_in_the_state_and_its_directory(tmp_path: Path) -> None:
    received = {"w": torch.zeros(3)}
    first = personal_state(RecordDict(), None, received)
    assert torch.equal(first["w"], received["w"])  # a first round: the global model
    saved = personal_file(str(tmp_path), 3)
    state = RecordDict()
    keep_personal(state, saved, {"w": torch.ones(3)})
    assert STATE in state and saved.exists()
    assert torch.equal(personal_state(RecordDict(), saved, received)["w"], torch.ones(3))  # a restarted node
    assert torch.equal(personal_state(RecordDict(), saved, {"w": torch.zeros(4)})["w"], torch.zeros(4))  # another model


def test_ditto_reports_both_models_and_sends_only_the_global_one(tmp_path: Path) -> None:
    """Three nodes, Dirichlet 0.3, 3 rounds: each row's federated evaluation holds the global and the
    personal models' metrics; the personal models, fitted to their own skewed data, are ahead
    (measured: 46.9% against 22.8% in round 3); every reply's arrays are the model's keys only; the
    report has both columns."""
    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid
    from app.tools.report import write_report

    keys: list[set[str]] = []

    def instrument(node: int, reply):  # noqa: ANN001, ANN202
        if not reply.has_error():
            keys.append({k for r in reply.content.array_records.values() for k in r})
        return reply

    overrides = (
        "strategy=ditto partition=dirichlet partition.alpha=0.3 train.epochs=1 federation.rounds=3 "
        "federation.fraction_evaluate=1 ledger=off name=ditto"
    )
    summary, _ = run_in_process(overrides, tmp_path, grid=InProcessGrid(client_app, 3, tamper=instrument))
    rows = read_rows(summary["run_dir"])
    for row in rows:
        fed = row["federated_eval"]
        assert {"eval-accuracy", "eval-personal-accuracy", "eval-personal-loss"} <= fed.keys(), fed
    assert rows[-1]["federated_eval"]["eval-personal-accuracy"] > rows[-1]["federated_eval"]["eval-accuracy"]
    model_keys = set(torch.load(Path(summary["run_dir"]) / "model_final.pt", weights_only=True))
    trained = [k for k in keys if k]
    assert trained and all(k == model_keys for k in trained), "a reply carried more than the global model"
    report = write_report(tmp_path)
    text = next(p for p in report.values() if str(p).endswith(".md")).read_text()
    assert "personal models (Ditto)" in text


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ("strategy=ditto", "fraction_evaluate"),
        ("strategy=ditto federation.fraction_evaluate=1 strategy.ditto_lambda=0", "strategy.ditto_lambda"),
        ("strategy=ditto federation.fraction_evaluate=1 privacy=local", "without DP-SGD"),
    ],
)
def test_what_ditto_cannot_do_is_refused(overrides: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(overrides)

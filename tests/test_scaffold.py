"""SCAFFOLD (strategy=scaffold; app/task/scaffold.py on the node, strategies/scaffold.py on the
server): a node's round equals a hand-written SCAFFOLD option II loop, the server's c moves by
|S| / N times the mean change, c_i survives a restarted node through its state directory and c
the checkpoint, and what it cannot compose with is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from app.config.compose import load_config
from app.config.schema import ConfigError, TrainConfig
from app.run.results import read_rows
from app.task.data import Examples
from app.task.kept import save_kept
from app.task.scaffold import STATE, corrections, keep, new_variate, node_variate, variate_file
from app.task.training import Precision, Steps, fit
from app.tools.in_process import run_in_process
from strategies.fedavg import RoundReport
from strategies.keys import SCAFFOLD_DELTA
from strategies.replies import Screened, ValidReply
from strategies.scaffold import Scaffold

LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 3))


def test_a_nodes_round_is_scaffold_option_ii_written_out() -> None:
    """Full-batch SGD (no momentum), 3 steps: y <- y - lr (grad + c - c_i), then
    c_i+ = c_i - c + (x - y) / (3 lr): the loop, the correction and the new variate against
    autograd by hand."""
    data = Examples(torch.randn(16, 6), torch.randint(0, 3, (16,)))
    model = _model()
    x = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    server_c = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in x.items()}
    variate = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in x.items()}
    cfg = TrainConfig(batch_size=16, epochs=3, lr=LR, momentum=0.0, weight_decay=0.0)
    correction = corrections(model, server_c, variate, torch.device("cpu"))
    steps = Steps(
        model, cfg, Precision(torch.device("cpu"), "off"), torch.Generator().manual_seed(0), correction=correction
    )
    stats = fit(steps, data)
    assert stats.steps == 3

    ref = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    for _ in range(3):
        loss = nn.functional.cross_entropy(data.x @ ref["0.weight"].T + ref["0.bias"], data.y)
        grads = torch.autograd.grad(loss, list(ref.values()))
        with torch.no_grad():
            for (k, p), grad in zip(ref.items(), grads, strict=True):
                p -= LR * (grad + server_c[k] - variate[k])
    trained = model.state_dict()
    for k in x:
        assert torch.allclose(trained[k], ref[k].detach(), atol=1e-6), k
    new, delta = new_variate(variate, server_c, x, trained, set(correction), stats.steps, LR)
    for k in x:
        want = variate[k] - server_c[k] + (x[k] - ref[k].detach()) / (3 * LR)
        assert torch.allclose(new[k], want, atol=1e-5) and torch.allclose(delta[k], want - variate[k], atol=1e-5), k


def test_a_buffer_keeps_its_variate_and_no_step_changes_nothing() -> None:
    c = {"w": torch.ones(2), "running_mean": torch.ones(2)}
    ci = {"w": torch.zeros(2), "running_mean": torch.zeros(2)}
    trained = {"w": torch.full((2,), -1.0), "running_mean": torch.full((2,), 5.0)}
    new, delta = new_variate(ci, c, {"w": torch.zeros(2), "running_mean": torch.zeros(2)}, trained, {"w"}, 2, 0.5)
    assert torch.equal(new["w"], torch.full((2,), -1 + 1 / (2 * 0.5))) and torch.equal(
        delta["running_mean"], torch.zeros(2)
    )
    same, none = new_variate(ci, c, trained, trained, {"w"}, 0, 0.5)
    assert all(torch.equal(same[k], ci[k]) and not none[k].any() for k in ci)


def test_the_nodes_variate_outlives_a_restart_through_its_state_directory(tmp_path: Path) -> None:
    """The variate kept in the Context and in `state-dir`: a new Context (a restarted node) reads the
    file; a missing, torn or foreign file, or another model, starts from zero."""
    c = {"w": torch.zeros(3), "b": torch.zeros(1)}
    kept = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0])}
    saved = variate_file(str(tmp_path), 7)
    first = RecordDict()
    keep(first, kept)
    save_kept(saved, kept)
    assert STATE in first and all(torch.equal(node_variate(first, None, c)[k], kept[k]) for k in c)
    restarted = node_variate(RecordDict(), saved, c)
    assert all(torch.equal(restarted[k], kept[k]) for k in c)
    assert not any(node_variate(RecordDict(), saved, {"w": torch.zeros(4), "b": torch.zeros(1)})[k].any() for k in c)
    saved.write_bytes(b"torn")
    assert not any(node_variate(RecordDict(), saved, c)[k].any() for k in c)


def test_the_server_moves_c_by_the_share_of_nodes_times_their_mean_change() -> None:
    """Two of four connected nodes reply: the model is their weighted mean (their variate changes
    stripped), c += 2/4 x the plain mean of the changes."""
    strategy = Scaffold()
    strategy._global = {"w": torch.zeros(2)}
    strategy.c, strategy.population = {"w": torch.tensor([1.0, 1.0])}, 4
    replies = [
        ValidReply(
            1,
            1.0,
            MetricRecord({"num-examples": 1}),
            {"w": torch.full((2,), 2.0), SCAFFOLD_DELTA + "w": torch.tensor([2.0, 0.0])},
        ),
        ValidReply(
            2,
            3.0,
            MetricRecord({"num-examples": 3}),
            {"w": torch.full((2,), 6.0), SCAFFOLD_DELTA + "w": torch.tensor([0.0, 4.0])},
        ),
    ]
    strategy.train_report = RoundReport(sampled=2)
    new = strategy.combine(1, Screened(valid=replies))
    assert torch.allclose(new["w"], torch.full((2,), 5.0))
    assert torch.allclose(strategy.c["w"], torch.tensor([1.5, 2.0]))


def test_scaffold_is_ahead_of_fedavg_under_label_skew(tmp_path: Path) -> None:
    """Three nodes, Dirichlet 0.3, 4 rounds of one epoch: SCAFFOLD ends ahead of FedAvg on the same
    split (measured: 30.3% against 19.4%)."""
    common = "partition=dirichlet partition.alpha=0.3 train.epochs=1 ledger=off federation.rounds=4 "
    scaffold, _ = run_in_process(common + "strategy=scaffold name=scaffold", tmp_path, nodes=3)
    fedavg, _ = run_in_process(common + "strategy=fedavg name=fedavg", tmp_path, nodes=3)
    assert scaffold["final_accuracy"] > fedavg["final_accuracy"], (scaffold["final_accuracy"], fedavg["final_accuracy"])
    assert [r["round"] for r in read_rows(scaffold["run_dir"])] == [1, 2, 3, 4]


def test_the_servers_variate_is_in_the_checkpoint() -> None:
    strategy = Scaffold()
    strategy.c = {"w": torch.tensor([0.5, -1.0])}
    again = Scaffold()
    again.load_state_dict(strategy.state_dict())
    assert torch.equal(again.c["w"], strategy.c["w"])


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ("strategy=scaffold privacy=local", "no epsilon covers"),
        ("strategy=scaffold privacy=central privacy.noise_multiplier=1", "no epsilon covers"),
        ("strategy=scaffold compression=int8", "uncompressed"),
        ("strategy=scaffold train.optimizer=adam", "train.optimizer=sgd"),
        ("strategy=scaffold topology=regions topology.regions=2", "variate per region"),
        ("strategy=scaffold ledger.contribution=loo", "contribution"),
    ],
)
def test_what_scaffold_cannot_do_is_refused(overrides: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(overrides)


def test_the_task_carries_c_and_the_reply_must_carry_each_change(tmp_path: Path) -> None:
    """The real ClientApp in process: every training task holds c (zeros in round 1), every reply a
    change of c_i for each of c's keys, screened like the model's arrays."""
    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid
    from strategies.keys import SCAFFOLD_C

    seen: list[set[str]] = []

    def instrument(node: int, reply):  # noqa: ANN001, ANN202
        if not reply.has_error():
            seen.append({k for r in reply.content.array_records.values() for k in r})
        return reply

    summary, grid = run_in_process(
        "strategy=scaffold federation.rounds=2 train.epochs=1 ledger=off name=s",
        tmp_path,
        grid=InProcessGrid(client_app, 2, tamper=instrument),
    )
    assert summary["status"] == "completed"
    tasks = [m for m in grid.pushed if m.metadata.message_type == "train"]
    assert tasks and all(SCAFFOLD_C in m.content for m in tasks)
    c_keys = set(tasks[0].content[SCAFFOLD_C].keys())
    assert not any(a.numpy().any() for a in tasks[0].content[SCAFFOLD_C].values())  # c = 0 at first
    assert all({SCAFFOLD_DELTA + k for k in c_keys} <= keys for keys in seen) and len(seen) == 4
    assert isinstance(tasks[-1].content[SCAFFOLD_C], ArrayRecord)

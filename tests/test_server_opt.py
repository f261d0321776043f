"""Server optimizers (strategies/server_opt.py): each is Flower 1.42's own FedAvgM, FedAdam, FedYogi
or FedAdagrad on the same replies over several rounds; the strategies apply it to their aggregate;
its state survives a checkpoint; what it cannot compose with is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvgM, FedYogi

from app.config.compose import load_config
from app.config.schema import ConfigError
from app.run.results import read_rows
from app.tools.in_process import run_in_process
from strategies.fedavg import FedAvg, RoundReport
from strategies.replies import Screened, ValidReply
from strategies.server_opt import ServerOptimizer
from strategies.tensor_ops import record_to_tensors

SHAPES = {"w": (4, 3), "b": (3,)}


def _replies(rng: np.random.Generator, n: int) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    models = [{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n)]
    return models, [int(e) for e in rng.integers(5, 50, n)]


def _messages(models: list[dict[str, np.ndarray]], examples: list[int]) -> list[Message]:
    return [
        Message(
            content=RecordDict(
                {
                    "arrays": ArrayRecord({k: Array(v) for k, v in m.items()}),
                    "metrics": MetricRecord({"num-examples": e}),
                }
            ),
            dst_node_id=1,
            message_type="train",
        )
        for m, e in zip(models, examples, strict=True)
    ]


def _mean(models: list[dict[str, np.ndarray]], examples: list[int]) -> dict[str, torch.Tensor]:
    total = sum(examples)
    return {
        k: torch.from_numpy(
            sum(m[k].astype(np.float64) * e for m, e in zip(models, examples, strict=True)) / total
        ).float()
        for k in SHAPES
    }


@pytest.mark.parametrize(
    ("ours", "flower"),
    [
        (
            ServerOptimizer("momentum", lr=0.7, momentum=0.9),
            lambda: FedAvgM(server_learning_rate=0.7, server_momentum=0.9),
        ),
        (ServerOptimizer("sgd", lr=0.5), lambda: FedAvgM(server_learning_rate=0.5)),
        (
            ServerOptimizer("adam", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3),
            lambda: FedAdam(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3),
        ),
        (
            ServerOptimizer("yogi", lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3),
            lambda: FedYogi(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3),
        ),
        (ServerOptimizer("adagrad", lr=0.1, beta1=0.0, tau=1e-3), lambda: FedAdagrad(eta=0.1, tau=1e-3)),
    ],
    ids=["momentum", "sgd", "adam", "yogi", "adagrad"],
)
def test_each_server_optimizer_is_flowers_on_the_same_replies_over_rounds(ours: ServerOptimizer, flower) -> None:  # noqa: ANN001
    """Four rounds of five replies with unequal counts: the same model as Flower's strategy each round
    (float64 here, Flower's float32 arithmetic: 1e-5)."""
    rng = np.random.default_rng(0)
    theirs = flower()
    current = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    if isinstance(theirs, FedAvgM):
        theirs.current_arrays = ArrayRecord({k: Array(v) for k, v in current.items()})
    for rnd in range(1, 5):
        models, examples = _replies(rng, 5)
        if not isinstance(theirs, FedAvgM):
            theirs.current_arrays = {k: v.copy() for k, v in current.items()}
        expected, _ = theirs.aggregate_train(rnd, _messages(models, examples))
        got = ours.step({k: torch.from_numpy(v) for k, v in current.items()}, _mean(models, examples), rnd)
        for k, v in record_to_tensors(expected).items():
            assert torch.allclose(got[k], v.float(), atol=1e-5, rtol=1e-5), (rnd, k, (got[k] - v).abs().max())
        current = {k: v.numpy() for k, v in got.items()}


def test_a_strategy_steps_from_its_global_model_towards_the_aggregate() -> None:
    """FedAvg with sgd at η = 0.5 moves half-way to the weighted mean; an integer tensor (a
    BatchNorm counter) takes the aggregate as it is."""
    strategy = FedAvg(server_opt=ServerOptimizer("sgd", lr=0.5))
    strategy._global = {"w": torch.zeros(3), "n": torch.tensor(4)}  # what configure_train sets
    replies = [
        ValidReply(1, 1.0, MetricRecord({"num-examples": 1}), {"w": torch.full((3,), 2.0), "n": torch.tensor(6)}),
        ValidReply(2, 3.0, MetricRecord({"num-examples": 3}), {"w": torch.full((3,), 6.0), "n": torch.tensor(6)}),
    ]
    screened = Screened(valid=replies)
    strategy.train_report = RoundReport(sampled=2)
    new, _ = strategy._finish_train(1, screened, strategy.combine(1, screened), [])
    got = record_to_tensors(new)
    assert torch.allclose(got["w"], torch.full((3,), 0.5 * 5.0)) and int(got["n"]) == 6


def test_adam_state_survives_a_resume(tmp_path: Path) -> None:
    """Three rounds straight, or two, a stop and `resume`: the same final model (m and v in the
    checkpoint; without them the third round's step differs)."""
    # a constant lr: the default cosine is laid over federation.rounds, which the resume extends
    common = "train.epochs=1 seed=5 ledger=off strategy.server_optimizer=adam strategy.server_lr=0.01 train.lr_schedule=constant "
    straight, _ = run_in_process(common + "federation.rounds=3 name=straight", tmp_path, nodes=3)
    first, _ = run_in_process(common + "federation.rounds=2 name=resumed", tmp_path, nodes=3)
    again, _ = run_in_process(
        common + f"federation.rounds=3 name=resumed resume={Path(first['run_dir']) / 'checkpoint.pt'}",
        tmp_path,
        nodes=3,
    )
    a = torch.load(Path(straight["run_dir"]) / "model_final.pt", weights_only=True)
    b = torch.load(Path(again["run_dir"]) / "model_final.pt", weights_only=True)
    assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) < 1e-6
    assert [r["round"] for r in read_rows(again["run_dir"])][-1] == 3


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ("strategy.server_optimizer=nesterov", "strategy.server_optimizer"),
        ("strategy.server_optimizer=momentum", "needs a momentum"),
        ("strategy=fedbuff strategy.server_optimizer=adam privacy=central privacy.noise_multiplier=1", "release"),
        ("strategy.server_optimizer=adam ledger.contribution=loo", "not a share"),
        ("strategy.server_optimizer=adam strategy.server_tau=0", "strategy.server_tau"),
        ("strategy.proximal_mu=-1", "strategy.proximal_mu"),
        ("strategy.proximal_mu=0.1 privacy=local", "Opacus"),
    ],
)
def test_what_a_server_optimizer_or_fedprox_cannot_do_is_refused(overrides: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(overrides)

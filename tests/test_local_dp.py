"""Local DP-SGD (privacy=local): per-client accounting across rounds, target ε, model compatibility."""

from __future__ import annotations

import copy
import json
import logging
import re

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import RdpAccountant
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from opacus.accountants import RDPAccountant
from opacus.optimizers import DPOptimizer
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch import nn

from app.client_app import app as client_app
from app.config.compose import load_config
from app.config.schema import Config, ConfigError, DatasetConfig, ModelConfig, PrivacyConfig, TrainConfig
from app.privacy.accounting import (
    EPSILON_TOLERANCE,
    HistoryBook,
    MalformedHistory,
    PrivacyBudgetExhausted,
    affordable_steps,
    noise_for_target,
)
from app.privacy.dp_sgd import (
    ACCOUNTANT_STATE,
    DpSgdSteps,
    dp_generators,
    make_private_compatible,
    private_precision,
    train_private,
)
from app.protocol import PRIOR_KEY, to_client_record
from app.run.checkpoint import load_checkpoint
from app.run.federation import FederatedRun, run_federation
from app.simulation.local_grid import InProcessGrid
from app.task.data import DataSpec, Examples, load_splits, materialize, spec_to_record
from app.task.metrics import Task
from app.task.models import build_model
from app.task.training import Precision, Steps, TrainStats, fit, resolve_precision, train
from app.tools.in_process import run_in_process
from tests.helpers import context_for

DIGITS = DataSpec((1, 8, 8), 10)
LOG = "flwr.fedgpu.app.privacy.dp_sgd"
CPU = resolve_precision("off", torch.device("cpu"))


@pytest.fixture(scope="module")
def digits() -> Examples:
    source, _ = load_splits(DatasetConfig(), seed=0)
    return materialize(source)


def _train(cfg: Config, context: Context, server_round: int, extra: dict | None = None) -> Message:
    """One real ClientApp train round on the server's (DP-compatible) initial model."""
    torch.manual_seed(0)
    model = make_private_compatible(build_model(cfg.model, DIGITS))
    record = {**to_client_record(cfg), **spec_to_record(DIGITS), "server-round": server_round, **(extra or {})}
    ins = Message(
        RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(record)}),
        dst_node_id=context.node_id,
        message_type="train",
    )
    ins.metadata.__dict__["_message_id"] = f"r{server_round}"
    return client_app(ins, context)


def _opacus_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    accountant = RDPAccountant()
    accountant.history = [(sigma, q, steps)]
    return accountant.get_epsilon(delta)


def _dp_accounting_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    """Google's dp-accounting on Opacus's RDP orders >= 2 (it fails to converge below)."""
    accountant = RdpAccountant(orders=[a for a in RDPAccountant.DEFAULT_ALPHAS if a >= 2])
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


def test_client_epsilon_rises_every_round_and_matches_the_accountants():
    cfg, _ = load_config("privacy=local privacy.noise_multiplier=1.1 train.epochs=1 seed=3")
    context = context_for(0, 3)
    metrics = [_train(cfg, context, rnd).content["metrics"] for rnd in (1, 2, 3)]
    epsilons = [m["dp-epsilon"] for m in metrics]
    assert epsilons[0] > 0 and epsilons[0] < epsilons[1] < epsilons[2]
    n = metrics[0]["num-examples"]
    q, per_round = cfg.train.batch_size / n, n // cfg.train.batch_size
    assert [m["dp-steps"] for m in metrics] == [per_round, 2 * per_round, 3 * per_round]
    assert all(m["dp-noise-multiplier"] == 1.1 and m["steps"] == per_round for m in metrics)
    for rnd, eps in enumerate(epsilons, start=1):
        expected = _opacus_epsilon(1.1, q, rnd * per_round, cfg.privacy.delta)
        assert eps == pytest.approx(expected, rel=0.01)
        assert eps == pytest.approx(_dp_accounting_epsilon(1.1, q, rnd * per_round, cfg.privacy.delta), rel=0.01)
    history = context.state[ACCOUNTANT_STATE]
    assert history["noise-multipliers"] == [1.1] and history["steps"] == [3 * per_round]
    assert history["sample-rates"] == [pytest.approx(q)]


def test_target_epsilon_is_spent_over_the_planned_rounds_and_not_beyond():
    cfg, _ = load_config("privacy=local privacy.target_epsilon=2.0 train.epochs=1 seed=3")
    context = context_for(1, 3)
    planned = {"federation.rounds": 2}
    first, second = (_train(cfg, context, rnd, planned).content["metrics"] for rnd in (1, 2))
    assert first["dp-noise-multiplier"] == second["dp-noise-multiplier"] > 0  # one plan, one σ
    assert first["dp-epsilon"] < second["dp-epsilon"] <= 2.0
    assert second["dp-epsilon"] >= 2.0 - EPSILON_TOLERANCE
    with pytest.raises(PrivacyBudgetExhausted, match=r"privacy.target_epsilon=2.0: this node's ε is 1.99\d* after"):
        _train(cfg, context, 3, planned)


def test_unreachable_or_unplanned_target_epsilon_is_refused_naming_the_key():
    cfg, _ = load_config("privacy=local privacy.target_epsilon=0.001 train.epochs=1")
    with pytest.raises(ConfigError, match=r"privacy.target_epsilon=0.001 cannot be reached"):
        _train(cfg, context_for(0, 3), 1, {"federation.rounds": 5})
    with pytest.raises(ConfigError, match=r"privacy.target_epsilon=0.001 needs .* no 'federation.rounds'"):
        _train(cfg, context_for(0, 3), 1)
    with pytest.raises(ConfigError, match="privacy.target_epsilon=1.0 cannot be reached"):
        noise_for_target(1.0, 1e-5, 1.0, 1000)  # full-batch steps: no amplification to help


def test_noise_and_batch_draws_cannot_be_replayed_from_the_run_seed():
    """The server knows the run's seed: DP randomness drawn from it would protect nothing."""
    cfg, _ = load_config("privacy=local train.epochs=1 seed=3")
    a, b = (_train(cfg, context_for(2, 3), 1).content["arrays"].to_torch_state_dict() for _ in range(2))
    assert not torch.equal(a["net.12.weight"], b["net.12.weight"])


def test_cnn_reply_has_exactly_the_server_models_keys_and_shapes():
    cfg, _ = load_config("privacy=local train.epochs=1")
    server = build_model(cfg.model, DIGITS)  # GroupNorm already: make_private_compatible keeps every key
    reply = _train(cfg, context_for(2, 3), 1).content["arrays"].to_torch_state_dict()
    assert {k: v.shape for k, v in reply.items()} == {k: v.shape for k, v in server.state_dict().items()}


def test_resnet18_is_fixed_to_groupnorm_logged_and_trains_on_the_server_models_keys(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=LOG):
        server = make_private_compatible(build_model(ModelConfig(name="resnet18", width=64), DIGITS))
    assert "ModuleValidator.fix replaced 20 x BatchNorm2d → GroupNorm" in caplog.text
    assert not any(isinstance(m, nn.BatchNorm2d) for m in server.modules())
    assert not any(k.endswith("running_mean") for k in server.state_dict())
    # A deployed node with 10 images: 9 to train on, 2 DP-SGD steps of about 4.
    rng = np.random.default_rng(0)
    np.savez(
        path := tmp_path / "site.npz", x=rng.integers(0, 255, (10, 8, 8), dtype=np.uint8), y=rng.integers(0, 10, 10)
    )
    cfg, _ = load_config("privacy=local model=resnet18 train.epochs=1 train.batch_size=4")
    record = {**to_client_record(cfg), **spec_to_record(DIGITS), "server-round": 1}
    ins = Message(
        RecordDict({"arrays": ArrayRecord(server.state_dict()), "config": ConfigRecord(record)}),
        dst_node_id=7,
        message_type="train",
    )
    ins.metadata.__dict__["_message_id"] = "resnet"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOG):
        reply = client_app(ins, context_for(0, 1, node_config={"data-path": str(path)}))
    assert "per-example gradients by ExpandedWeights" in caplog.text  # `out += identity` rules out hooks
    assert reply.content["metrics"]["dp-steps"] == 2
    arrays = reply.content["arrays"].to_torch_state_dict()
    assert {k: v.shape for k, v in arrays.items()} == {k: v.shape for k, v in server.state_dict().items()}


def test_empty_poisson_batches_still_take_a_noised_accounted_step(digits):
    data = Examples(digits.x[:20], digits.y[:20])
    sampling, _ = dp_generators(torch.device("cpu"), seed=5)
    batches = UniformWithReplacementSampler(num_samples=20, sample_rate=0.05, generator=sampling, steps=20)
    assert any(not b for b in batches)  # this seed draws empty batches
    model = make_private_compatible(build_model(ModelConfig(), DIGITS))
    before = [p.detach().clone() for p in model.parameters()]
    state = RecordDict()
    stats, metrics = train_private(
        model, data, TrainConfig(epochs=1, batch_size=1), PrivacyConfig(), CPU, state, {}, seed=5
    )
    assert stats.steps == metrics["dp-steps"] == 20
    assert metrics["dp-epsilon"] == pytest.approx(_opacus_epsilon(1.0, 0.05, 20, 1e-5), rel=1e-9)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_bf16_autocast_keeps_every_clipped_gradient_within_clip_norm(digits):
    """Opacus takes per-example norms in the grad samples' dtype; in bf16 they are off by up to
    0.4%, so a clipped gradient can exceed the bound unless it is clipped in fp32."""
    clip = 0.1  # well below these gradients' norms: every example is clipped
    for i in range(8):
        torch.manual_seed(0)
        model = make_private_compatible(build_model(ModelConfig(), DIGITS))
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        train_private(
            model,
            Examples(digits.x[i : i + 1], digits.y[i : i + 1]),  # q = 1: one step on this one example
            TrainConfig(epochs=1, batch_size=1, lr=1.0, momentum=0.0),
            PrivacyConfig(noise_multiplier=0.0, clip_norm=clip),
            resolve_precision("bf16", torch.device("cpu")),
            RecordDict(),
            {},
        )
        step = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
        assert clip * 0.99 < float(step.norm()) <= clip * (1 + 1e-4)


def test_amp_is_kept_only_where_opacus_supports_it(caplog):
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger=LOG):
        assert private_precision(Precision(cuda, "bf16"), hooks=True).amp == "bf16"
        assert private_precision(Precision(cuda, "fp16"), hooks=True).amp == "off"
        assert "train.amp=fp16 falls back to fp32: fp16 needs a GradScaler" in caplog.text
        assert private_precision(Precision(cuda, "bf16"), hooks=False).amp == "off"
        assert "ExpandedWeights does not run under autocast" in caplog.text


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_noiseless_unclipped_full_batch_step_is_exactly_plain_sgd(digits, channels_last):
    """Summed per-example gradients must equal the batch gradient. Opacus 1.6 gets conv ones wrong on
    channels_last activations: a CUDA model (prepare_model), or digits, whose 1-channel strides read so."""
    data = Examples(digits.x[:64], digits.y[:64])
    cfg = TrainConfig(epochs=1, batch_size=64, lr=1.0, momentum=0.0)  # q = 1: one step on all 64
    torch.manual_seed(0)
    reference = build_model(ModelConfig(), DIGITS)
    private = make_private_compatible(copy.deepcopy(reference))
    if channels_last:
        private = private.to(memory_format=torch.channels_last)
    train(reference, data, cfg, CPU, seed=0)
    train_private(private, data, cfg, PrivacyConfig(noise_multiplier=0.0, clip_norm=1e6), CPU, RecordDict(), {})
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(private.state_dict()[key], value, rtol=1e-4, atol=1e-6, msg=key)


def test_dp_sgd_trains_with_the_tasks_loss(digits):
    """A loss that is 0 everywhere gives zero per-example gradients: with no noise the weights stay."""
    model = make_private_compatible(build_model(ModelConfig(), DIGITS))
    before = [p.detach().clone() for p in model.parameters()]
    zero = Task(lambda logits, targets: (logits * 0.0).mean(), [("accuracy", lambda logits, targets: 0.0)])
    cfg = TrainConfig(epochs=1, batch_size=16, lr=1.0, momentum=0.0)
    stats, _ = train_private(
        model,
        Examples(digits.x[:64], digits.y[:64]),
        cfg,
        PrivacyConfig(noise_multiplier=0.0),
        CPU,
        RecordDict(),
        {},
        seed=1,
        task=zero,
    )
    assert stats.loss == 0.0 and stats.steps == 4
    for b, p in zip(before, model.parameters(), strict=True):
        torch.testing.assert_close(b, p)


def test_dp_sgd_runs_in_the_one_training_loop(digits, monkeypatch):
    """train_private plans, accounts and reports; the steps themselves run in app.task.training.fit."""
    calls = []

    def spy(steps: Steps, data: Examples) -> TrainStats:
        calls.append(steps)
        return fit(steps, data)

    monkeypatch.setattr("app.privacy.dp_sgd.fit", spy)
    model = make_private_compatible(build_model(ModelConfig(), DIGITS))
    cfg = TrainConfig(epochs=1, batch_size=16)
    stats, metrics = train_private(
        model, Examples(digits.x[:64], digits.y[:64]), cfg, PrivacyConfig(), CPU, RecordDict(), {}, seed=1
    )
    assert len(calls) == 1 and isinstance(calls[0], DpSgdSteps) and isinstance(calls[0].optimizer, DPOptimizer)
    assert stats.steps == metrics["dp-steps"] == 4


def test_federation_with_local_dp_reports_client_epsilon(tmp_path):
    cfg, raw = load_config("privacy=local privacy.report_exact=true federation.rounds=2 train.epochs=1")
    summary = run_federation(InProcessGrid(client_app, 3), cfg, raw, tmp_path)
    assert summary["status"] == "completed"
    with open(f"{summary['run_dir']}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["num_clients"] for r in rows] == [3, 3]
    assert 0 < rows[0]["train"]["dp-epsilon"] < rows[1]["train"]["dp-epsilon"]
    # the server summarises the clients' cumulative epsilons: largest and mean
    for row in rows:
        assert row["client_epsilon_max"] >= row["client_epsilon_mean"] - 1e-9 and row["client_epsilon_mean"] > 0
    assert rows[1]["client_epsilon_max"] > rows[0]["client_epsilon_max"]
    privacy = summary["privacy"]
    assert privacy["client_epsilon_max"] == pytest.approx(rows[-1]["client_epsilon_max"])
    assert privacy["mechanism"].startswith("local DP-SGD") and privacy["delta"] == cfg.privacy.delta


def test_resumed_run_and_restarted_node_keep_counting_their_clients_epsilon(tmp_path):
    """A resumed run starts every node with a fresh Context (and so would a restarted
    SuperNode): the server's record of each node's accountant history (checkpointed, sent
    back with the config) continues the count. Per-client epsilon equals an uninterrupted
    run's; without it, the resumed run would report two rounds' worth."""
    base = "privacy=local privacy.report_exact=true federation.rounds={} train.epochs=1"
    whole, _ = run_in_process(base.format(4) + " name=w", tmp_path)
    run_in_process(base.format(2) + " name=r", tmp_path)
    resumed, grid = run_in_process(base.format(4) + " name=r resume=auto", tmp_path)
    assert resumed["rounds_completed"] == 4
    for key in ("client_epsilon_max", "client_epsilon_mean"):
        assert resumed["privacy"][key] == pytest.approx(whole["privacy"][key], rel=1e-9), key
    history = grid.contexts[1000].state[ACCOUNTANT_STATE]  # seeded from the record, then round 3 and 4 added
    assert sum(history["steps"]) == 4 * int(
        json.loads(open(f"{whole['run_dir']}/metrics.jsonl").readline())["train"]["steps"]
    )


@pytest.mark.parametrize("strategy", ["fedavg", "fedbuff strategy.buffer_size=3"])
def test_a_node_that_lost_its_context_mid_run_continues_from_the_servers_record(tmp_path, strategy):
    overrides = f"strategy={strategy} privacy=local federation.rounds=3 train.epochs=1 name={{}}"
    whole, _ = run_in_process(overrides.format("w"), tmp_path)
    grid = InProcessGrid(client_app, 3)

    def restart_after_round_1(node_id: int, reply: Message) -> Message:
        if node_id == 1001 and reply.content["metrics"]["dp-steps"] == reply.content["metrics"]["steps"]:
            del grid.contexts[node_id].state[ACCOUNTANT_STATE]  # as if the SuperNode had restarted
        return reply

    grid.tamper = restart_after_round_1
    restarted, _ = run_in_process(overrides.format("r"), tmp_path, grid=grid)
    for key in ("client_epsilon_max", "client_epsilon_mean"):
        assert restarted["privacy"][key] == pytest.approx(whole["privacy"][key], rel=1e-9), key


def _history(context: Context) -> list[tuple[float, float, int]]:
    rec = context.state[ACCOUNTANT_STATE]
    return list(zip(rec["noise-multipliers"], rec["sample-rates"], rec["steps"], strict=True))


def _accountant_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """A fresh Opacus accountant over a whole history, independent of the code under test."""
    accountant = RDPAccountant()
    accountant.history = list(history)
    return accountant.get_epsilon(delta)


# --- issue 12 #8: histories are filed by the server's identity of a node and checked -----------


def test_a_forged_history_cannot_lower_another_nodes_epsilon_and_each_node_gets_only_its_own(tmp_path):
    """The issue's reproduction: node 1002 claims partition 0 and reports negative step counts.
    Before, the server filed that under partition 0 and sent every history to every node; after a
    resume, partition 0's node (a fresh Context) continued from it with negative steps. Now the
    forgery is refused and the victim's count is its own."""
    overrides = "privacy=local federation.rounds={} train.epochs=1 name=f"

    def forge(node_id: int, reply: Message) -> Message:
        metrics = reply.content["metrics"]
        if node_id == 1002 and not reply.has_error():
            metrics["partition-id"] = 0
            metrics["dp-history-steps"] = [-5000] * len(metrics["dp-history-steps"])
        return reply

    first = InProcessGrid(client_app, 3, tamper=forge)
    first.kill(1000)  # partition 0's node joins after the resume
    run_in_process(overrides.format(2), tmp_path, grid=first)
    summary, grid = run_in_process(overrides.format(3) + " resume=auto", tmp_path, tamper=forge)
    victim = _history(grid.contexts[1000])
    q = victim[0][1]
    per_round = round(32 / q) // 32  # train.batch_size=32: q = 32 / n, n // 32 steps a round
    assert victim == [(1.0, q, per_round)]  # one round, counted from zero: its own
    epsilons = summary["privacy"]["client_epsilon"]
    victim_epsilon = epsilons.get("partition-0", epsilons.get("node-1000"))  # the claim race decides the name
    assert victim_epsilon == pytest.approx(_accountant_epsilon(victim, 1e-5), rel=1e-9)
    assert min(epsilons.values()) > 0
    with open(f"{summary['run_dir']}/metrics.jsonl") as f:
        refused = [r for line in f for r in json.loads(line).get("dp_history_rejected", [])]
    assert {r["node_id"] for r in refused} == {1002} and "step count -5000" in refused[0]["reason"]
    for msg in grid.pushed:  # every training message carries its own node's history at most
        prior = json.loads(msg.content["config"].get(PRIOR_KEY, "{}"))
        own = {1000: {"partition-0", "node-1000"}, 1001: {"partition-1"}, 1002: set()}[msg.metadata.dst_node_id]
        assert set(prior) <= own


def test_a_resumed_simulation_sends_unknown_nodes_only_unclaimed_partitions_histories():
    ledger = HistoryBook(
        1e-5,
        {
            "histories": {"partition-0": [[1.0, 0.1, 10]], "partition-1": [[1.0, 0.1, 20]], "node-7": [[1.0, 0.2, 5]]},
            "owners": {"partition-0": 1000, "partition-1": 1001, "node-7": 7},
        },
    )

    def keys(node_id: int, partition: int | None, unbound: list[int], connected: tuple = ()) -> set[str]:
        return set(json.loads(ledger.prior(node_id, partition, unbound, connected).get(PRIOR_KEY, "{}")))

    assert keys(7, None, [0, 1]) == {"node-7"}  # a deployed node, same id as before: its own only
    assert keys(1000, None, [0, 1]) == {"partition-0"}  # the node that wrote it, before it replies again
    assert keys(5000, 0, [1]) == {"partition-0"}  # bound by its first reply
    assert keys(5000, None, [1]) == {"partition-1"}  # a new id (simulation): partitions nobody holds yet
    assert keys(5000, None, [0, 1], connected=(1001, 5000)) == {"partition-0"}  # 1001 is back: it takes its own
    assert keys(5000, None, []) == set()


@pytest.mark.parametrize(
    ("reported", "problem"),
    [
        ([[1.0, 0.1, -5]], "step count -5 is not an integer >= 0"),
        ([[1.0, 0.1, 2.5]], "step count 2.5 is not an integer"),
        ([[0.0, 0.1, 30]], "noise multiplier 0.0 is not a finite number > 0"),
        ([[float("nan"), 0.1, 30]], "noise multiplier nan"),
        ([[1.0, 1.5, 30]], "sample rate 1.5 is not in (0, 1]"),
        ([[1.0, 0.0, 30]], "sample rate 0.0 is not in (0, 1]"),
        ([[1.0, 0.1, 5]], "has 5 steps, fewer than the 10 recorded"),
        ([[2.0, 0.1, 50]], "(σ=1, q=0.1) with 10 recorded steps is missing"),
        ([[1.0, 0.1, 1]] * 300, "300 entries, more than 256"),
    ],
)
def test_the_server_keeps_only_wellformed_monotone_extensions(reported, problem):
    ledger = HistoryBook(1e-5, {"histories": {"partition-0": [[1.0, 0.1, 10]]}})
    columns = list(zip(*reported, strict=True))
    metrics = {
        k: list(c) for k, c in zip(("dp-history-sigma", "dp-history-q", "dp-history-steps"), columns, strict=True)
    }
    with pytest.raises(MalformedHistory, match=re.escape(problem)):
        ledger.record("partition-0", 1000, metrics)
    assert ledger.histories["partition-0"] == [(1.0, 0.1, 10)]  # the record stays
    extended = {"dp-history-sigma": [1.0, 2.0], "dp-history-q": [0.1, 0.1], "dp-history-steps": [12, 4]}
    ledger.record("partition-0", 1000, extended)  # more steps, and a new (σ, q) pair: kept
    assert ledger.epsilons()["partition-0"] == pytest.approx(_accountant_epsilon([(1.0, 0.1, 12), (2.0, 0.1, 4)], 1e-5))


def test_a_client_refuses_a_malformed_prior_from_the_server():
    cfg, _ = load_config("privacy=local train.epochs=1")
    forged = {PRIOR_KEY: json.dumps({"partition-0": [[1.0, 0.07, -5000]]})}
    with pytest.raises(MalformedHistory, match="dp-prior-history for partition-0 is malformed: step count -5000"):
        _train(cfg, context_for(0, 3), 1, forged)


# --- issue 12 #9: privacy.target_epsilon holds on the accountant's ε ------------------------------


def test_a_resume_with_more_rounds_keeps_the_accountants_epsilon_within_the_target():
    """Before, a resume with more federation.rounds planned σ for all of them from zero, while the
    steps already taken had used a smaller σ: the node ended past its target. Now σ spreads what is
    left over the steps left, and no step may take the accountant's ε past the target."""
    cfg, _ = load_config("privacy=local privacy.target_epsilon=2.0 train.epochs=1 seed=3")
    first = context_for(0, 3)
    planned = {"federation.rounds": 4}
    sigmas = [_train(cfg, first, rnd, planned).content["metrics"]["dp-noise-multiplier"] for rnd in (1, 2)]
    prior = {PRIOR_KEY: json.dumps({"partition-0": [list(e) for e in _history(first)]})}
    resumed = context_for(0, 3)  # a resumed run: a new Context, continued from the server's record
    later = [_train(cfg, resumed, rnd, {"federation.rounds": 8, **prior}).content["metrics"] for rnd in range(3, 9)]
    assert all(m["dp-noise-multiplier"] == later[0]["dp-noise-multiplier"] > sigmas[0] for m in later)
    epsilon = _accountant_epsilon(_history(resumed), cfg.privacy.delta)
    assert 2.0 - EPSILON_TOLERANCE <= epsilon <= 2.0
    assert later[-1]["dp-epsilon"] == pytest.approx(epsilon, rel=1e-12)
    with pytest.raises(PrivacyBudgetExhausted, match="all it planned"):
        _train(cfg, resumed, 9, {"federation.rounds": 8})


def test_affordable_steps_is_the_largest_count_within_the_target():
    history, sigma, q, delta = [(1.1, 0.05, 200)], 0.9, 0.05, 1e-5
    target = _accountant_epsilon([*history, (sigma, q, 150)], delta) - 1e-6  # 149 fit, 150 do not
    steps = affordable_steps(history, sigma, q, 1000, target, delta)
    assert steps == 149
    assert _accountant_epsilon([*history, (sigma, q, steps)], delta) <= target
    assert affordable_steps(history, sigma, q, 100, target, delta) == 100  # the round's own limit
    assert affordable_steps([(1.1, 0.05, 10**6)], sigma, q, 100, target, delta) == 0


# --- issue 12 #10: every reply's spending is counted, checkpointed and restored ---------------------


def test_fedbuff_counts_the_epsilon_of_replies_whose_update_was_rejected(tmp_path):
    """Before, only applied updates reached the privacy summary; a node whose every update is
    rejected had spent ε that no row or summary showed."""

    def reject(node_id: int, reply: Message) -> Message:
        if node_id == 1002 and not reply.has_error():
            reply.content["metrics"]["num-examples"] = -1  # screened out, every time
        return reply

    summary, grid = run_in_process(
        "strategy=fedbuff strategy.buffer_size=2 privacy=local federation.rounds=2 train.epochs=1",
        tmp_path,
        tamper=reject,
    )
    expected = {f"partition-{i}": _accountant_epsilon(_history(grid.contexts[1000 + i]), 1e-5) for i in range(3)}
    assert summary["privacy"]["client_epsilon"] == pytest.approx(expected, rel=1e-9)


def test_fedbuff_records_the_spending_of_tasks_still_out_when_it_stops(tmp_path):
    """Three nodes train at once and the run stops at version 2 (K = 1): the tasks still
    out have taken their DP-SGD steps, so the server waits for them and records them (a
    resumed run's nodes would otherwise continue from a record that misses those steps)."""
    summary, grid = run_in_process(
        "strategy=fedbuff strategy.buffer_size=1 privacy=local federation.rounds=2 train.epochs=1", tmp_path, workers=3
    )
    assert summary["fedbuff"]["tasks_sent"] >= 3
    expected = {f"partition-{i}": _accountant_epsilon(_history(grid.contexts[1000 + i]), 1e-5) for i in range(3)}
    assert summary["privacy"]["client_epsilon"] == pytest.approx(expected, rel=1e-9)


def test_per_client_epsilon_survives_a_resume_for_clients_that_do_not_come_back(tmp_path):
    base = "privacy=local federation.rounds={} train.epochs=1 name=r"
    _, grid = run_in_process(base.format(2), tmp_path)
    two_rounds = _accountant_epsilon(_history(grid.contexts[1002]), 1e-5)
    again = InProcessGrid(client_app, 3)
    again.kill(1002)  # partition 2 does not come back after the resume
    resumed, _ = run_in_process(base.format(3) + " resume=auto", tmp_path, grid=again)
    three_rounds = [_accountant_epsilon(_history(again.contexts[n]), 1e-5) for n in (1000, 1001)]
    assert resumed["privacy"]["client_epsilon_mean"] == pytest.approx((sum(three_rounds) + two_rounds) / 3, rel=1e-9)
    assert resumed["privacy"]["client_epsilon"]["partition-2"] == pytest.approx(two_rounds, rel=1e-9)


@pytest.mark.parametrize("privacy", ["local", "central"])
def test_a_crash_after_federated_evaluation_keeps_the_rounds_privacy_spending(tmp_path, monkeypatch, privacy):
    """Federated evaluation sends round 2's release to the clients before round 2's checkpoint; a
    crash in between must not lose that release (central) or those DP-SGD steps (local) on resume."""
    cfg, raw = load_config(
        f"privacy={privacy} federation.rounds=3 federation.fraction_evaluate=1.0 train.epochs=1 name=c"
    )
    evaluate = FederatedRun.central_eval
    calls = []

    def crash_in_round_2(self: FederatedRun, arrays: ArrayRecord) -> tuple[float, float]:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("server crashed")
        return evaluate(self, arrays)

    monkeypatch.setattr(FederatedRun, "central_eval", crash_in_round_2)
    grid = InProcessGrid(client_app, 3)
    with pytest.raises(RuntimeError, match="server crashed"):
        run_federation(grid, cfg, raw, tmp_path)
    ckpt = load_checkpoint(tmp_path / "c" / "checkpoint.pt")
    assert ckpt.round == 1  # round 2 is re-run on resume, its spending already counted
    if privacy == "central":
        assert ckpt.strategy_state["dp"]["releases"] == 2
    else:
        histories = ckpt.run_state["local_dp"]["histories"]
        assert histories == {f"partition-{i}": [list(e) for e in _history(grid.contexts[1000 + i])] for i in range(3)}
        per_round = _history(grid.contexts[1000])[0][2] // 2
        assert histories["partition-0"][0][2] == 2 * per_round


# --- issue 12 #11: what a local-DP reply says beside ε --------------------------------------------


def test_a_local_dp_reply_leaves_out_exact_train_metrics_unless_report_exact():
    exact = ("train-loss", "train-accuracy", "samples-per-s")
    cfg, _ = load_config("privacy=local train.epochs=1")
    metrics = _train(cfg, context_for(0, 3), 1).content["metrics"]
    assert not any(k in metrics for k in exact)
    assert metrics["num-examples"] > 0 and metrics["dp-epsilon"] > 0  # n is public (docs/privacy.md); ε is the point
    cfg, _ = load_config("privacy=local privacy.report_exact=true train.epochs=1")
    assert all(k in _train(cfg, context_for(0, 3), 1).content["metrics"] for k in exact)

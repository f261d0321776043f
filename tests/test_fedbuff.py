"""FedBuff: staleness weights, the bound, the buffer step against closed forms and
Flower's FedAvg, the robust buffer, and the strategy's message handling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from app.simulation.local_grid import InProcessGrid
from app.simulation.messages import make_reply
from strategies.coordinatewise import MedianRule
from strategies.fedbuff import FedBuff, InFlight, auto_buffer_size, server_step
from strategies.krum import KrumRule
from strategies.staleness import staleness_fn

CPU = torch.device("cpu")


# --- staleness functions ---------------------------------------------------------
def test_staleness_functions_equal_their_closed_forms():
    poly, const, hinge = staleness_fn("polynomial", a=0.5), staleness_fn("constant"), staleness_fn("hinge", 2.0, 3.0)
    for tau in range(12):
        assert poly(tau) == pytest.approx(1 / math.sqrt(1 + tau))
        assert const(tau) == 1.0
        assert hinge(tau) == pytest.approx(1.0 if tau <= 3 else 1 / (2.0 * (tau - 3) + 1))
    assert staleness_fn("polynomial", a=2.0)(3) == pytest.approx(1 / 16)


@pytest.mark.parametrize(
    "name, a, b, match",
    [("exponential", 0.5, 4, "unknown"), ("polynomial", -1, 4, "a >= 0"), ("hinge", 1, -1, "b >= 0")],
)
def test_bad_staleness_settings_are_refused(name, a, b, match):
    with pytest.raises(ValueError, match=match):
        staleness_fn(name, a, b)


def test_negative_staleness_is_a_bug_not_a_weight():
    with pytest.raises(ValueError, match="future model version"):
        staleness_fn("constant")(-1)


# --- helpers ------------------------------------------------------------------------
def _model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"w": rng.normal(size=(6, 5)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}


def _reply(message_id: str, node: int, arrays: dict[str, np.ndarray] | None, num_examples: int = 10) -> Message:
    """A reply to the task `message_id` sent to `node`; arrays=None gives an error reply."""
    if arrays is None:
        return make_reply(node, None, None, error="node gone", message_id=message_id, error_code=5)
    return make_reply(node, arrays, {"num-examples": num_examples}, message_id=message_id)


def _strategy(**kwargs) -> FedBuff:
    defaults = {"buffer_size": 3, "max_staleness": 2, "staleness": staleness_fn("polynomial", 0.5), "server_lr": 1.0}
    return FedBuff(**{**defaults, **kwargs})


def _record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def _at_versions(strategy: FedBuff, versions: dict[int, dict[str, np.ndarray]]) -> None:
    """Put the strategy at the highest version, with every listed version's model known."""
    for v in sorted(versions):
        strategy.set_model(_record(versions[v]), v)


def _send(strategy: FedBuff, message_id: str, node: int, version: int) -> None:
    strategy.in_flight[message_id] = InFlight(node, version, deadline=math.inf)


# --- the bound and the weights ----------------------------------------------------------
def test_updates_beyond_max_staleness_are_discarded_and_counted(rng):
    versions = {v: _model(rng) for v in (2, 3, 5)}
    s = _strategy(buffer_size=10, max_staleness=2)
    _at_versions(s, versions)  # current version 5
    _send(s, "a", 1, 5)  # tau 0
    _send(s, "b", 2, 3)  # tau 2: kept
    _send(s, "c", 3, 2)  # tau 3: discarded
    s.aggregate_train(5, [_reply(m, n, _model(rng), 8) for m, n in (("a", 1), ("b", 2), ("c", 3))])
    assert [(r.node_id, r.staleness) for r in s.buffer] == [(1, 0), (2, 2)]
    assert s.report.discarded_stale == s.discarded_total == 1
    assert [r.weight for r in s.buffer] == pytest.approx([8.0, 8.0 / math.sqrt(3)])
    assert s.buffer[1].base["w"].numpy().tobytes() == versions[3]["w"].tobytes()
    assert not s.in_flight  # every node is free again


def test_one_buffer_step_equals_the_closed_form(rng):
    versions = {v: _model(rng) for v in (4, 5, 6)}
    s = _strategy(buffer_size=3, max_staleness=5, server_lr=0.7)
    _at_versions(s, versions)
    sent = {"x": (11, 6, 20), "y": (12, 5, 10), "z": (13, 4, 30)}  # message: node, version, examples
    models = {m: _model(rng) for m in sent}
    for m, (node, version, _) in sent.items():
        _send(s, m, node, version)
    new, metrics = s.aggregate_train(6, [_reply(m, sent[m][0], models[m], sent[m][2]) for m in sent])
    assert (
        new is not None
        and s.version == 7
        and metrics["num-examples"] == pytest.approx(sum(n * (1 + 6 - v) ** -0.5 for _, v, n in sent.values()))
    )
    weights = {m: n * (1 + 6 - v) ** -0.5 for m, (_, v, n) in sent.items()}
    for key in ("w", "b"):
        mean_update = sum(weights[m] * (models[m][key] - versions[sent[m][1]][key]) for m in sent) / sum(
            weights.values()
        )
        expected = versions[6][key] + 0.7 * mean_update
        np.testing.assert_allclose(new[key].numpy(), expected, rtol=1e-5, atol=1e-6)
    assert [u["staleness"] for u in s.report.applied] == [0, 1, 2]
    assert not s.buffer


def test_server_momentum_equals_the_closed_form():
    g = {"w": torch.zeros(3)}
    d1, d2 = {"w": torch.tensor([1.0, 2.0, 3.0])}, {"w": torch.tensor([-1.0, 0.0, 1.0])}
    g1, v = server_step(g, d1, lr=0.5, momentum=0.9, velocity=None)
    g2, v = server_step(g1, d2, lr=0.5, momentum=0.9, velocity=v)
    torch.testing.assert_close(g1["w"], 0.5 * d1["w"])
    torch.testing.assert_close(v["w"], 0.9 * d1["w"] + d2["w"])
    torch.testing.assert_close(g2["w"], 0.5 * d1["w"] + 0.5 * (0.9 * d1["w"] + d2["w"]))


def test_integer_counters_take_the_plain_update_without_lr_or_momentum():
    """BatchNorm's num_batches_tracked: updates arrive as float (update_dtype), but a
    learning rate or momentum on a counter means nothing; it advances by the mean update."""
    g = {"n": torch.tensor(10, dtype=torch.int64), "w": torch.zeros(2)}
    d = {"n": torch.tensor(4.0, dtype=torch.float64), "w": torch.ones(2)}
    g1, v = server_step(g, d, lr=0.5, momentum=0.9, velocity=None)
    g2, v = server_step(g1, d, lr=0.5, momentum=0.9, velocity=v)
    assert g1["n"].dtype == torch.int64 and int(g1["n"]) == 14 and int(g2["n"]) == 18
    torch.testing.assert_close(g2["w"], torch.full((2,), 0.5 + 0.5 * 1.9))


def test_fresh_equal_weight_buffer_equals_flowers_fedavg(rng):
    """K fresh updates, constant staleness, η = 1: one FedBuff step is one FedAvg round."""
    start = _model(rng)
    s = _strategy(buffer_size=4, staleness=staleness_fn("constant"))
    _at_versions(s, {0: start})
    replies = []
    for i in range(4):
        _send(s, f"m{i}", 100 + i, 0)
        replies.append(_reply(f"m{i}", 100 + i, _model(rng), num_examples=5 + 7 * i))
    ours, _ = s.aggregate_train(0, replies)
    theirs, _ = FlowerFedAvg().aggregate_train(1, replies)
    for key in start:
        np.testing.assert_allclose(ours[key].numpy(), theirs[key].numpy(), rtol=1e-5, atol=1e-6)


# --- robust buffer ---------------------------------------------------------------------
def test_robust_buffer_works_on_updates_against_each_ones_own_version(rng):
    versions = {v: _model(rng) for v in (0, 1, 2)}
    s = _strategy(buffer_size=5, max_staleness=3, buffer_rule=MedianRule(num_byzantine=1))
    _at_versions(s, versions)
    sent = {f"m{i}": (10 + i, i % 3) for i in range(5)}
    models = {m: _model(rng) for m in sent}
    for m, (node, version) in sent.items():
        _send(s, m, node, version)
    new, _ = s.aggregate_train(2, [_reply(m, sent[m][0], models[m]) for m in sent])
    for key in ("w", "b"):
        updates = np.stack([models[m][key] - versions[sent[m][1]][key] for m in sent])
        np.testing.assert_allclose(
            new[key].numpy(), versions[2][key] + np.median(updates, axis=0), rtol=1e-5, atol=1e-6
        )


def test_krum_buffer_rejects_the_attacker_and_keeps_one_update_per_node(rng):
    start = _model(rng)
    s = _strategy(buffer_size=5, max_staleness=3, buffer_rule=KrumRule(num_byzantine=1))
    _at_versions(s, {0: start})
    honest = {k: v + 0.01 for k, v in start.items()}
    for i in range(4):  # node 10 answers twice before the buffer fills: only its newer update counts
        _send(s, f"h{i}", 10 + (i % 3), 0)
        s.receive(
            _reply(
                f"h{i}",
                10 + (i % 3),
                {k: v + rng.normal(scale=1e-3, size=v.shape).astype(np.float32) for k, v in honest.items()},
            )
        )
    assert sorted(r.node_id for r in s.buffer) == [10, 11, 12]
    _send(s, "evil", 66, 0)
    _send(s, "h5", 13, 0)
    new, _ = s.aggregate_train(
        0, [_reply("evil", 66, {k: v - 100.0 for k, v in start.items()}), _reply("h5", 13, honest)]
    )
    assert new is not None and 66 in s.report.robust["excluded"]
    np.testing.assert_allclose(new["w"].numpy(), honest["w"], atol=5e-3)


def test_robust_buffer_hands_its_rule_explicit_bases_and_leaves_the_rule_untouched(rng):
    """The rule gets the current model and each update's own version as arguments; FedBuff
    never writes the rule's fields (one rule object could serve any caller)."""
    seen = []

    class Recording(MedianRule):
        def aggregate(self, server_round, current, screened, bases):
            seen.append((current, [r.node_id for r in screened.valid], list(bases)))
            return super().aggregate(server_round, current, screened, bases)

    rule = Recording(num_byzantine=1)
    settings = dict(vars(rule))
    versions = {v: _model(rng) for v in (0, 1, 2)}
    s = _strategy(buffer_size=5, max_staleness=3, buffer_rule=rule)
    _at_versions(s, versions)
    sent = {f"m{i}": (10 + i, i % 3) for i in range(5)}
    for m, (node, version) in sent.items():
        _send(s, m, node, version)
    new, _ = s.aggregate_train(2, [_reply(m, node, _model(rng)) for m, (node, _) in sent.items()])
    assert new is not None and vars(rule) == settings
    ((current, nodes, bases),) = seen
    assert np.array_equal(current["w"].numpy(), versions[2]["w"])
    assert nodes == [node for node, _ in sent.values()]
    for base, (_, version) in zip(bases, sent.values(), strict=True):
        assert np.array_equal(base["w"].numpy(), versions[version]["w"])
    assert s.report.robust == {"selected": nodes, "excluded": [], "scores": {}, "policy": None}


def test_robust_buffer_smaller_than_the_rule_needs_is_refused():
    with pytest.raises(ValueError, match="2f\\+3"):
        _strategy(buffer_size=4, buffer_rule=KrumRule(num_byzantine=1))


# --- message handling ---------------------------------------------------------------------
def test_error_replies_free_the_node_and_count_as_failed(rng):
    s = _strategy()
    _at_versions(s, {0: _model(rng)})
    _send(s, "a", 7, 0)
    s.receive(_reply("a", 7, None))
    assert not s.in_flight and not s.buffer and s.report.failed[0].node_id == 7


def test_invalid_replies_are_rejected_not_buffered(rng):
    s = _strategy()
    _at_versions(s, {0: _model(rng)})
    bad = _model(rng)
    bad["w"][0, 0] = np.nan
    _send(s, "a", 7, 0)
    _send(s, "b", 8, 0)
    s.aggregate_train(0, [_reply("a", 7, bad), _reply("b", 8, {"w": bad["w"][:2]})])
    assert not s.buffer and [r.node_id for r in s.report.rejected] == [7, 8]


def test_unanswered_tasks_are_given_up_at_their_deadline(rng):
    s = _strategy()
    _at_versions(s, {0: _model(rng)})
    s.in_flight["a"] = InFlight(7, 0, deadline=10.0)
    s.expire(now=9.0)
    assert "a" in s.in_flight
    s.expire(now=11.0)
    assert not s.in_flight and "TTL" in s.report.failed[0].reason


def test_configure_train_fills_idle_nodes_up_to_the_concurrency(rng):
    grid = InProcessGrid(lambda msg, ctx: msg, num_nodes=5)
    s = _strategy(concurrency=3)
    _at_versions(s, {0: _model(rng)})
    _send(s, "busy", 1001, 0)
    messages = list(s.configure_train(0, s.arrays, ConfigRecord({"k": 1}), grid))
    assert len(messages) == 2 and 1001 not in {m.metadata.dst_node_id for m in messages}
    assert all(m.metadata.ttl == s.limits.message_ttl_s for m in messages)
    tasks = [m.content["config"]["task"] for m in messages]
    assert len(set(tasks)) == 2 and all(m.content["config"]["server-round"] == 0 for m in messages)


def test_which_node_gets_which_task_number_ignores_the_global_random(rng):
    """The task number seeds the node's training, so it must follow the strategy's seeded
    sampler, not the global `random` that Flower's heartbeat thread draws from on its own time."""
    import random

    grid = InProcessGrid(lambda msg, ctx: msg, num_nodes=6)
    runs = []
    for extra_draws in (0, 5):
        s = _strategy()
        s.sampler.seed(3)
        _at_versions(s, {0: _model(rng)})
        for _ in range(extra_draws):
            random.random()
        runs.append(
            [
                (m.metadata.dst_node_id, m.content["config"]["task"])
                for m in s.configure_train(0, s.arrays, ConfigRecord(), grid)
            ]
        )
    assert runs[0] == runs[1] and len(runs[0]) == 6


def test_a_node_that_joins_later_gets_work_on_the_next_pass(rng):
    grid = InProcessGrid(lambda msg, ctx: msg, num_nodes=2)
    s = _strategy()
    _at_versions(s, {0: _model(rng)})
    for i, msg in enumerate(s.configure_train(0, s.arrays, ConfigRecord(), grid)):
        _send(s, f"m{i}", msg.metadata.dst_node_id, 0)
    assert not list(s.configure_train(0, s.arrays, ConfigRecord(), grid))  # both nodes busy
    grid.contexts[2000] = grid.contexts[1000]  # a SuperNode connects mid-run
    assert [m.metadata.dst_node_id for m in s.configure_train(0, s.arrays, ConfigRecord(), grid)] == [2000]


def test_models_no_task_can_use_are_dropped(rng):
    s = _strategy(buffer_size=1, max_staleness=1)
    _at_versions(s, {0: _model(rng)})
    _send(s, "old", 1, 0)
    for i in range(3):
        _send(s, f"n{i}", 2, s.version)
        s.aggregate_train(s.version, [_reply(f"n{i}", 2, _model(rng))])
    assert s.version == 3 and set(s._models) == {3}  # version 0 is 3 stale > 1: not kept for "old"
    s.receive(_reply("old", 1, _model(rng)))
    assert s.discarded_total == 1


# --- the buffer's size K -------------------------------------------------------------
@pytest.mark.parametrize(
    ("cohort", "k"), [(1, 1), (2, 1), (3, 2), (5, 3), (8, 4), (10, 5), (19, 10), (20, 10), (1000, 10)]
)
def test_auto_k_is_half_the_nodes_training_at_once_rounded_up_at_most_ten(cohort: int, k: int) -> None:
    assert auto_buffer_size(cohort) == k


def test_auto_k_meets_a_robust_rules_minimum() -> None:
    krum = KrumRule(num_byzantine=2)  # n >= 2f + 3 = 7
    assert auto_buffer_size(8, krum) == 7 and auto_buffer_size(30, krum) == 10
    assert auto_buffer_size(4, krum) == 7  # more than 4 can give: node_count_problem refuses it
    s = _strategy(buffer_size=0, buffer_rule=krum)
    assert s.size_buffer(4) == 7 and "only 4 nodes train at once" in s.node_count_problem(4)


def test_auto_k_follows_the_concurrency_is_chosen_once_and_survives_a_resume(caplog) -> None:
    s = _strategy(buffer_size=0, concurrency=6)
    with caplog.at_level("INFO"):
        assert s.size_buffer(40) == 3  # half of the 6 training at once, not of the 40 connected
    assert "buffer K=3 chosen for 6 nodes training at once" in caplog.text
    assert s.size_buffer(2) == 3  # chosen once
    resumed = _strategy(buffer_size=0)
    resumed.load_state_dict(s.state_dict())
    assert resumed.size_buffer(100) == 3  # the run's K, not one for today's nodes
    explicit = _strategy(buffer_size=4)
    explicit.load_state_dict(s.state_dict())
    assert explicit.size_buffer(100) == 4  # an explicit K is the user's


def test_an_explicit_k_at_or_above_the_nodes_is_warned_about(caplog) -> None:
    with caplog.at_level("WARNING"):
        assert _strategy(buffer_size=10).size_buffer(5) == 10
    assert "strategy.buffer_size=10 >= the 5 nodes training at once" in caplog.text and "would choose 3" in caplog.text

"""Issue 32 #1: the server accepts a local-DP accountant history only if it matches what it prescribed,
nothing a node sends raises out of the accounting, a poisoned checkpoint does not stop a resume, and a
256-entry history costs the server a sum of cached RDP vectors, not seconds of Opacus."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
from flwr.app import Message, MetricRecord
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as opacus_rdp

from app.config.schema import PrivacyConfig
from app.privacy.accounting import (
    MAX_HISTORY_ENTRIES,
    Allowance,
    HistoryBook,
    MalformedHistory,
    Prescription,
    epsilon,
    history_rdp,
    step_rdp,
)
from app.privacy.dp_sgd import ACCOUNTANT_STATE
from app.run.checkpoint import load_checkpoint, save_checkpoint
from app.run.privacy import LocalPrivacy
from app.tools.in_process import run_in_process
from strategies.partitions import PartitionBinding
from strategies.replies import InvalidReply

LOG = "flwr.fedgpu"
DELTA = 1e-5
POISON = 1e-300  # σ² underflows to 0: Opacus's RDP divides by it (ZeroDivisionError before issue 32)
HISTORY_KEYS = ("dp-history-sigma", "dp-history-q", "dp-history-steps")
FAST = "model.width=8 train.batch_size=128"  # in-process federations: 3 DP-SGD steps a round on a small CNN


def _columns(history: list[tuple[float, float, int]]) -> dict[str, list]:
    return {k: [e[i] for e in history] for i, k in enumerate(HISTORY_KEYS)}


def _reply(history: list[tuple[float, float, int]], partition: int | None = None) -> MetricRecord:
    metrics: dict = {"num-examples": 100, **_columns(history)}
    if partition is not None:
        metrics["partition-id"] = partition
    return MetricRecord(metrics)


def _accountant_epsilon(history: list[tuple[float, float, int]], delta: float = DELTA) -> float:
    """A fresh Opacus accountant over a whole history, independent of the code under test."""
    accountant = RDPAccountant()
    accountant.history = list(history)
    return accountant.get_epsilon(delta)


def _context_history(context) -> list[tuple[float, float, int]]:  # noqa: ANN001 - a Flower Context
    rec = context.state[ACCOUNTANT_STATE]
    return list(zip(rec["noise-multipliers"], rec["sample-rates"], rec["steps"], strict=True))


def _rows(summary: dict) -> list[dict]:
    with open(f"{summary['run_dir']}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


# Simulation: 3 partitions of 600, 500 and 400 training examples, batch 32, one epoch: the server knows each q.
SIZES = {0: 600, 1: 500, 2: 400}
FIXED = Prescription(noise_multiplier=1.0, target_epsilon=0.0, batch_size=32, epochs=1, max_examples=10_000)


def _local(prescription: Prescription = FIXED, state: dict | None = None) -> tuple[LocalPrivacy, object]:
    """LocalPrivacy as run_privacy builds it, around a weight cap like example_cap's (binds the claim,
    returns the partition's training size)."""
    partitions = PartitionBinding(3)
    local = LocalPrivacy(PrivacyConfig(name="local"), partitions, state, prescription)

    def example_cap(node: int, metrics: MetricRecord, kind: str) -> float:
        partition = partitions.bind(node, metrics.get("partition-id"))
        return prescription.max_examples if partition is None else min(prescription.max_examples, SIZES[partition])

    return local, local.screening(example_cap)


def _honest(partition: int, rounds: int = 1, sigma: float = 1.0) -> list[tuple[float, float, int]]:
    n = SIZES[partition]
    return [(sigma, min(1.0, 32 / n), rounds * (n // 32))]


# --- (a) a history Opacus cannot account is refused, never raised ---------------------------------------


def test_an_unaccountable_history_is_refused_not_raised_and_the_record_stays():
    """Before: [(1e-300, q, 1)] passed the checks (finite, > 0) and every later ε raised ZeroDivisionError."""
    ledger = HistoryBook(DELTA, {"histories": {"partition-0": [[1.0, 0.05, 10]]}})
    for sigma, q in [(POISON, 0.05), (1e200, 0.05)]:
        with pytest.raises(MalformedHistory, match="cannot be accounted"):
            ledger.record("partition-0", 1000, _columns([(1.0, 0.05, 10), (sigma, q, 1)]))
    assert ledger.histories["partition-0"] == [(1.0, 0.05, 10)]
    assert ledger.epsilons()["partition-0"] == _accountant_epsilon([(1.0, 0.05, 10)])
    # σ in the range a target_epsilon plan allows, ε still not computable: refused the same way
    planned = HistoryBook(DELTA, prescription=Prescription(0.0, 8.0, 32, 1, 10_000))
    with pytest.raises(MalformedHistory, match="cannot be accounted: .*ZeroDivisionError"):
        planned.record("node-7", 7, _columns([(POISON, 32 / 400, 1)]), Allowance(400, tasks=1))


def test_a_poisoned_reply_is_rejected_with_its_reason_and_honest_epsilons_stand(caplog):
    local, cap = _local()
    nodes = {1000: 0, 1001: 1, 1002: 2}
    for node in nodes:
        local.prior(node, set(nodes))
    replies = [(n, _reply(_honest(p), p)) for n, p in nodes.items() if n != 1002]
    replies.append((1002, _reply([(POISON, 32 / 400, 1)], 2)))
    with caplog.at_level(logging.WARNING, logger=LOG):
        for node, metrics in replies[:2]:
            assert cap(node, metrics, "train") == SIZES[nodes[node]]
        with pytest.raises(InvalidReply, match="local-DP accountant history refused: .*σ=1e-300"):
            cap(1002, replies[2][1], "train")
        local.record_spending(replies)
    assert "node 1002: local-DP accountant history for partition-2 refused" in caplog.text
    row = local.row()
    assert [r["node_id"] for r in row["dp_history_rejected"]] == [1002]
    assert local.ledger.epsilons() == {
        f"partition-{p}": _accountant_epsilon(_honest(p)) for p in (0, 1)
    }  # the poisoned node has none; the honest ones are exact
    assert row["client_epsilon_max"] == max(local.ledger.epsilons().values())


def test_a_node_sending_a_poisoned_history_is_rejected_and_the_run_goes_on(tmp_path, caplog):
    """The issue's reproduction, end to end: before, the server's ε raised ZeroDivisionError in round 1."""

    def poison(node_id: int, reply: Message) -> Message:
        if node_id == 1002 and not reply.has_error():
            metrics = reply.content["metrics"]
            for key, column in _columns([(POISON, metrics["dp-history-q"][0], 1)]).items():
                metrics[key] = column
        return reply

    with caplog.at_level(logging.WARNING, logger=LOG):
        summary, grid = run_in_process(
            "privacy=local privacy.report_exact=true federation.rounds=2 train.epochs=1 " + FAST,
            tmp_path,
            tamper=poison,
        )
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    rows = _rows(summary)
    assert [r["num_clients"] for r in rows] == [2, 2]  # its update is not aggregated either
    for row in rows:
        (rejected,) = row["rejected"]
        assert rejected["node_id"] == 1002 and "local-DP accountant history refused" in rejected["reason"]
        (refused,) = row["dp_history_rejected"]
        assert refused["node_id"] == 1002 and "σ=1e-300" in refused["reason"]
    assert re.search(r"rejected reply from partition 2 \(node 1002\): local-DP accountant history refused", caplog.text)
    expected = {f"partition-{i}": _accountant_epsilon(_context_history(grid.contexts[1000 + i])) for i in (0, 1)}
    assert summary["privacy"]["client_epsilon"] == pytest.approx(expected, rel=1e-12)


# --- (b) a checkpoint written before the check -------------------------------------------------------------


def test_a_checkpointed_poisoned_history_loads_with_the_entry_dropped_and_logged(caplog):
    state = {
        "histories": {
            "partition-0": [[1.0, 0.05, 10], [POISON, 0.05, 1]],
            "partition-1": [[1.0, 0.08, 6]],
            "partition-2": "junk",
            "node-9": [[1e200, 0.5, 3]],
        },
        "owners": {"partition-0": 1000, "partition-1": 1001, "node-9": "x"},
    }
    with caplog.at_level(logging.WARNING, logger=LOG):
        ledger = HistoryBook(DELTA, state)
    assert ledger.histories == {"partition-0": [(1.0, 0.05, 10)], "partition-1": [(1.0, 0.08, 6)]}
    assert ledger.owners == {"partition-0": 1000, "partition-1": 1001}
    assert "local-DP history of partition-0: entry [1e-300, 0.05, 1] dropped: " in caplog.text
    assert "local-DP history of node-9: entry [1e+200, 0.5, 3] dropped" in caplog.text
    assert "local-DP history of partition-2 is not a list" in caplog.text
    assert ledger.epsilons() == {
        "partition-0": _accountant_epsilon([(1.0, 0.05, 10)]),
        "partition-1": _accountant_epsilon([(1.0, 0.08, 6)]),
    }


def test_resume_from_a_poisoned_checkpoint_completes(tmp_path, caplog):
    """Before, the poisoned record was restored as it was and the resumed run's first row raised again:
    resume=auto crashed on every attempt, long after the attacker had left."""
    base = "privacy=local federation.rounds={} train.epochs=1 name=p " + FAST
    first, _ = run_in_process(base.format(1), tmp_path)
    path = tmp_path / "p" / "checkpoint.pt"
    ckpt = load_checkpoint(path)
    histories = ckpt.run_state["local_dp"]["histories"]
    honest = [list(e) for e in histories["partition-2"]]
    histories["partition-2"] = [*honest, [POISON, honest[0][1], 1]]
    save_checkpoint(path, ckpt)
    with caplog.at_level(logging.WARNING, logger=LOG):
        resumed, grid = run_in_process(base.format(2) + " resume=auto", tmp_path)
    assert resumed["status"] == "completed" and resumed["rounds_completed"] == 2
    assert re.search(r"local-DP history of partition-2: entry \[1e-300, .*\] dropped", caplog.text)
    expected = {f"partition-{i}": _accountant_epsilon(_context_history(grid.contexts[1000 + i])) for i in range(3)}
    assert resumed["privacy"]["client_epsilon"] == pytest.approx(expected, rel=1e-12)
    assert _context_history(grid.contexts[1002]) == [(honest[0][0], honest[0][1], 2 * honest[0][2])]  # continued


# --- (c) only what the server prescribed ----------------------------------------------------------------


def _refused(local: LocalPrivacy, cap, node: int, metrics: MetricRecord, reason: str) -> None:  # noqa: ANN001
    with pytest.raises(InvalidReply, match=reason):
        cap(node, metrics, "train")
    local.record_spending([(node, metrics)])
    assert re.search(reason, local.row()["dp_history_rejected"][-1]["reason"])


def test_a_noise_multiplier_other_than_the_prescribed_one_is_refused():
    local, cap = _local()
    local.prior(1000, ())
    _refused(local, cap, 1000, _reply(_honest(0, sigma=0.5), 0), r"σ=0.5, but privacy.noise_multiplier=1.0")
    cap(1000, _reply(_honest(0), 0), "train")  # the prescribed σ passes
    # under privacy.target_epsilon σ is planned: any σ up to 100, but never ε past the target
    target = Prescription(0.0, 2.0, 32, 1, 10_000)
    local, cap = _local(target)
    local.prior(1000, ())
    _refused(local, cap, 1000, _reply(_honest(0, sigma=150.0), 0), r"σ=150.0 is not in \(0, 100\]")
    _refused(local, cap, 1000, _reply(_honest(0, sigma=0.3), 0), r"its ε \d.* exceeds privacy.target_epsilon=2")
    local.prior(1000, ())  # (the refusal above used up the first task's new pair)
    cap(1000, _reply(_honest(0, sigma=3.0), 0), "train")


def test_a_sample_rate_other_than_the_prescribed_one_is_refused():
    local, cap = _local()
    local.prior(1000, ())
    # simulation: partition 0 has 600 training examples, so q >= 32 / 600; a smaller q claims more data
    _refused(local, cap, 1000, _reply([(1.0, 32 / 6000, 18)], 0), r"q=0.00533.* below train.batch_size / 600")
    cap(1000, _reply([(1.0, 32 / 600, 18)], 0), "train")
    # deployment (no partition): q = 32 / n for a whole n <= federation.max_examples_per_node
    local.prior(7, ())
    _refused(local, cap, 7, _reply([(1.0, 32 / 20_000, 1)]), r"below train.batch_size / 10000: more than the 10000")
    _refused(local, cap, 7, _reply([(1.0, 0.3, 1)]), r"q=0.3 is not train.batch_size=32 / n for a whole number")
    cap(7, _reply([(1.0, 32 / 9_999, 1)]), "train")


def test_more_steps_or_pairs_than_the_tasks_sent_allow_are_refused():
    local, cap = _local()
    _refused(local, cap, 1001, _reply(_honest(1), 1), r"no training task was sent to this node in this run")
    local.prior(1001, ())
    _refused(local, cap, 1001, _reply(_honest(1, rounds=2), 1), r"30 more DP-SGD steps \(0 before\), more than")
    two_sigmas = [(1.0, 32 / 500, 15), (2.0, 32 / 500, 15)]
    _refused(local, cap, 1001, _reply(two_sigmas, 1), r"2 \(σ, q\) pair\(s\) gained steps")
    local.record_spending([(1001, _reply(_honest(1), 1))])  # one task: one round's steps
    assert local.ledger.histories["partition-1"] == _honest(1)
    local.prior(1001, ())
    local.prior(1001, ())  # the reply to this one is lost: the next reply carries both tasks' steps
    cap(1001, _reply(_honest(1, rounds=3), 1), "train")
    local.record_spending([(1001, _reply(_honest(1, rounds=3), 1))])
    assert local.ledger.histories["partition-1"] == _honest(1, rounds=3)
    assert "dp_history_rejected" not in local.row()
    local.prior(1001, ())
    _refused(local, cap, 1001, _reply(_honest(1, rounds=5), 1), r"30 more DP-SGD steps \(45 before\)")


def test_a_refused_history_whose_rdp_was_computed_still_uses_up_the_nodes_new_pairs():
    """Under a target σ is free in (0, 100]: a node sending a new σ every time, each refused for its ε,
    can make the server compute at most one new (σ, q) RDP per task it was sent, not one per entry."""
    local, cap = _local(Prescription(0.0, 2.0, 32, 1, 10_000))
    local.prior(1000, ())
    local.record_spending([(1000, _reply(_honest(0, sigma=0.3), 0))])  # computed, refused for its ε
    assert "exceeds privacy.target_epsilon" in local.row()["dp_history_rejected"][0]["reason"]
    _refused(local, cap, 1000, _reply(_honest(0, sigma=3.0), 0), r"1 \(σ, q\) pair\(s\) gained steps \(1 before\)")
    local.prior(1000, ())
    local.record_spending([(1000, _reply(_honest(0, sigma=3.0), 0))])  # the next task: accepted
    assert local.ledger.histories["partition-0"] == _honest(0, sigma=3.0)


# --- (d) cost: one RDP computation per new (σ, q), one sum per changed history ------------------------------


def test_a_changed_history_costs_no_new_rdp_computation_and_unchanged_ones_nothing(monkeypatch):
    """Before: every changed 256-entry history recomputed all its 256 entries' RDP (~5 s of Opacus each)."""
    calls = {"rdp": 0, "spent": 0}
    fake_rdp = np.linspace(0.01, 2.0, len(RDPAccountant.DEFAULT_ALPHAS))

    def compute_rdp(*, q: float, noise_multiplier: float, steps: int, orders: list) -> np.ndarray:
        calls["rdp"] += 1
        return fake_rdp * (q / noise_multiplier) * steps

    spent = opacus_rdp.get_privacy_spent

    def get_privacy_spent(**kwargs: object) -> tuple[float, float]:
        calls["spent"] += 1
        return spent(**kwargs)

    monkeypatch.setattr(opacus_rdp, "compute_rdp", compute_rdp)
    monkeypatch.setattr(opacus_rdp, "get_privacy_spent", get_privacy_spent)
    step_rdp.cache_clear()
    nodes, entries = 12, MAX_HISTORY_ENTRIES
    histories = {
        f"node-{i}": [(1.0 + j / 1000, 32 / (1000 + 13 * j + i), 10) for j in range(entries)] for i in range(nodes)
    }
    ledger = HistoryBook(DELTA)
    for key, history in histories.items():
        ledger.record(key, int(key[5:]), _columns(history))
    first = ledger.epsilons()
    assert calls["rdp"] == nodes * entries  # each (σ, q) pair once
    calls.update(rdp=0, spent=0)
    assert ledger.epsilons() == first and calls == {"rdp": 0, "spent": 0}  # nothing changed: nothing computed
    grown = histories["node-3"]
    grown[-1] = (*grown[-1][:2], grown[-1][2] + 7)
    ledger.record("node-3", 3, _columns(grown))
    after = ledger.epsilons()
    assert calls["rdp"] == 0 and calls["spent"] == 1  # one history summed again, from cached vectors
    assert after["node-3"] > first["node-3"] and {k: v for k, v in after.items() if k != "node-3"} == {
        k: v for k, v in first.items() if k != "node-3"
    }
    ledger.record("node-99", 99, _columns([histories["node-4"][0], (3.0, 0.5, 1)]))
    ledger.epsilons()
    assert calls["rdp"] == 1  # one new (σ, q) pair: one computation; the other is node-4's, cached
    step_rdp.cache_clear()


# --- (e) the cached ε is Opacus's -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "history",
    [
        [(1.0, 32 / 600, 18)],
        [(1.1, 0.05, 200), (0.9, 0.05, 150), (1.1, 0.08, 7), (4.0, 1.0, 3)],
        [(0.7, 32 / 1797, 10**6), (1.3, 0.5, 1)],
    ],
)
def test_the_cached_epsilon_is_exactly_opacus_rdp_accountants(history):
    step_rdp.cache_clear()
    expected = _accountant_epsilon(history)
    assert epsilon(history, DELTA) == expected  # exactly, not approximately: same vectors, same sum order
    assert epsilon(history, DELTA) == expected  # and again from the cache
    for sigma, q, steps in history:
        assert np.array_equal(
            step_rdp(sigma, q) * steps,
            opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=RDPAccountant.DEFAULT_ALPHAS),
        )
    assert np.array_equal(history_rdp(history[:1]), step_rdp(*history[0][:2]) * history[0][2])


def test_the_servers_checks_accept_every_honest_history_of_a_real_run(tmp_path):
    """The prescription is what the ClientApp really does: no honest reply of a run with lost
    replies (FedBuff, two nodes training twice before a version) is refused."""
    summary, grid = run_in_process(
        "strategy=fedbuff strategy.buffer_size=2 privacy=local federation.rounds=3 train.epochs=1 " + FAST,
        tmp_path,
        workers=3,
    )
    assert all("dp_history_rejected" not in row for row in _rows(summary))
    expected = {f"partition-{i}": _accountant_epsilon(_context_history(grid.contexts[1000 + i])) for i in range(3)}
    assert summary["privacy"]["client_epsilon"] == pytest.approx(expected, rel=1e-12)

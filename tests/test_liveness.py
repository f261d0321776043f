"""Liveness (`federation.stall_rounds`, strategies/liveness.py): a run in which no update is applied
for that many rounds (FedBuff: versions' worth of replies) stops with a stop reason that says what
became of the replies and what to try, its checkpoint holding the last applied model."""

from __future__ import annotations

import math
import threading
from collections import Counter

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from app.config.compose import load_config
from app.config.schema import ConfigError
from app.run.checkpoint import load_checkpoint
from app.run.results import read_rows, read_summary
from app.simulation.messages import make_reply
from app.tools.in_process import run_in_process
from strategies.fedbuff import FedBuff, InFlight
from strategies.liveness import FAILED, NON_FINITE, NORM_BOUND, Stalled, StallWatch, stall_reason, tally
from strategies.staleness import staleness_fn


def test_outcomes_are_told_apart_by_their_reasons():
    reasons = [
        "net.0.weight: non-finite values (NaN or Inf)",
        "the step would make the model non-finite",
        "update norm 3e+36 is over strategy.norm_bound=10 x ...",
        "error reply (code 0): boom",
        "no reply before the message TTL",
        "'num-examples' missing",
    ]
    assert tally(reasons, stale=2, missing=0) == Counter(
        {NON_FINITE: 2, NORM_BOUND: 1, FAILED: 2, "too stale": 2, "rejected otherwise": 1}
    )


def test_rounds_without_an_update_stop_the_run_after_stall_rounds_and_an_applied_one_resets():
    watch = StallWatch(3, last=4)
    watch.round_ended(5, False, Counter({NON_FINITE: 5}))
    watch.round_ended(6, True, Counter())  # applied: counting starts again
    watch.round_ended(7, False, Counter({NON_FINITE: 5}))
    watch.round_ended(8, False, Counter({FAILED: 1, NON_FINITE: 4}))
    with pytest.raises(Stalled) as stop:
        watch.round_ended(9, False, Counter())  # nothing to tell: still a round without an update
    text = str(stop.value)
    assert text.startswith("stalled: no update applied for 3 rounds (federation.stall_rounds=3)")
    assert "replies since round 6: 9 non-finite, 1 failed, 1 not applied" in text
    assert "strategy.norm_bound" in text and "The checkpoint holds the last applied model (round 6)" in text
    assert "resume=auto" not in text  # an exploded model: resuming it cannot help


def test_off_never_stops_and_the_advice_follows_the_main_outcome():
    watch = StallWatch(0)
    for rnd in range(1, 100):
        watch.round_ended(rnd, False, Counter({FAILED: 1}))
    bound = stall_reason(2, "version", 3, Counter({NORM_BOUND: 8, FAILED: 1}))
    assert "raise it (0 turns it off)" in bound and "resume=auto continues from it" in bound
    assert "read their errors" in stall_reason(2, "round", 0, Counter({FAILED: 3}))


def test_the_key_defaults_to_five_and_refuses_a_negative_count():
    cfg, _ = load_config("")
    assert cfg.federation.stall_rounds == 5
    with pytest.raises(ConfigError, match="federation.stall_rounds"):
        load_config("federation.stall_rounds=-1")


def test_fedbuff_stalls_after_stall_versions_times_k_replies_without_a_version():
    rng = np.random.default_rng(0)
    s = FedBuff(buffer_size=2, staleness=staleness_fn("constant"), stall_versions=2)
    s.set_model(ArrayRecord({"w": Array(rng.normal(size=(3,)).astype(np.float32))}), 6)
    for i in range(4):
        assert s.stall() is None
        s.in_flight[f"m{i}"] = InFlight(1 + i % 2, 6, deadline=math.inf)
        bad = {"w": np.full((3,), np.nan, dtype=np.float32)}
        s.aggregate_train(6, [make_reply(1 + i % 2, bad, {"num-examples": 5}, message_id=f"m{i}")])
    why = s.stall()
    assert why is not None and "no update applied for 2 versions" in why and "since version 6: 4 non-finite" in why


# --- whole runs: an exploded model and no norm bound ------------------------------------------
NODES = 4
EXPLODE = (
    "attack=scale attack.scale=1e37 attack.num_malicious=1 seed=7 train.epochs=1 ledger=off strategy.norm_bound=0 "
    "federation.stall_rounds=2 federation.rounds=12 name=stall"
)


def _stalled_run(tmp_path, overrides: str, workers: int) -> tuple[BaseException | None, dict, list[dict]]:
    """The run in a thread (a hang detector only: before the stall rule FedBuff never ended)."""
    out: dict = {}

    def target() -> None:
        try:
            run_in_process(overrides, tmp_path, nodes=NODES, workers=workers)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err
        out["done"] = True

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=900)
    assert out.get("done"), "the run did not end"
    return out.get("error"), read_summary(tmp_path / "stall") or {}, read_rows(tmp_path / "stall")


@pytest.mark.parametrize("strategy", ["fedavg", "fedbuff"])
def test_a_run_whose_model_exploded_stops_with_a_reason_and_keeps_its_checkpoint(tmp_path, strategy):
    """Without the norm bound the 1e37 update is applied: the model stays finite but its loss is
    NaN, and every later reply is non-finite. FedAvg would idle to its last round, FedBuff never
    end; both stop after 2 steps without an update, saying why and what to try."""
    error, summary, rows = _stalled_run(tmp_path, f"strategy={strategy} {EXPLODE}", workers=2)
    assert isinstance(error, Stalled)
    assert summary["status"] == "stopped" and summary["stop_reason"] == str(error)
    assert summary["stop_reason"].startswith("stalled: no update applied for 2 ") and "non-finite" in str(error)
    assert "strategy.norm_bound on" in str(error)
    applied = [r["round"] for r in rows if r.get("model_updated", True) and (r.get("applied") or r.get("num_clients"))]
    last = applied[-1]
    assert f"last applied model ({'version' if strategy == 'fedbuff' else 'round'} {last})" in str(error)
    assert any(r["accuracy"] is not None and r["loss"] is None for r in rows)  # evaluated, NaN loss: it exploded
    assert load_checkpoint(tmp_path / "stall" / "checkpoint.pt").round == rows[-1]["round"]
    assert rows[-1]["round"] < 12

"""Text a node supplies (an error reply's reason, its metric names) is escaped before it is
logged or stored: a newline cannot forge a server log line, a terminal escape cannot reach
the supervisor's output (issue 32, finding 6)."""

from __future__ import annotations

import logging
import math
import unicodedata

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, RecordDict

from app.run.arrivals import ReplyFacts
from app.run.ledger_entries import round_nodes
from app.simulation.messages import make_reply
from app.tools.supervise import follow
from strategies.fedavg import FedAvg
from strategies.fedbuff import FedBuff, InFlight
from strategies.node_text import MAX_NODE_TEXT, printable
from strategies.replies import screen_replies, specs_of
from strategies.staleness import staleness_fn

FORGED = "CUDA out of memory\n[round 9/10] accuracy 0.9999  loss 0.0001\x1b[2J\x1b]0;owned\x07\u202eevil"


def _controls(text: str) -> list[str]:
    return [ch for ch in text if unicodedata.category(ch)[0] == "C"]


def _no_controls_logged(caplog: pytest.LogCaptureFixture) -> None:
    messages = [r.getMessage() for r in caplog.records]
    assert messages, "nothing was logged"
    for message in messages:
        assert not _controls(message), f"control characters reached the log: {message!r}"


def test_printable_escapes_every_control_and_format_character_and_bounds_the_length():
    assert printable("a\nb\r\x1b[31mc\u202ed\x00") == "a\\nb\\r\\x1b[31mc\\u202ed\\x00"
    assert printable("plain text, é and ü stay") == "plain text, é and ü stay"
    long = printable("x" * (MAX_NODE_TEXT + 7))
    assert long.startswith("x" * MAX_NODE_TEXT) and long.endswith("(7 more characters)")
    assert printable("y" * 10_000, limit=None) == "y" * 10_000


def test_an_error_reason_is_escaped_in_the_rejection_and_the_log(caplog, model_arrays):
    specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    with caplog.at_level(logging.WARNING):
        screened = screen_replies([make_reply(4, None, None, error=FORGED)], specs)
    (rejection,) = screened.rejected
    assert not _controls(rejection.reason) and "\\n[round 9/10]" in rejection.reason
    _no_controls_logged(caplog)


def test_a_metric_name_with_control_characters_is_refused_escaped(caplog, model_arrays):
    specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    bad = make_reply(5, model_arrays, {"num-examples": 3, "loss\n[round 9] forged": 0.1})
    long = make_reply(6, model_arrays, {"num-examples": 3, "m" * 101: 0.1})
    good = make_reply(7, model_arrays, {"num-examples": 3, "train-loss": 0.1})
    with caplog.at_level(logging.WARNING):
        screened = screen_replies([bad, long, good], specs)
    assert [r.node_id for r in screened.valid] == [7]
    reasons = {r.node_id: r.reason for r in screened.rejected}
    assert "metric name" in reasons[5] and not _controls(reasons[5])
    assert "metric name" in reasons[6]
    _no_controls_logged(caplog)


def test_fedbuff_escapes_a_failed_tasks_reason(caplog):
    s = FedBuff(buffer_size=2, max_staleness=2, staleness=staleness_fn("constant", 0.5), server_lr=1.0)
    s.in_flight["a"] = InFlight(7, 0, deadline=math.inf)
    with caplog.at_level(logging.WARNING):
        s.receive(make_reply(7, None, None, error=FORGED, message_id="a", error_code=5))
    (failed,) = s.report.failed
    assert not _controls(failed.reason)
    _no_controls_logged(caplog)


def test_the_ledger_records_an_error_reason_escaped(model_arrays):
    strategy = FedAvg()
    strategy._specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    task = Message(RecordDict(), dst_node_id=3, message_type="train")
    task.metadata.__dict__["_message_id"] = "m3"
    reply = make_reply(3, None, None, error=FORGED)
    strategy.aggregate_train(1, [reply])
    (record,) = round_nodes([task], [ReplyFacts.of(reply, digest=True)], strategy.train_report, "fedavg")
    assert record["outcome"].startswith("failed") and not _controls(record["outcome"])


def test_the_supervisor_echoes_log_lines_without_terminal_escapes():
    class FakeFlwr:
        def logs(self, run_id: str) -> str:
            return "INFO : [round 1] ok\nWARNING : node 4 \x1b]0;owned\x07\x1b[2Jgone\n"

        def status(self, run_id: str) -> str:
            return "finished:completed"

    echoed: list[str] = []
    assert follow(FakeFlwr(), "1", stall_timeout_s=60, poll_s=0, echo=echoed.append) == "completed"  # type: ignore[arg-type]
    assert echoed[0] == "INFO : [round 1] ok"
    assert all(not _controls(line) for line in echoed) and "\\x1b]0;owned" in echoed[1]


def test_honest_replies_are_unchanged_by_the_checks(model_arrays):
    """Plain metric names and reasons pass as they are."""
    specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    reply = make_reply(8, model_arrays, {"num-examples": 3, "train-loss": 0.5, "gpu-util.mean": 40.0})
    screened = screen_replies([reply, make_reply(9, None, None, error="CUDA out of memory")], specs)
    assert [r.node_id for r in screened.valid] == [8]
    assert screened.rejected[0].reason == "error reply (code 0): CUDA out of memory"
    np.testing.assert_array_equal(screened.valid[0].arrays["fc.weight"], model_arrays["fc.weight"])

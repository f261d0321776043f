"""Runs that recover themselves (docs/deployment.md): the same `resume=auto` command continues a
run, and on a finished run says "already complete" and succeeds."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.run.results import read_rows
from app.tools.in_process import run_in_process

FAST = "train.epochs=1 seed=2 name=exp1 resume=auto"


def test_resume_auto_on_a_completed_run_is_a_successful_no_op(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, _ = run_in_process(FAST + " federation.rounds=2", tmp_path)
    model = Path(first["final_model"]).read_bytes()
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu"):
        again, grid = run_in_process(FAST + " federation.rounds=2", tmp_path)
    assert again == first and "run 'exp1' already complete" in caplog.text
    assert not [m for m in grid.pushed if m.metadata.message_type == "train"]  # nothing was sent
    assert len(read_rows(first["run_dir"])) == 2 and Path(first["final_model"]).read_bytes() == model
    more, _ = run_in_process(FAST + " federation.rounds=3", tmp_path)  # asked for more: it continues
    assert more["rounds_completed"] == 3 and [r["round"] for r in read_rows(more["run_dir"])] == [1, 2, 3]


def _grid_killing(node: int, after_replies: int, nodes: int = 2, revive_after_s: float | None = None):  # noqa: ANN202
    """An in-process grid whose `node` vanishes once the server has pulled `after_replies`
    replies (and, with `revive_after_s`, comes back that much later)."""
    import threading

    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid

    class Grid(InProcessGrid):
        pulled = 0

        def pull_messages(self, message_ids):  # noqa: ANN001, ANN202
            replies = list(super().pull_messages(message_ids))
            before, Grid.pulled = Grid.pulled, Grid.pulled + len(replies)
            if before < after_replies <= Grid.pulled:
                self.kill(node)
                if revive_after_s is not None:
                    threading.Timer(revive_after_s, self.dead.discard, args=(node,)).start()
            return replies

    return Grid(client_app, nodes)


def test_a_lost_node_stops_the_run_cleanly_after_the_bounded_wait_and_resume_finishes_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two nodes, both needed (the defaults): node 1001 vanishes after round 1. Round 2 waits
    federation.round_wait_timeout_s, then the run stops, naming the setting, resumable; once the
    node is back, the same command finishes the run."""
    from app.run.results import read_summary
    from strategies.node_wait import TooFewNodes

    grid = _grid_killing(1001, after_replies=2)
    overrides = FAST + " federation.rounds=3 federation.round_wait_timeout_s=1"
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu"), pytest.raises(TooFewNodes) as err:
        run_in_process(overrides, tmp_path, grid=grid)
    assert "federation.round_wait_timeout_s=1" in str(err.value) and "missing [1001]" in str(err.value)
    assert "waiting up to" in caplog.text  # the wait is logged with whom it waits for
    summary = read_summary(tmp_path / "exp1")
    assert summary["status"] == "stopped" and summary["stop_reason"] == str(err.value)
    assert [r["round"] for r in read_rows(tmp_path / "exp1")] == [1]
    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid

    done, _ = run_in_process(overrides, tmp_path, grid=InProcessGrid(client_app, 2))  # the node is back
    assert done["status"] == "completed" and [r["round"] for r in read_rows(done["run_dir"])] == [1, 2, 3]


def test_a_round_goes_on_with_the_nodes_left_when_that_is_enough(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    grid = _grid_killing(1002, after_replies=3, nodes=3)
    overrides = FAST + " federation.rounds=2 federation.min_available_nodes=3 federation.round_wait_timeout_s=1"
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu"):
        summary, _ = run_in_process(overrides, tmp_path, grid=grid)
    rows = read_rows(summary["run_dir"])
    assert summary["status"] == "completed" and [r["num_sampled"] for r in rows] == [3, 2]
    assert "going on with the 2 connected" in caplog.text and "missing [1002]" in caplog.text


def test_a_node_back_within_the_wait_rejoins(tmp_path: Path) -> None:
    grid = _grid_killing(1001, after_replies=2, revive_after_s=1.0)
    summary, _ = run_in_process(FAST + " federation.rounds=2 federation.round_wait_timeout_s=60", tmp_path, grid=grid)
    assert [r["num_clients"] for r in read_rows(summary["run_dir"])] == [2, 2]


def test_fedbuff_without_nodes_stops_after_the_bounded_wait(tmp_path: Path) -> None:
    from strategies.node_wait import TooFewNodes

    grid = _grid_killing(1000, after_replies=1, nodes=1)
    overrides = (
        "strategy=fedbuff strategy.buffer_size=2 train.epochs=1 federation.rounds=5 federation.min_available_nodes=1"
    )
    overrides += " federation.min_train_nodes=1 federation.round_wait_timeout_s=1"
    with pytest.raises(TooFewNodes, match="no server update for .* no node connected"):
        run_in_process(overrides, tmp_path, grid=grid)

"""Runs that recover themselves (docs/deployment.md): the same `resume=auto` command continues a
run, and on a finished run says "already complete" and succeeds."""

from __future__ import annotations

import logging
import time
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
    assert "federation.round_wait_timeout_s=1" in str(err.value) and "missing [partition 1 (node 1001)]" in str(
        err.value
    )
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
    assert "going on with the 2 connected" in caplog.text and "missing [partition 2 (node 1002)]" in caplog.text


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


class FakeFlwr:
    """Scripted answers of the flwr CLI: each submitted run has a list of (status, log) states."""

    problem = ""  # Flwr's: what the last failed command said

    def __init__(self, runs: list[list[tuple[str, str]]]) -> None:
        self.runs, self.submitted, self.stopped = runs, [], []
        self.states: dict[str, list[tuple[str, str]]] = {}

    def submit(self, run_config: str, federation_config: str | None) -> tuple[str | None, str]:
        run_id = str(len(self.submitted) + 1)
        self.submitted.append(run_config)
        self.states[run_id] = list(self.runs[len(self.submitted) - 1])
        return run_id, f"Successfully started run {run_id}"

    def _now(self, run_id: str) -> tuple[str, str]:
        states = self.states[run_id]
        return states.pop(0) if len(states) > 1 else states[0]

    def status(self, run_id: str) -> str:
        return self._current[0]

    def logs(self, run_id: str) -> str:
        self._current = self._now(run_id)
        return self._current[1]

    def stop(self, run_id: str) -> None:
        self.stopped.append(run_id)


def test_the_supervisor_resubmits_a_failed_or_silent_run_and_stops_it_first() -> None:
    from app.tools.supervise import supervise

    flwr = FakeFlwr(
        [
            [("running", "[round 1/3]\n"), ("finished:failed", "[round 1/3]\nKilled\n")],  # the ServerApp died
            [("running", "[round 2/3]\n")],  # a silent one: the log never grows again
            [("running", "resuming\n"), ("finished:completed", "resuming\n[round 3/3]\nrun completed\n")],
        ]
    )
    lines: list[str] = []
    attempts = supervise(flwr, "name=exp1 federation.rounds=3", stall_timeout_s=0.3, poll_s=0.05, echo=lines.append)
    assert [a.outcome.split(":")[0] for a in attempts] == ["failed", "stalled", "completed"]
    assert flwr.stopped == ["1", "2"]  # each given-up run is stopped before the next submission
    assert all("resume=auto" in c and "name=exp1" in c for c in flwr.submitted)
    assert "[round 3/3]" in lines and lines.count("[round 1/3]") == 1  # each new log line echoed once


def test_the_supervisor_gives_up_after_its_retries_and_ends_on_already_complete() -> None:
    from app.tools.supervise import ALREADY_COMPLETE, supervise

    failing = [[("finished:failed", "boom\n")]] * 3
    attempts = supervise(FakeFlwr(failing), "name=x", retries=2, poll_s=0.01, echo=lambda _: None)
    assert len(attempts) == 3 and all(a.outcome.startswith("failed") for a in attempts)
    done = FakeFlwr([[("finished:completed", "run 'x' already complete (stop reason: rounds)\n")]])
    (attempt,) = supervise(done, "name=x", poll_s=0.01, echo=lambda _: None)
    assert attempt.outcome == ALREADY_COMPLETE
    with pytest.raises(ValueError, match="give the run a name"):
        supervise(done, "federation.rounds=3")


def test_a_killed_serverapp_is_stopped_and_resubmitted_until_the_run_completes(tmp_path: Path) -> None:
    """`flwr run` in simulation under the supervisor; the ServerApp (Flower's flwr-simulation
    process) is SIGKILLed after round 2. The supervisor stops the stale run, submits again, and
    the run ends with each round once in metrics.jsonl and the very model an uninterrupted run
    makes (in process, for the same config).
    Supervising it again says "already complete"."""
    import threading

    import torch

    from app.run.results import read_summary
    from app.tools.processes import kill_matching, stop_processes
    from app.tools.supervise import ALREADY_COMPLETE, Flwr, supervise
    from app.tools.sweep import flower_env

    home, out = tmp_path / "flwr-home", tmp_path / "runs"
    # A fleet (on the virtual clock) puts replies in a canonical order, so the aggregation sums
    # are the same in every run whatever node ids Flower draws: the models can be compared bit by bit.
    overrides = "name=exp1 federation.rounds=5 train.epochs=1 train.deterministic=true seed=7 fleet=fixed"
    flwr = Flwr(None, flower_env(home))
    killed: list[int] = []

    def kill_after_round_two() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(read_rows(out / "exp1")) < 2:
            time.sleep(0.5)
        killed.extend(kill_matching(str(home), "flwr-simulation"))

    killer = threading.Thread(target=kill_after_round_two, daemon=True)
    killer.start()
    try:
        fed = "num-supernodes=2 client-resources-num-cpus=1"
        attempts = supervise(
            flwr, overrides, output_dir=str(out), federation_config=fed, stall_timeout_s=60, echo=lambda _: None
        )
        killer.join(timeout=5)
        again = supervise(flwr, overrides, output_dir=str(out), federation_config=fed, echo=lambda _: None)
    finally:
        stop_processes(str(home), grace_s=10)
    assert killed, "the ServerApp was never killed"
    assert len(attempts) == 2 and attempts[0].outcome.split(":")[0] in ("failed", "stalled"), attempts
    assert attempts[1].outcome == "completed" and [a.outcome for a in again] == [ALREADY_COMPLETE]
    assert [r["round"] for r in read_rows(out / "exp1")] == [1, 2, 3, 4, 5]
    summary = read_summary(out / "exp1")
    assert summary["status"] == "completed" and summary["rounds_completed"] == 5
    reference, _ = run_in_process(overrides.replace("name=exp1", "name=ref"), tmp_path / "ref", nodes=2)
    got = torch.load(summary["final_model"], weights_only=True)
    want = torch.load(reference["final_model"], weights_only=True)
    assert all(torch.equal(got[k], want[k]) for k in want), "the resumed run's model is not the uninterrupted one's"

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

"""(slow) The shortened soak (bench/soak.py's QUICK plan) on the local secure stack: a run under
the supervisor (`fedgpu-run`) with central DP survives a killed SuperNode, a killed SuperLink
(restarted by `up`, which brings the node back too) and a killed ServerApp, and ends with
every round once in metrics.jsonl, a ledger that verifies, and the ε of an uninterrupted run
(also recomputed from the checkpoint's accountant history by Google's dp_accounting). The
full soak (30 rounds, 5 nodes, 8 kills): `python bench/soak.py`, figures in docs/testing.md."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import load_script

soak = load_script("soak", "bench")


def test_a_supervised_run_survives_killed_nodes_serverapp_and_superlink(tmp_path: Path) -> None:
    for tool in ("flower-superlink", "flower-supernode", "flower-superexec", "flwr"):
        if shutil.which(tool) is None:
            pytest.fail(f"`{tool}` is not on PATH: pip install -e '.[test]'")
    result = soak.Soak(soak.QUICK, tmp_path / "state", echo=print).run()
    shown = json.dumps({k: v for k, v in result.items() if k != "round_first_seen_s"}, indent=1, default=str)
    assert "error" not in result and result["supervisor_exit"] == 0, shown
    assert result["rounds"]["seen_once"], shown
    assert result["ledger"]["ok"], shown
    eps = result["epsilon"]
    assert eps["ok"] and eps["releases"] == soak.QUICK.rounds, shown
    assert eps["summary"] == pytest.approx(eps["uninterrupted"], rel=1e-12), shown
    assert eps["summary"] == pytest.approx(eps["independent"], rel=1e-9), shown
    for kind in ("node", "serverapp", "superlink"):
        assert result["recoveries"][kind]["fired"] and result["recoveries"][kind]["recovered"] == 1, shown
    # The ServerApp and SuperLink kills each cost the supervisor an attempt; the last one completed.
    attempts = result["supervisor"]
    assert len(attempts) >= 3 and attempts[-1]["outcome"] == "completed", shown
    assert result["ok"], shown

"""secagg=plus end to end through real Flower processes: SecAgg+ (app/secagg/) with ten
simulated nodes under `flwr run`, a node dropping out mid-protocol on the virtual clock, and
a SuperNode killed mid-run in the secure loopback deployment (scripts/local_deployment.py).

Each round's metrics.jsonl row carries a `secagg` column (app/run/rows.py `secure_row`):
`survivors` (the nodes whose masked input is in the sum), `dropped` (node -> "<stage>: <why>"),
`aborted` (None, or why nothing was unmasked) and the two sums' sha256.

Simulation (tests/test_flwr_cli.py's pattern: a private FLWR_HOME and ports, the SuperLink
and everything it started stopped after the module). Deployment (tests/test_superlink_loopback.py's
pattern: `up` and `down` run as a user runs them; TLS, SuperNode authentication, the Runtime
API locked). Timeouts below are hang detectors sized for a loaded 2-core machine, not speed checks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.tools.processes import free_ports, processes_under
from tests.test_flwr_cli import flwr_env, flwr_run, run_status  # noqa: F401 - flwr_env is a fixture
from tests.test_superlink_loopback import LoopbackFederation, tail, wait_until

ROOT = Path(__file__).resolve().parents[1]
NODES = 10
FEDERATION = f"num-supernodes={NODES} client-resources-num-cpus=1"
SHA256 = re.compile(r"[0-9a-f]{64}")
RUN_TIMEOUT_S = 900  # a 10-node secure run: ~1-3 min idle on 2 cores; a hang detector
TRAIN_STAGE = "train.secagg"  # app/protocol.py SECAGG_TRAIN


def flwr_run_secagg(env: dict[str, str], out_dir: Path, overrides: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`flwr run . --stream` with `overrides` on NODES simulated nodes; checks Flower's verdict
    (`finished:completed`: `--stream` exits 0 even when the ServerApp failed) and returns the
    run's summary.json and metrics.jsonl rows."""
    code, out, run_id = flwr_run(env, out_dir, overrides, federation=FEDERATION, timeout_s=RUN_TIMEOUT_S)
    assert code == 0 and run_id, out[-4000:]
    status = run_status(env, run_id)
    assert status["status"] == "finished:completed", f"{status}\n{out[-4000:]}"
    (summary_path,) = out_dir.rglob("summary.json")
    rows = [json.loads(line) for line in (summary_path.parent / "metrics.jsonl").read_text().splitlines()]
    return json.loads(summary_path.read_text()), rows


def _check_sums(secagg: dict[str, Any]) -> None:
    """A round that unmasked: both sums hashed, nothing aborted."""
    assert secagg["aborted"] is None, secagg
    assert SHA256.fullmatch(secagg["masked_sum_sha256"] or ""), secagg
    assert SHA256.fullmatch(secagg["sum_sha256"] or ""), secagg


# ----------------------------------------------------------------------------- simulation


def test_flwr_run_secagg_with_ten_nodes_learns_and_goes_on_without_a_node_that_drops_out_mid_protocol(
    flwr_env: dict[str, str],  # noqa: F811 - the imported fixture
    tmp_path: Path,
) -> None:
    """Ten nodes, every round a full SecAgg+ round (k = 9, t = 7 by default), one `flwr run`.
    `stragglers.dropout` (the short form of a fleet profile: app/simulation/fleet.py) puts the
    run on the virtual clock (app/simulation/virtual_clock.py), which fails each task it schedules
    with that probability, part way, with an error reply and without running it: every SecAgg+
    stage is such a task, the training stage `train.secagg` included. The draw is fixed by
    (seed, partition, the partition's task count); seed=109 with dropout 0.05 fails exactly one
    task in two rounds, partition 5's round-1 training task (worked out offline from the clock's
    draw: a seed whose only failures are training tasks, so every dropped node is outside the
    sum). That round still unmasks the sum of the other nine; the other sums all ten; the same
    ten nodes are sampled each round, each round's sum is new, and the model learns the digits
    (chance is 0.1)."""
    overrides = (
        "secagg=plus federation.rounds=2 train.epochs=3 stragglers=fixed stragglers.factors=[1] "
        "stragglers.dropout=0.05 seed=109 train.lr_schedule=constant"
    )  # constant: two rounds that must learn (the default cosine takes round 2 at 0.3 x lr)
    summary, rows = flwr_run_secagg(flwr_env, tmp_path / "runs", overrides)
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2, summary
    assert [r["round"] for r in rows] == [1, 2], rows
    nodes = {int(n) for n in summary["fleet"]["partition_of_node"]}
    assert len(nodes) == NODES, summary["fleet"]
    for row in rows:
        secagg = row["secagg"]
        _check_sums(secagg)
        survivors, dropped = set(secagg["survivors"]), {int(n): why for n, why in secagg["dropped"].items()}
        assert survivors | set(dropped) == nodes and not survivors & set(dropped), secagg
        assert len(secagg["survivors"]) == NODES - len(dropped), secagg
        assert row["num_sampled"] == NODES, row
        assert row["model_updated"] is True and row["train"]["secagg-survivors"] == len(survivors), row
        for why in dropped.values():
            assert why.startswith(f"{TRAIN_STAGE}: error reply:") and "fleet.completion_p" in why, secagg
    dropped_rounds = [r for r in rows if r["secagg"]["dropped"]]
    assert len(dropped_rounds) == 1, (
        "not exactly one round with a node dropped out at train.secagg: the virtual clock's draw changed; pick "
        "another seed whose only failed tasks are training tasks"
    )
    for row in dropped_rounds:
        for node in row["secagg"]["dropped"]:
            assert node in {str(r["node_id"]) for r in row["rejected"]}, row["rejected"]  # named there too
    (full,) = [r for r in rows if not r["secagg"]["dropped"]]
    assert full["num_clients"] == NODES and len(full["secagg"]["survivors"]) == NODES, full
    assert len({r["secagg"]["sum_sha256"] for r in rows}) == 2  # a new sum each round
    assert summary["final_accuracy"] > 0.3, summary  # chance is 0.1 (10 digit classes)


# ----------------------------------------------------------------------------- deployment


def _local_deployment(command: str, state: Path, *args: str, home: Path, cwd: Path) -> str:
    """`python scripts/local_deployment.py COMMAND --state-dir STATE ...` as a user runs it, with
    HOME at `home`; its output (the test fails on a non-zero exit)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "local_deployment.py"), command, "--state-dir", str(state), *args],
        env={**os.environ, "HOME": str(home)}, cwd=cwd, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"local_deployment.py {command} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


def test_secure_deployment_secagg_run_finishes_after_a_supernode_is_killed(tmp_path: Path) -> None:
    """Four SuperNodes on the secure loopback stack, secagg=plus with t = 3. Node 3's SuperNode
    (with its SuperExec and ClientApps: its session) is SIGKILLed, by the process id `up`
    recorded, once round 1's row is written. Its next stage task is given up (the SuperLink's
    NODE_UNAVAILABLE error once two 30 s heartbeats are missed, or the round timeout): it leaves
    round 2 at whatever stage it had reached, or is no longer in the cohort; the other three still
    meet t = 3 in every neighbourhood, so round 2 unmasks their sum, without it."""
    if not Path("/proc/self/stat").is_file():
        pytest.skip("scripts/local_deployment.py finds and stops its processes through /proc (Linux only)")
    for tool in ("flower-superlink", "flower-supernode", "flwr"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            pytest.fail(f"`{tool}` is not on PATH: pip install -e '.[test]'")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    state = home / "fedgpu-local"
    up = _local_deployment("up", state, "--nodes", "4", "--port", str(free_ports(1)[0]), home=home, cwd=work)
    fed = LoopbackFederation.load(state)
    killed = 3
    try:
        assert "nodes online: 4 of 4" in up, up
        # round_timeout_s bounds each stage's wait (a hang detector for live nodes' fresh ClientApp
        # processes on loaded cores; the dead node's task usually ends sooner, with the SuperLink's
        # error); round_wait_timeout_s bounds the wait for the 4 nodes min_available_nodes asks for.
        run = fed.submit(
            "secagg=plus secagg.threshold=3 federation.rounds=2 train.epochs=1 federation.min_available_nodes=4 "
            "federation.round_timeout_s=240 federation.round_wait_timeout_s=30",
            out_root=tmp_path / "results",
        )
        seen = wait_until(run.metrics, 600.0, "round 1 in metrics.jsonl", interval=0.5)
        pid = fed.pids[f"node-{killed}"]
        assert fed.running()[f"node-{killed}"], f"node-{killed} (pid {pid}) is not the process `up` started"
        fed.kill_node(killed)  # os.killpg(pid, SIGKILL), then whatever of its session is left
        summary = run.wait(timeout=900)
        log = tail(run.log, 10**6)
    finally:
        down = _local_deployment("down", state, home=home, cwd=work)

    assert "stopped everything" in down and not processes_under(str(state)), down
    assert len(seen) == 1, f"the node died only after round {len(seen)}"
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2, summary
    rows = run.metrics()
    assert [r["round"] for r in rows] == [1, 2], rows
    dead, live = fed.node_ids[killed], {n for i, n in enumerate(fed.node_ids) if i != killed}
    assert len(live) == 3 and dead not in live, fed.node_ids
    first = rows[0]["secagg"]
    _check_sums(first)
    assert set(first["survivors"]) == live | {dead} and first["dropped"] == {}, first
    for row in rows[1:]:
        secagg = row["secagg"]
        _check_sums(secagg)
        assert set(secagg["survivors"]) == live, (row["round"], secagg)
        assert row["model_updated"] is True and row["train"]["secagg-survivors"] == 3, row
        # in the cohort and dropped at some stage, or not sampled at all (marked offline by then)
        if str(dead) in secagg["dropped"]:
            assert row["num_sampled"] == 4, row
        else:
            assert row["num_sampled"] == 3 and secagg["dropped"] == {}, row
    assert str(dead) in rows[1]["secagg"]["dropped"] or rows[1]["num_sampled"] == 3, rows[1]
    assert "secure aggregation: round aborted" not in log, log[-3000:]

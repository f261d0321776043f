"""A real two-level deployment on loopback (topology=regions; docs/deployment.md, "Regions
(two-level deployment)"), brought up and down by scripts/local_deployment.py as a user does it:
a global SuperLink with its SuperExec and two aggregator SuperNodes, and two regions, each a
SuperLink with its SuperExec and two site SuperNodes, every level with its own CA, SuperExec
secret and node keys. Each global round, each aggregator runs its region's one-round sub-run
through the regional SuperLink's Control API (app/regions/aggregator.py) and replies with the
region's model and weight.

One site is killed (by the process id `up` recorded) once the global round 1 is written: the
region's bounded waits carry its sub-runs on with the site left, and the global run finishes its
three rounds. Timeouts are hang detectors sized for a loaded 2-core machine (a round here is two
sub-runs of two fresh ClientApp processes each, plus the ServerApps: minutes), not speed checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.tools.processes import free_ports, processes_under
from tests.test_superlink_loopback import LoopbackFederation, tail, wait_until

ROOT = Path(__file__).resolve().parents[1]
REGIONS, SITES, ROUNDS = 2, 2, 3
KILLED_REGION, KILLED_SITE = 0, 1
# The region's own overrides (the aggregators' node config): a region goes on with one site, and
# waits at most 60 s for a missing one.
REGION_OVERRIDES = "federation.min_available_nodes=1 federation.min_train_nodes=1 federation.round_wait_timeout_s=60"
SCRIPT_TIMEOUT_S = 900  # `up` of 12 processes with their keys registered: ~3 min idle on 2 cores


def _local_deployment(command: str, state: Path, *args: str, home: Path, cwd: Path) -> str:
    """`python scripts/local_deployment.py COMMAND --state-dir STATE ...` as a user runs it, with
    HOME at `home` and one torch thread per process (six processes train or evaluate at once on
    two cores); its output (the test fails on a non-zero exit)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "local_deployment.py"), command, "--state-dir", str(state), *args],
        env={**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1"}, cwd=cwd, capture_output=True, text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"local_deployment.py {command} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


def _sub_runs(state: Path, region: int, run_id: str) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    """Global round -> (summary.json, its one row) of region `region`'s sub-run for that round."""
    found = {}
    for summary in sorted(
        (state / f"region-{region}" / "runs").glob(f"region-{region}-run{run_id}-round*/summary.json")
    ):
        rnd = int(summary.parent.name.split("-round")[1].split("-")[0])
        assert rnd not in found, f"two sub-runs of region {region} for round {rnd}"
        rows = [json.loads(line) for line in (summary.parent / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 1, rows
        found[rnd] = (json.loads(summary.read_text()), rows[0])
    return found


def test_two_regions_of_two_sites_finish_three_rounds_with_a_site_killed_in_round_2(tmp_path: Path) -> None:
    if not Path("/proc/self/stat").is_file():
        pytest.skip("scripts/local_deployment.py finds and stops its processes through /proc (Linux only)")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    state = home / "fedgpu-local"
    args = ["--regions", str(REGIONS), "--nodes-per-region", str(SITES), "--port", str(free_ports(1)[0])]
    up = _local_deployment("up", state, *args, "--region-overrides", REGION_OVERRIDES, home=home, cwd=work)
    top = LoopbackFederation.load(state)
    region = LoopbackFederation.load(state / f"region-{KILLED_REGION}")
    try:
        stacks = up.split("\nregion ")  # `status`: the global stack, then one block per region
        assert len(stacks) == 1 + REGIONS and f"nodes online: {REGIONS} of {REGIONS}" in stacks[0], up
        assert all(f"nodes online: {SITES} of {SITES}" in block for block in stacks[1:]), up
        # separate credentials per level: each stack its own CA and SuperExec secret
        cas = {(state / d / "creds" / "ca.crt").read_bytes() for d in (".", "region-0", "region-1")}
        secrets = {(state / d / "creds" / "superexec.secret").read_bytes() for d in (".", "region-0", "region-1")}
        assert len(cas) == len(secrets) == 1 + REGIONS
        run = top.submit(
            f"topology=regions topology.regions={REGIONS} federation.rounds={ROUNDS} train.epochs=1 federation.round_timeout_s=900",
            out_root=tmp_path / "results",
        )
        seen = wait_until(run.metrics, 1200.0, "global round 1 in metrics.jsonl", interval=1.0)
        assert region.running()[f"node-{KILLED_SITE}"], "the site to kill is not the process `up` started"
        region.kill_node(KILLED_SITE)  # os.killpg(its pid, SIGKILL), then whatever of its session is left
        summary = run.wait(timeout=2400)
        log = tail(run.log, 10**6)
    finally:
        down = _local_deployment("down", state, home=home, cwd=work)

    assert "stopped everything" in down and not processes_under(str(state)), down
    assert len(seen) == 1, f"the site died only after round {len(seen)}"
    assert summary["status"] == "completed" and summary["rounds_completed"] == ROUNDS, summary
    rows = run.metrics()
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1)), rows
    subs = [_sub_runs(state, r, run.run_id) for r in range(REGIONS)]
    assert all(sorted(s) == list(range(1, ROUNDS + 1)) for s in subs), [sorted(s) for s in subs]
    for row in rows:
        k = row["round"]
        # both regions answered every round; each counts for its sites' capped examples, uncut
        assert row["num_clients"] == REGIONS and row["rejected"] == [] and row["capped_weights"] == [], row
        assert row["model_updated"] is True, row
        parts = [subs[r][k] for r in range(REGIONS)]
        assert all(s["status"] == "completed" and sub["model_updated"] for s, sub in parts), parts
        weights = [sub["train"]["num-examples"] for _, sub in parts]
        nodes = [sub["num_clients"] for _, sub in parts]
        assert row["train"]["num-examples"] == pytest.approx(sum(weights)), (row["train"], weights)
        mean_nodes = sum(w * n for w, n in zip(weights, nodes, strict=True)) / sum(weights)
        assert row["train"]["region-nodes"] == pytest.approx(mean_nodes), (row["train"], nodes)
    # the region that lost a site: both sites in round 1, the survivor alone from round 3 on
    lost = [subs[KILLED_REGION][k][1]["num_clients"] for k in range(1, ROUNDS + 1)]
    assert lost[0] == SITES and lost[1] in (SITES - 1, SITES) and lost[2] == SITES - 1, lost
    whole = [subs[1 - KILLED_REGION][k][1]["num_clients"] for k in range(1, ROUNDS + 1)]
    assert whole == [SITES] * ROUNDS, whole
    assert subs[KILLED_REGION][3][1]["train"]["num-examples"] < subs[KILLED_REGION][1][1]["train"]["num-examples"]
    assert "Traceback" not in log, log[-3000:]

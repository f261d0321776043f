"""End to end against real deployment processes on loopback: one `flower-superlink`,
two or three `flower-supernode`s, and the `flwr` CLI submitting through a named connection,
all started by scripts/local_deployment.py (the documented path is the tested path).

This is the path a real deployment takes (Fleet API over HTTP, one ClientApp process
per message, FAB shipped to every node), which simulation never exercises. Every
process gets its own FLWR_HOME under the test's temporary directory; that path in a
process's command line or environment is how teardown (`down`) finds everything started here,
including the SuperLink's detached `flower-superexec` (own session) and the
`flwr-serverapp` / `flwr-clientapp` processes the SuperExecs spawn.

Process tree in flwr 1.42 (insecure, `--isolation subprocess`, the default):

    flower-superlink --host 127.0.0.1 --port P      (Fleet + Control + Runtime API)
      flower-superexec (start_new_session)  ->  flwr-serverapp per run
    flower-supernode --superlink 127.0.0.1:P --port Q_i   (own Runtime API port)
      flower-superexec (same session)       ->  flwr-clientapp per message

Runtime dependency installation (`uv sync` per run) is on by default in the SuperLink
only: `--disable-runtime-dependency-installation` (or the environment variable
FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1) turns it off
(flwr/superlink/cli/flower_superlink.py, flwr/common/args.py). A SuperNode installs
nothing unless given `--allow-runtime-dependency-installation` (default False:
RUNTIME_DEPENDENCY_INSTALL in flwr/common/constant.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import sqlite3
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.ledger.chain import LEDGER_FILE, read_entries
from app.ledger.verify import verify_run
from app.live.runs import RunView
from app.tools.broker import LocalBroker, missing
from app.tools.processes import free_ports, kill_matching, parse_flwr_json, processes_under, stop_processes
from tests.helpers import load_script
from tests.test_status_channel import Subscriber as StatusWatcher

ROOT = Path(__file__).resolve().parents[1]
local_deployment = load_script("local_deployment")
Deployment, CONNECTION, START_TIMEOUT_S = (
    local_deployment.Deployment,
    local_deployment.CONNECTION,
    local_deployment.START_TIMEOUT_S,
)
wait_until, tail = local_deployment.wait_until, local_deployment.tail


# ----------------------------------------------------------------------------- helpers


def _killpg(pid: int) -> None:
    """SIGKILL a process started in its own session, with its group (a crash: no goodbye)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def acquire_task_status(address: str, ca_cert: Path | None) -> int:
    """HTTP status of a ServerApp-task request (`/v1/runtime/acquire-task`) sent to the
    SuperLink's public port by a stranger: Flower's own Runtime client, no SuperExec secret."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
    from flwr.supercore.runtime.runtime_http_client import RuntimeHttpClient

    client = RuntimeHttpClient.from_server_address(
        address,
        insecure=ca_cert is None,
        root_certificates=ca_cert.read_bytes() if ca_cert else None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
    )
    try:
        client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.SERVER_APP]))
        return 200
    except httpx.HTTPStatusError as err:
        return err.response.status_code
    finally:
        client.close()


# ----------------------------------------------------------------------------- federation


class LoopbackRun:
    """One `flwr run --stream` in the background, its output root and its run id."""

    def __init__(self, fed: LoopbackFederation, proc: subprocess.Popen, log: Path, out_root: Path) -> None:
        self.fed, self.proc, self.log, self.out_root = fed, proc, log, out_root
        self.run_id: str = wait_until(self._started, START_TIMEOUT_S, f"`flwr run` to submit the run ({log})")

    def _started(self) -> str | None:
        if m := re.search(r"Successfully started run (\d+)", tail(self.log, 10**6)):
            return m.group(1)
        if self.proc.poll() is not None:
            raise AssertionError(f"`flwr run` exited {self.proc.returncode} before submitting:\n{tail(self.log)}")
        return None

    def metrics(self) -> list[dict[str, Any]]:
        """Rows of the run's metrics.jsonl so far (the ServerApp appends one per update)."""
        rows = []
        for path in self.out_root.glob("*/metrics.jsonl"):
            complete = path.read_text().split("\n")[:-1]  # the last piece may be a line being written
            rows += [json.loads(line) for line in complete if line.strip()]
        return rows

    def status(self) -> dict[str, Any]:
        """The run's row of `flwr list --run-id ID --format json`."""
        proc = self.fed.cli("list", "--run-id", self.run_id, "--format", "json")
        text = proc.stdout
        assert proc.returncode == 0 and "{" in text, f"flwr list failed:\n{text}\n{proc.stderr}"
        return parse_flwr_json(text)["runs"][0]

    def wait(self, timeout: float, expect: str = "finished:completed") -> dict[str, Any]:
        """Wait for the run to end; check Flower's verdict `expect`, return summary.json.

        `flwr run --stream` exits 0 even when the ServerApp raised, so the verdict comes
        from `flwr list` (`finished:completed` / `finished:failed` + status-details).
        """
        deadline = time.monotonic() + timeout
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run {self.run_id} still going after {timeout:.0f} s:\n{tail(self.log)}") from None
        # The stream ends with the run; allow the state a moment to settle anyway.
        row = wait_until(
            lambda: (r := self.status())["status"].startswith("finished") and r,
            max(10.0, deadline - time.monotonic()),
            f"run {self.run_id} to be marked finished",
            interval=1.0,
        )
        assert row["status"] == expect, f"run {self.run_id}: {row['status']} {row['status-details']}\n{tail(self.log)}"
        summaries = list(self.out_root.glob("*/summary.json"))
        if not summaries and expect != "finished:completed":
            return {}  # e.g. a run refused before it wrote anything
        assert len(summaries) == 1, f"expected one summary.json under {self.out_root}: {summaries}\n{tail(self.log)}"
        return json.loads(summaries[0].read_text())


class LoopbackFederation(Deployment):
    """scripts/local_deployment.py's stack, plus what a test does to it: submit runs and
    crash its parts."""

    _runs = 0

    def submit(self, overrides: str, out_root: Path | None = None) -> LoopbackRun:
        """`flwr run . local --stream` in the background, results in `out_root` (default: a
        fresh one)."""
        assert "'" not in overrides, "the overrides travel inside single quotes"
        self._runs += 1
        out_root = out_root or self.root / f"results-{self._runs}"
        run_config = f"overrides='{overrides}' output-dir='{out_root}'"
        proc, log = self.spawn(
            "cli",
            ["flwr", "run", str(ROOT), CONNECTION, "--stream", "--run-config", run_config],
            cwd=ROOT,
            log_name=f"run-{self._runs}.log",
        )
        return LoopbackRun(self, proc, log, out_root)

    def run(self, overrides: str, timeout: float) -> dict[str, Any]:
        """Submit, wait for a `finished:completed` run, return its summary.json."""
        return self.submit(overrides).wait(timeout)

    def kill_node(self, i: int) -> None:
        """SIGKILL SuperNode `i` with its SuperExec and ClientApps (a crash: no goodbye to
        the SuperLink, which marks the node offline only after missed heartbeats)."""
        _killpg(self.pids[f"node-{i}"])
        stop_processes(str(self.root / f"node-{i}"))

    def kill_serverapp(self) -> None:
        """SIGKILL the running ServerApp process(es) only: the SuperLink and nodes stay up."""
        home = "superexec" if self.secure else "superlink"
        killed = kill_matching(str(self.root / home), "flwr-serverapp")
        assert killed, "no flwr-serverapp process was running"

    def crash_server(self) -> None:
        """SIGKILL the whole server side (SuperLink, its SuperExec and ServerApps), as when the
        SuperLink's host dies; the SuperNodes keep running and retry."""
        _killpg(self.pids["superlink"])
        for home in ("superlink", "superexec"):
            stop_processes(str(self.root / home))


@contextmanager
def loopback_federation(
    tmp_path: Path, num_nodes: int = 3, secure: bool = False, data_paths: list[Path] | None = None, edge: bool = False
) -> Iterator[LoopbackFederation]:
    """A running loopback federation (`up`); every process it started is gone afterwards."""
    for tool in ("flower-superlink", "flower-supernode", "flwr"):
        if shutil.which(tool) is None:
            pytest.fail(f"`{tool}` is not on PATH: pip install -e '.[test]'")
    fed = LoopbackFederation(tmp_path / "loopback", num_nodes, secure, data_paths, edge)
    try:
        t0 = time.monotonic()
        fed.up()
        print(f"\nloopback federation up in {time.monotonic() - t0:.1f} s: nodes {fed.node_ids}")
        yield fed
    finally:
        fed.close()


# ----------------------------------------------------------------------------- tests


def _site_files(out: Path, sizes: list[int]) -> list[Path]:
    """One data file per site (scripts/export_partitions.py), cut to distinct sizes so that
    the examples a round trained on tell which sites took part."""
    paths = load_script("export_partitions").export_partitions(out, len(sizes))
    for path, size in zip(paths, sizes, strict=True):
        with np.load(path) as f:
            x, y = f["x"][:size], f["y"][:size]
        np.savez_compressed(path, x=x, y=y)
    return paths


def _train_size(n: int, val_fraction: float = 0.1) -> int:
    """Examples a node trains on after holding out its local validation split (app/task/data.py)."""
    return n - math.ceil(n * val_fraction)


def _ssh_fingerprint(public_key: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", str(public_key)], capture_output=True, text=True, check=True)
    return out.stdout.split()[1]  # "384 SHA256:... name (ECDSA)"


def _script(command: str, state: Path, *args: str, home: Path, cwd: Path) -> str:
    """`python scripts/local_deployment.py COMMAND --state-dir STATE ...` as a user runs it,
    with HOME at `home`; its output (the test fails on a non-zero exit)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "local_deployment.py"), command, "--state-dir", str(state), *args],
        env={**os.environ, "HOME": str(home)}, cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"local_deployment.py {command} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


def test_the_scripts_secure_stack_waits_a_bounded_time_for_a_lost_node_and_takes_it_back(tmp_path: Path) -> None:
    """`scripts/local_deployment.py up` with two sites' data files: TLS with our CA, SuperNode
    authentication with registered keys, the Runtime API locked to our SuperExec. Refused: an
    unregistered key, a CLI without the CA, a stranger asking for the ServerApp task.

    Site B's SuperNode is killed after round 1. Its pending task is given up (round timeout,
    or the SuperLink's error once it marks the node offline); then the next round waits for two
    nodes (min_train_nodes=2), bounded by federation.round_wait_timeout_s and saying so, while
    `up` again restarts the node, which rejoins with its key and data; the run completes. `down`
    leaves no process, and nothing was written outside the state directory (HOME and the
    working directory stay empty)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    state = home / "fedgpu-local"
    sizes = [479, 300]
    files = _site_files(tmp_path / "sites", sizes)
    port = str(free_ports(1)[0])
    # The status channel on a real Mosquitto (docs/monitoring.md), the sites with the login `up` gives them
    broker = LocalBroker(tmp_path / "broker") if missing() is None else None
    login = ["--status-login", "node", str(broker.root / "node.pw")] if broker else []
    status = " " + " ".join(broker.overrides()) if broker else ""
    watcher = StatusWatcher(broker) if broker else None
    up = _script("up", state, "--data", *map(str, files), "--port", port, *login, home=home, cwd=work)
    fed = LoopbackFederation.load(state)
    try:
        assert "nodes online: 2 of 2" in up, up
        stranger, stranger_log = fed.spawn_node("stranger", free_ports(1)[0], 0, register_key=False)
        fed.write_cli_config("no-ca", root_certificates=None)  # plain-text client against the TLS port
        refused = fed.cli("supernode", "list", "no-ca", "--format", "json", timeout=120)
        task_thief = acquire_task_status(fed.address, fed.creds / "ca.crt")
        run = fed.submit(
            # Round 1 starts two fresh ClientApp processes (torch imports): ~15 s idle on two cores,
            # more under load. The killed node's round-2 task is given up after the round timeout.
            "federation.rounds=4 federation.round_timeout_s=45 federation.round_wait_timeout_s=240 train.epochs=1 "
            f"ledger.work_keys={fed.creds / 'work-keys'}" + status,  # each site signs its work (docs/ledger.md)
            out_root=tmp_path / "results",
        )
        wait_until(run.metrics, 180.0, "round 1 in metrics.jsonl", interval=0.5)
        fed.kill_node(1)
        waiting = "waiting up to"
        wait_until(lambda: waiting in tail(run.log, 10**6), 240.0, "the bounded wait for the lost node", 1.0)
        restart = _script("up", state, home=home, cwd=work)
        summary = run.wait(timeout=300)
        if watcher is not None:  # the server's last state reaches the broker after the summary is written
            done = f"runs/{Path(summary['run_dir']).name}/state"
            watcher.wait_for(lambda: any(p["state"] == "completed" for p in watcher.of(done)), timeout=120)
        code = wait_until(lambda: stranger.poll() is not None, 120.0, "the unregistered SuperNode to give up")
        log = tail(run.log, 10**6)
    finally:
        down = _script("down", state, home=home, cwd=work)
        if broker is not None:
            watcher.close()
            broker.stop()

    assert "started: node-1" in restart, restart
    assert "partition claims: ignored (a deployment" in log, "a deployed node's partition-id claim binds"
    assert not processes_under(str(state)), "processes of the stack outlived `down`"
    assert sorted(p.name for p in home.iterdir()) == [state.name] and not any(work.iterdir())
    assert "stopped everything" in down
    assert task_thief == 401, task_thief  # RUNTIME_AUTHENTICATION_FAILED: no SuperExec secret
    assert code and stranger.returncode != 0, tail(stranger_log)
    assert "Exit Code: 305" in tail(stranger_log), tail(stranger_log)  # SUPERNODE_CONNECTION_ERROR
    answer = parse_flwr_json(refused.stdout)  # flwr exits 0 and says so in the JSON
    assert answer["success"] is False and "unavailable" in answer["error-message"], answer
    assert summary["status"] == "completed" and summary["rounds_completed"] == 4, summary
    rows = run.metrics()
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    both, lost = sum(map(_train_size, sizes)), _train_size(sizes[0])
    # Round 1: each registered site trained on its own file; round 2 without the killed node,
    # whose task is rejected (the SuperLink's error) or missing (the round timeout).
    assert rows[0]["num_clients"] == 2 and rows[0]["train"]["num-examples"] == both, rows[0]
    assert rows[1]["num_clients"] == 1 and rows[1]["train"]["num-examples"] == lost, rows[1]
    assert rows[1]["num_missing"] + rows[1]["num_rejected"] == 1, rows[1]
    # The wait named the missing node (its node config's name beside its id) and the setting; after
    # it, both sites trained again.
    assert f"missing [node-1 (node {fed.node_ids[1]})]" in log and "federation.round_wait_timeout_s" in log, log[-3000:]
    assert rows[-1]["num_clients"] == 2 and rows[-1]["train"]["num-examples"] == both, rows[-1]
    # The ledger names each node by its registered key too, as `ssh-keygen -lf` prints it.
    keys = {fed.node_ids[i]: _ssh_fingerprint(fed.creds / "keys" / f"node-{i}.pub") for i in range(2)}
    records = [n for e in read_entries(Path(summary["run_dir"]) / LEDGER_FILE) for n in e["nodes"]]
    assert len(records) >= 6 and all(n["node_key"] == keys[n["node_id"]] for n in records), records
    # Each applied update carries its site's signed work record (the key `up` made beside the
    # SuperNode's), also after the restart; `verify` checks them with the keys the run copied.
    applied = [n for n in records if n["outcome"] == "applied"]
    assert len(applied) >= 6 and all(n["work"]["site"] == f"node-{fed.node_ids.index(n['node_id'])}" for n in applied)
    assert verify_run(Path(summary["run_dir"])) == []
    # The live page reads the deployed run's results like any other (app/live/runs.py)
    page = RunView.of_dir(Path(summary["run_dir"]))
    page.poll()
    shown = page.as_dict()
    assert (shown["status"], shown["step"], len(shown["rows"])) == ("completed", 4, 4), shown["status"]
    assert set(shown["nodes"]) == {str(n) for n in fed.node_ids}
    if watcher is not None:  # both deployed sites published heartbeats with their node-config login
        run_name = Path(summary["run_dir"]).name
        beats = watcher.of("/tasks")
        assert {b["node"] for b in beats if b["run"] == run_name and b["state"] == "finished"} == set(fed.node_ids)
        assert watcher.of(f"runs/{run_name}/state")[-1]["state"] == "completed"


def test_up_right_after_a_node_crash_waits_out_the_old_session_and_the_node_rejoins(tmp_path: Path) -> None:
    """A SIGKILLed SuperNode still counts as online on the SuperLink for two heartbeats (60 s),
    and Flower refuses to activate its key again until then (exit 305). `up` at once after the
    crash says so, retries, and brings the node back online under the same node id."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    state = home / "fedgpu-local"
    _script("up", state, "--nodes", "1", "--port", str(free_ports(1)[0]), home=home, cwd=work)
    fed = LoopbackFederation.load(state)
    try:
        before = list(fed.node_ids)
        fed.kill_node(0)
        restart = _script("up", state, home=home, cwd=work)
        after = LoopbackFederation.load(state)
        online = after.online_nodes()
    finally:
        down = _script("down", state, home=home, cwd=work)
    assert "still counts its previous run as online" in restart and "started: node-0" in restart, restart
    assert after.node_ids == before and online == set(before), (before, after.node_ids, online)
    assert "stopped everything" in down and not processes_under(str(state))


def test_fedbuff_survives_a_killed_node(tmp_path: Path) -> None:
    with loopback_federation(tmp_path) as fed:
        # Flower's default `--isolation subprocess` (used here, insecure) leaves the Runtime API
        # on the public port open to anyone: why the shipped SuperLink runs `--isolation process`.
        assert acquire_task_status(fed.address, None) == 200
        run = fed.submit("strategy=fedbuff federation.rounds=3 train.epochs=1 strategy.buffer_size=2")
        seen = wait_until(run.metrics, 180.0, "the first server update in metrics.jsonl", interval=0.5)
        fed.kill_node(2)
        summary = run.wait(timeout=300)

    assert len(seen) < 3, "the node died only after the run had finished its versions"
    assert summary["status"] == "completed", summary
    versions = [r["version"] for r in run.metrics() if "version" in r]
    assert versions == [1, 2, 3], versions


def _queued_tasks(fed: LoopbackFederation, run_id: str) -> int:
    """Messages of run `run_id` waiting in the SuperLink's database for a node to pull them
    (Flower 1.42's `message_ins` table; run ids are stored as signed 64-bit integers)."""
    rid = int(run_id) - (1 << 64) if int(run_id) >= 1 << 63 else int(run_id)
    with closing(sqlite3.connect(f"file:{fed.root / 'superlink' / 'state.db'}?mode=ro", uri=True)) as db:
        query = "SELECT COUNT(*) FROM message_ins WHERE run_id = ? AND (delivered_at = '' OR delivered_at IS NULL)"
        return db.execute(query, (rid,)).fetchone()[0]


def _received(fed: LoopbackFederation, run_id: str) -> list[str]:
    """The "[RUN id, ROUND n]" headers of tasks the SuperNodes received for run `run_id`."""
    logs = "".join(tail(fed.root / f"node-{i}" / "output.log", 10**7) for i in range(fed.num_nodes))
    return re.findall(rf"\[RUN {run_id}, ROUND \d+\]\n\S* *:?\s*Receiving", logs)


def test_server_crashes_then_resume_auto_gives_an_uninterrupted_runs_rounds_and_epsilon(tmp_path: Path) -> None:
    """Central DP over the shipped configuration. The ServerApp dies after round 1 with round
    2's tasks queued for the (paused) nodes; stopped as the supervisor stops a stale run
    (`flwr stop`), those tasks are dropped and never execute; the same `flwr run` again
    continues the run. Then the whole server side (SuperLink, SuperExec, ServerApp) dies;
    `up` restarts it on its database, the nodes reconnect and the same command finishes the
    run: 4 rounds, 4 releases, the epsilon of an uninterrupted run."""
    from app.tools.supervise import Flwr

    overrides = (
        "name=crashy resume=auto privacy=central privacy.noise_multiplier=1 federation.rounds=4 "
        "federation.min_available_nodes=3 train.epochs=1"
    )
    out = tmp_path / "results"
    rounds = lambda run: [r["round"] for r in run.metrics()]  # noqa: E731
    with loopback_federation(tmp_path, secure=True) as fed:
        nodes = [fed.pids[f"node-{i}"] for i in range(fed.num_nodes)]
        run = fed.submit(overrides, out)
        wait_until(lambda: rounds(run), 180.0, "round 1", interval=0.1)
        for pid in nodes:  # paused: round 2's tasks wait in the SuperLink for them
            os.killpg(pid, signal.SIGSTOP)
        try:
            # Flower stores a round's tasks one by one: wait for all three, not the first
            wait_until(lambda: _queued_tasks(fed, run.run_id) >= 3, 60.0, "round 2's three tasks in the SuperLink")
            queued = _queued_tasks(fed, run.run_id)
            fed.kill_serverapp()
            _killpg(run.proc.pid)
            flwr = Flwr(CONNECTION, env=fed.env("cli"), app_dir=ROOT)
            flwr.stop(run.run_id)
            verdict, left = flwr.status(run.run_id), _queued_tasks(fed, run.run_id)
        finally:
            for pid in nodes:
                os.killpg(pid, signal.SIGCONT)
        stale, after_first_crash = run.run_id, rounds(run)

        run = fed.submit(overrides, out)
        wait_until(lambda: max(rounds(run)) > after_first_crash[-1], 180.0, "a round after the resume", 0.5)
        fed.crash_server()
        _killpg(run.proc.pid)
        after_second_crash = rounds(run)
        assert fed.up() == ["superlink", "superexec"]  # the nodes outlived it and reconnect

        summary = fed.submit(overrides, out).wait(timeout=300)

    assert queued == 3 and verdict == "finished:stopped" and left == 0, (queued, verdict, left)
    # The nodes pull in creation order: once they ran the resumed run's tasks, the stale ones
    # would have come first. Only round 1 of the stopped run ever reached them.
    assert len(_received(fed, stale)) == 3 and all("ROUND 1]" in r for r in _received(fed, stale))
    assert after_first_crash == [1] and after_second_crash[-1] < 4, (after_first_crash, after_second_crash)
    assert summary["status"] == "completed" and summary["rounds_completed"] == 4, summary
    assert summary["run_dir"] == str(out / "crashy")
    assert [r["round"] for r in run.metrics()] == [1, 2, 3, 4]
    assert summary["privacy"]["releases"] == 4

    from app.tools.in_process import run_in_process

    whole, _ = run_in_process(overrides.replace("resume=auto", ""), tmp_path / "uninterrupted")
    assert whole["privacy"]["releases"] == 4
    assert summary["privacy"]["epsilon"] == pytest.approx(whole["privacy"]["epsilon"], rel=1e-12)


def test_the_fleet_edge_lets_nodes_train_and_refuses_everything_else(tmp_path: Path) -> None:
    """docker/server/fleet-edge.conf.template on a real nginx: SuperNodes train through it;
    the Control API (submit runs, register keys) and the Runtime API are refused there (403),
    and stay reachable on the SuperLink's own port for the operator."""
    if shutil.which("nginx") is None:
        pytest.skip("nginx is not installed (apt-get install nginx; .ci/run does)")
    with loopback_federation(tmp_path, num_nodes=2, secure=True, edge=True) as fed:
        fed.write_cli_config("via-edge", root_certificates=fed.creds / "ca.crt", port=fed.fleet_port)
        control = fed.cli("supernode", "list", "via-edge", "--format", "json", timeout=120)
        runtime = acquire_task_status(f"127.0.0.1:{fed.fleet_port}", fed.creds / "ca.crt")
        summary = fed.run("federation.rounds=1 federation.min_available_nodes=2 train.epochs=1", timeout=240)
        access = (fed.root / "edge" / "logs" / "access.log").read_text()

    assert summary["status"] == "completed" and summary["rounds_completed"] == 1, summary
    assert runtime == 403, runtime
    answer = parse_flwr_json(control.stdout)
    assert answer["success"] is False, answer
    assert '"POST /v1/fleet/pull-messages' in access and "/v1/fleet/push-messages" in access
    assert '"POST /v1/control/' in access and '" 403 ' in access


def _largest_node_body() -> bytes:
    """The biggest request body a SuperNode sends: /v1/fleet/push-object with one full
    array chunk (Flower slices arrays into FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE pieces)."""
    from flwr.app import Array
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
    from flwr.proto.message_pb2 import PushObjectRequest
    from flwr.proto.node_pb2 import Node

    array = Array(np.ones(FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE + 1, dtype=np.uint8))
    chunk_id, chunk = array.slice_array()[0]
    request = PushObjectRequest(node=Node(node_id=1), run_id=1, object_id=chunk_id, object_content=chunk.deflate())
    body = request.SerializeToString(deterministic=True)
    assert len(body) > FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
    return body


def test_the_fleet_edge_refuses_oversized_bodies_before_the_superlink_sees_them(tmp_path: Path) -> None:
    """The edge's client_max_body_size: a stranger's body over the cap gets 413 from nginx,
    with Content-Length and chunked alike, and never reaches the SuperLink (which would read
    it all before checking the node's signature); a full array chunk, the largest body a
    SuperNode sends, passes with room to spare and is refused by the SuperLink's node
    authentication instead. (That nodes train through the edge: the test above.)"""
    if shutil.which("nginx") is None:
        pytest.skip("nginx is not installed (apt-get install nginx; .ci/run does)")
    template = (ROOT / "docker" / "server" / "fleet-edge.conf.template").read_text()
    size, unit = re.search(r"^\s*client_max_body_size (\d+)([kKmM]?);", template, re.M).groups()
    cap = int(size) << {"": 0, "k": 10, "m": 20}[unit.lower()]  # 0: no limit at all
    legit = _largest_node_body()
    assert 2 * len(legit) < cap, f"the cap ({cap} bytes) must leave headroom over a {len(legit)}-byte chunk"

    def stream(total: int, piece: int = 1 << 20) -> Iterator[bytes]:  # no Content-Length: chunked encoding
        for start in range(0, total, piece):
            yield b"x" * min(piece, total - start)

    fed = LoopbackFederation(tmp_path / "loopback", num_nodes=0, secure=True, edge=True)
    try:
        fed.start_superlink()
        fed.start_edge()
        url = f"https://127.0.0.1:{fed.fleet_port}/v1/fleet/push-object"
        headers = {"content-type": "application/protobuf"}
        with httpx.Client(verify=ssl.create_default_context(cafile=fed.creds / "ca.crt"), timeout=60) as client:
            sized = client.post(f"{url}?probe=sized", content=b"x" * (cap + 1), headers=headers).status_code
            chunked = client.post(f"{url}?probe=chunked", content=stream(cap + 1), headers=headers).status_code
            node = client.post(f"{url}?probe=chunk", content=legit, headers=headers).status_code

        def upstreams() -> dict[str, str]:  # nginx logs a request just after answering it
            log = (fed.root / "edge" / "logs" / "access.log").read_text()
            found = dict(re.findall(r"probe=(\w+) .* upstream=(\S+)", log))
            return found if len(found) == 3 else {}

        upstream = wait_until(upstreams, START_TIMEOUT_S, "the three probes in the edge's access log")
    finally:
        fed.close()

    assert (sized, chunked) == (413, 413), (sized, chunked)
    assert node == 401, f"a full chunk must pass the edge and meet node authentication, got {node}"
    assert upstream["sized"] == upstream["chunked"] == "-", upstream  # nginx never opened the SuperLink
    assert upstream["chunk"] == fed.address, upstream


def test_a_restarted_node_takes_its_scaffold_variate_up_from_its_state_directory(tmp_path: Path) -> None:
    """SCAFFOLD on two deployed nodes with a `state-dir`: node 1 is killed after round 1 and
    started again (a new SuperNode process, so a new Context without c_i); in a later round its
    ClientApp takes c_i up from the file it wrote before the crash (the same tensors, by digest),
    and the run completes with the other node carrying the rounds it missed."""
    import torch

    from app.task.scaffold import digest, variate_file

    states = [tmp_path / f"state-{i}" for i in range(2)]
    configs = [f'name="node-{i}" partition-id={i} num-partitions=2 state-dir="{s}"' for i, s in enumerate(states)]
    fed = LoopbackFederation(tmp_path / "loopback", 2, secure=False, node_configs=configs)
    try:
        fed.up()
        run = fed.submit(
            "strategy=scaffold federation.rounds=5 train.epochs=1 federation.min_train_nodes=1 "
            "federation.min_available_nodes=1 federation.round_timeout_s=20 federation.message_ttl_s=60"
        )
        saved = variate_file(str(states[1]), int(run.run_id))
        wait_until(saved.is_file, 300.0, f"node 1 to keep its first variate in {saved}", interval=0.2)
        fed.kill_node(1)
        before = digest(torch.load(saved, weights_only=True))
        log = fed.root / "node-1" / "output.log"
        seen = len(tail(log, 10**7))
        fed.start_node(1)
        summary = run.wait(timeout=600)
        after_restart = tail(log, 10**7)[seen:]
    finally:
        fed.close()
    assert summary["status"] == "completed" and summary["rounds_completed"] == 5, summary
    assert f"SCAFFOLD: control variate taken up from {saved} (sha256 {before})" in after_restart, after_restart[-4000:]
    assert digest(torch.load(saved, weights_only=True)) != before  # and it trained on from there

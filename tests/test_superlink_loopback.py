"""End to end against real deployment processes on loopback: one `flower-superlink`,
three `flower-supernode`s, and the `flwr` CLI submitting through a named connection.

This is the path a real deployment takes (Fleet API over HTTP, one ClientApp process
per message, FAB shipped to every node), which simulation never exercises. Every
process gets its own FLWR_HOME under the test's temporary directory; that path in a
process's command line or environment is how teardown finds everything started here,
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
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import free_ports, load_script
from processes import stop_processes

ROOT = Path(__file__).resolve().parents[1]
credentials = load_script("credentials")
CONNECTION = "loopback"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
START_TIMEOUT_S = 60.0


# ----------------------------------------------------------------------------- helpers


def _wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        if result := check():
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return ANSI.sub("", path.read_text(errors="replace"))[-chars:]
    except OSError:
        return f"<no {path}>"


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # started with start_new_session: pgid == pid
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


# ----------------------------------------------------------------------------- federation


class LoopbackRun:
    """One `flwr run --stream` in the background, its output root and its run id."""

    def __init__(self, fed: LoopbackFederation, proc: subprocess.Popen, log: Path, out_root: Path) -> None:
        self.fed, self.proc, self.log, self.out_root = fed, proc, log, out_root
        self.run_id: str = _wait_until(self._started, START_TIMEOUT_S, f"`flwr run` to submit the run ({log})")

    def _started(self) -> str | None:
        if m := re.search(r"Successfully started run (\d+)", _tail(self.log, 10**6)):
            return m.group(1)
        if self.proc.poll() is not None:
            raise AssertionError(f"`flwr run` exited {self.proc.returncode} before submitting:\n{_tail(self.log)}")
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
        return json.loads(text[text.index("{") :])["runs"][0]

    def wait(self, timeout: float, expect: str = "finished:completed") -> dict[str, Any]:
        """Wait for the run to end; check Flower's verdict `expect`, return summary.json.

        `flwr run --stream` exits 0 even when the ServerApp raised, so the verdict comes
        from `flwr list` (`finished:completed` / `finished:failed` + status-details).
        """
        deadline = time.monotonic() + timeout
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run {self.run_id} still going after {timeout:.0f} s:\n{_tail(self.log)}") from None
        # The stream ends with the run; allow the state a moment to settle anyway.
        row = _wait_until(
            lambda: (r := self.status())["status"].startswith("finished") and r,
            max(10.0, deadline - time.monotonic()),
            f"run {self.run_id} to be marked finished",
            interval=1.0,
        )
        assert row["status"] == expect, f"run {self.run_id}: {row['status']} {row['status-details']}\n{_tail(self.log)}"
        summaries = list(self.out_root.glob("*/summary.json"))
        if not summaries and expect != "finished:completed":
            return {}  # e.g. a run refused before it wrote anything
        assert len(summaries) == 1, f"expected one summary.json under {self.out_root}: {summaries}\n{_tail(self.log)}"
        return json.loads(summaries[0].read_text())


class LoopbackFederation:
    """A SuperLink and `num_nodes` SuperNodes on 127.0.0.1, each in its own FLWR_HOME."""

    def __init__(self, root: Path, num_nodes: int, secure: bool = False) -> None:
        self.secure = secure  # TLS with our CA, and SuperNode authentication with registered keys
        self.root = root.resolve()
        self.num_nodes = num_nodes
        self.procs: list[subprocess.Popen] = []
        self.nodes: list[subprocess.Popen] = []
        self.node_ids: list[int] = []
        self.port, *self.node_ports = free_ports(1 + num_nodes)
        self._runs = 0

    def env(self, home: str) -> dict[str, str]:
        """Environment of every process: a private FLWR_HOME, nothing from the network."""
        path = self.root / home
        path.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ,
            "FLWR_HOME": str(path),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",  # logs reach the files while we poll them
        }

    def _spawn(
        self, home: str, cmd: list[str], cwd: Path | None = None, log_name: str = "output.log"
    ) -> tuple[subprocess.Popen, Path]:
        env = self.env(home)
        log = self.root / home / log_name
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, env=env, cwd=cwd or env["FLWR_HOME"], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc, log

    def start(self) -> None:
        """SuperLink first (nodes back off exponentially while it is down), then the nodes."""
        superlink, sl_log = self._spawn(
            "superlink",
            [
                "flower-superlink", *self._superlink_security(), "--host", "127.0.0.1", "--port", str(self.port),
                "--database", str(self.root / "superlink" / "state.db"),
                "--disable-runtime-dependency-installation",
            ],
        )  # fmt: skip

        def listening() -> bool:
            if superlink.poll() is not None:
                raise AssertionError(f"flower-superlink exited {superlink.returncode}:\n{_tail(sl_log)}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        _wait_until(listening, START_TIMEOUT_S, f"flower-superlink on port {self.port}")

        self.write_cli_config(CONNECTION, root_certificates=self.creds / "ca.crt" if self.secure else None)
        logs = []
        for i, port in enumerate(self.node_ports):
            node, log = self.spawn_node(f"node-{i}", port, i, register=True)
            self.nodes.append(node)
            logs.append(log)

        def node_id(i: int) -> int | None:
            if m := re.search(r"SuperNode ID: (\d+)", _tail(logs[i], 10**6)):
                return int(m.group(1))
            if self.nodes[i].poll() is not None:
                raise AssertionError(f"flower-supernode {i} exited {self.nodes[i].returncode}:\n{_tail(logs[i])}")
            return None

        self.node_ids = [
            _wait_until(lambda i=i: node_id(i), START_TIMEOUT_S, f"SuperNode {i}") for i in range(self.num_nodes)
        ]

        _wait_until(self._all_online, 30.0, f"{self.num_nodes} nodes online in `flwr supernode list`", 1.0)

    @property
    def creds(self) -> Path:
        return self.root / "creds"

    def _superlink_security(self) -> list[str]:
        if not self.secure:
            return ["--insecure"]
        paths = credentials.make_tls(self.creds, ["localhost"], ["127.0.0.1"])
        return [
            "--ssl-ca-certfile", str(paths["ca_cert"]), "--ssl-certfile", str(paths["cert"]),
            "--ssl-keyfile", str(paths["key"]), "--enable-supernode-auth",
        ]  # fmt: skip

    def write_cli_config(self, name: str, root_certificates: Path | None) -> None:
        """The CLI's connection entry (scripts/credentials.py), made the default."""
        home = Path(self.env("cli")["FLWR_HOME"])
        credentials.write_flwr_config(name, f"127.0.0.1:{self.port}", root_certificates, home)
        if name == CONNECTION:
            text = (home / "config.toml").read_text()
            (home / "config.toml").write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n' + text)

    def spawn_node(self, name: str, port: int, partition: int, register: bool) -> tuple[subprocess.Popen, Path]:
        """A SuperNode; when secure, with its own key pair (registered with the SuperLink or not)."""
        security = ["--insecure"]
        if self.secure:
            ((private, public),) = credentials.make_node_keys(self.creds / "keys", [name])
            if register:
                proc = self.cli("supernode", "register", str(public), CONNECTION)
                assert proc.returncode == 0, f"flwr supernode register failed:\n{proc.stdout}\n{proc.stderr}"
            security = ["--root-certificates", str(self.creds / "ca.crt"), "--auth-supernode-private-key", str(private)]
        return self._spawn(
            name,
            [
                "flower-supernode", *security, "--superlink", f"127.0.0.1:{self.port}", "--port", str(port),
                "--node-config", f"partition-id={partition} num-partitions={self.num_nodes}",
            ],
        )  # fmt: skip

    def _all_online(self) -> bool:
        proc = self.cli("supernode", "list", CONNECTION, "--format", "json")
        if proc.returncode != 0 or "{" not in proc.stdout:
            return False
        nodes = json.loads(proc.stdout[proc.stdout.index("{") :])["nodes"]
        online = {int(n["node-id"]) for n in nodes if n["status"] == "online"}
        return set(self.node_ids) <= online

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """A short `flwr` command with the test's config.toml."""
        return subprocess.run(
            ["flwr", *args], env=self.env("cli"), cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )

    def submit(self, overrides: str) -> LoopbackRun:
        """`flwr run . loopback --stream` in the background, results in a fresh output root."""
        assert "'" not in overrides, "the overrides travel inside single quotes"
        self._runs += 1
        out_root = self.root / f"results-{self._runs}"
        run_config = f"overrides='{overrides}' output-dir='{out_root}'"
        proc, log = self._spawn(
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
        _killpg(self.nodes[i])
        stop_processes(str(self.root / f"node-{i}"))

    def close(self) -> None:
        for proc in self.procs:
            _killpg(proc)
        stop_processes(str(self.root))


@contextmanager
def loopback_federation(tmp_path: Path, num_nodes: int = 3, secure: bool = False) -> Iterator[LoopbackFederation]:
    """A running loopback federation; every process it started is gone afterwards."""
    for tool in ("flower-superlink", "flower-supernode", "flwr"):
        if shutil.which(tool) is None:
            pytest.fail(f"`{tool}` is not on PATH: pip install -e '.[test]'")
    fed = LoopbackFederation(tmp_path / "loopback", num_nodes, secure)
    try:
        t0 = time.monotonic()
        fed.start()
        print(f"\nloopback federation up in {time.monotonic() - t0:.1f} s: nodes {fed.node_ids}")
        yield fed
    finally:
        fed.close()


@pytest.fixture
def loopback(tmp_path: Path) -> Iterator[LoopbackFederation]:
    """The federation as a fixture (tests that may skip should use the context manager
    inside the test instead: fixtures start before the test body can skip)."""
    with loopback_federation(tmp_path) as fed:
        yield fed


# ----------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_sync_run_completes_over_tls_with_node_authentication(tmp_path: Path) -> None:
    """TLS with our CA and SuperNode authentication (scripts/credentials.py), as shipped:
    registered nodes train; a node with an unregistered key and a CLI without the CA are refused."""
    with loopback_federation(tmp_path, secure=True) as fed:
        stranger, stranger_log = fed.spawn_node("stranger", free_ports(1)[0], 0, register=False)
        fed.write_cli_config("no-ca", root_certificates=None)  # plain-text client against the TLS port
        refused = fed.cli("supernode", "list", "no-ca", "--format", "json", timeout=120)
        summary = fed.run("federation.rounds=2 federation.min_available_nodes=3 train.epochs=1", timeout=240)
        code = _wait_until(lambda: stranger.poll() is not None, 120.0, "the unregistered SuperNode to give up")
        node_ids = fed.node_ids

    assert code and stranger.returncode != 0, _tail(stranger_log)
    assert "Exit Code: 305" in _tail(stranger_log), _tail(stranger_log)  # SUPERNODE_CONNECTION_ERROR
    answer = json.loads(refused.stdout[refused.stdout.index("{") :])  # flwr exits 0 and says so in the JSON
    assert answer["success"] is False and "unavailable" in answer["error-message"], answer
    assert summary["status"] == "completed", summary
    assert summary["num_nodes"] == 3 and summary["rounds_completed"] == 2, summary
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert row["num_clients"] == 3 and row["num_rejected"] == 0 and row["num_missing"] == 0, row
        # every registered SuperNode trained, each with the partition its --node-config names
        assert {int(k): v for k, v in row["node_partitions"].items()} == dict(zip(node_ids, range(3), strict=True)), row


@pytest.mark.slow
def test_fedbuff_survives_a_killed_node(tmp_path: Path) -> None:
    with loopback_federation(tmp_path) as fed:
        run = fed.submit("strategy=fedbuff federation.rounds=4 train.epochs=1 strategy.buffer_size=2")
        seen = _wait_until(run.metrics, 180.0, "the first server update in metrics.jsonl", interval=0.5)
        fed.kill_node(2)
        summary = run.wait(timeout=300)

    assert len(seen) < 4, "the node died only after the run had finished its versions"
    assert summary["status"] == "completed", summary
    versions = [r["version"] for r in run.metrics() if "version" in r]
    assert versions == [1, 2, 3, 4], versions

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
import math
import os
import re
import shutil
import signal
import socket
import ssl
import string
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.ledger.chain import LEDGER_FILE, read_entries
from app.tools.processes import free_ports, kill_matching, parse_flwr_json, stop_processes
from tests.helpers import load_script

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


def _wait_listening(proc: subprocess.Popen, log: Path, port: int, what: str) -> None:
    """Until something listens on 127.0.0.1:`port`; fail with `proc`'s log if it exits first."""

    def listening() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited {proc.returncode}:\n{_tail(log)}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    _wait_until(listening, START_TIMEOUT_S, f"{what} on port {port}")


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # started with start_new_session: pgid == pid
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
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

    def __init__(
        self,
        root: Path,
        num_nodes: int,
        secure: bool = False,
        data_paths: list[Path] | None = None,
        edge: bool = False,
    ) -> None:
        self.secure = secure  # TLS with our CA, and SuperNode authentication with registered keys
        self.root = root.resolve()
        self.num_nodes = num_nodes
        self.procs: list[subprocess.Popen] = []
        self.nodes: list[subprocess.Popen] = []
        self.node_ids: list[int] = []
        self.port, *self.node_ports = free_ports(1 + num_nodes)
        self.data_paths = data_paths
        self.edge = edge  # SuperNodes connect through docker/server/fleet-edge.conf.template (nginx)
        self.fleet_port = free_ports(1)[0] if edge else self.port
        self.superlink: subprocess.Popen | None = None
        self._runs = self._superlink_starts = 0

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
        self.start_superlink()
        if self.edge:
            self.start_edge()
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
        self.wait_nodes_online()

    def wait_nodes_online(self, timeout: float = 30.0) -> None:
        _wait_until(self._all_online, timeout, f"{self.num_nodes} nodes online in `flwr supernode list`", 1.0)

    def start_superlink(self) -> None:
        """The SuperLink, as shipped when secure (TLS, node authentication, and the Runtime API
        locked: `--isolation process` with a SuperExec secret and its own `flower-superexec`
        for ServerApps). Called again after `crash_server`: same port, same database."""
        self._superlink_starts += 1
        superlink, sl_log = self._spawn(
            "superlink",
            [
                "flower-superlink", *self._superlink_security(), "--host", "127.0.0.1", "--port", str(self.port),
                "--database", str(self.root / "superlink" / "state.db"),
                "--disable-runtime-dependency-installation",
            ],
            log_name=f"output-{self._superlink_starts}.log",
        )  # fmt: skip
        self.superlink = superlink
        _wait_listening(superlink, sl_log, self.port, "flower-superlink")
        if self.secure:
            self._spawn(
                "superexec",
                [
                    "flower-superexec", "--runtime-api-address", self.address,
                    "--root-certificates", str(self.creds / "ca.crt"),
                    "--superexec-auth-secret-file", str(self.creds / "superexec.secret"),
                ],
                log_name=f"output-{self._superlink_starts}.log",
            )  # fmt: skip

    def start_edge(self) -> None:
        """nginx with the shipped Fleet-only proxy config in front of the SuperLink."""
        assert self.secure, "the edge terminates TLS with the SuperLink's certificate"
        home = self.root / "edge"
        for sub in ("tmp", "logs"):
            (home / sub).mkdir(parents=True, exist_ok=True)
        template = (ROOT / "docker" / "server" / "fleet-edge.conf.template").read_text()
        server = string.Template(template).safe_substitute(
            EDGE_PORT=f"127.0.0.1:{self.fleet_port}", CREDS=str(self.creds), SUPERLINK=self.address,
            SUPERLINK_NAME="localhost",
        )  # fmt: skip
        (home / "fleet-edge.conf").write_text(server)
        temp = " ".join(f"{kind}_temp_path {home / 'tmp' / kind};" for kind in ("client_body", "proxy"))
        # nginx's combined format plus the upstream it contacted ("-": the SuperLink saw nothing).
        log_format = (
            'log_format edge \'$remote_addr - $remote_user [$time_local] "$request" $status $body_bytes_sent '
            '"$http_referer" "$http_user_agent" upstream=$upstream_addr\';'
        )
        (home / "nginx.conf").write_text(
            ("user root;\n" if os.geteuid() == 0 else "")  # workers must read the temp dirs under tmp_path
            + f"pid {home / 'nginx.pid'};\nerror_log {home / 'logs' / 'error.log'} info;\nevents {{}}\n"
            + f"http {{\n {log_format}\n access_log {home / 'logs' / 'access.log'} edge;\n {temp}\n"
            + f" include {home / 'fleet-edge.conf'};\n}}\n"
        )
        proc, log = self._spawn("edge", ["nginx", "-p", str(home), "-c", str(home / "nginx.conf"), "-g", "daemon off;"])
        _wait_listening(proc, log, self.fleet_port, "nginx")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill_serverapp(self) -> None:
        """SIGKILL the running ServerApp process(es) only: the SuperLink and nodes stay up."""
        home = "superexec" if self.secure else "superlink"
        killed = kill_matching(str(self.root / home), "flwr-serverapp")
        assert killed, "no flwr-serverapp process was running"

    def crash_server(self) -> None:
        """SIGKILL the whole server side (SuperLink, its SuperExec and ServerApps), as when the
        SuperLink's host dies; the SuperNodes keep running and retry."""
        _killpg(self.superlink)
        for home in ("superlink", "superexec"):
            stop_processes(str(self.root / home))

    @property
    def creds(self) -> Path:
        return self.root / "creds"

    def _superlink_security(self) -> list[str]:
        if not self.secure:
            return ["--insecure"]
        if not (self.creds / "ca.crt").exists():
            credentials.make_tls(self.creds, ["localhost"], ["127.0.0.1"])
            credentials.make_superexec_secret(self.creds / "superexec.secret")
        c = self.creds
        return [
            "--ssl-ca-certfile", str(c / "ca.crt"), "--ssl-certfile", str(c / "superlink.crt"),
            "--ssl-keyfile", str(c / "superlink.key"), "--enable-supernode-auth",
            "--isolation", "process", "--superexec-auth-secret-file", str(c / "superexec.secret"),
        ]  # fmt: skip

    def write_cli_config(self, name: str, root_certificates: Path | None, port: int | None = None) -> None:
        """The CLI's connection entry (scripts/credentials.py) to the SuperLink (or `port`);
        the test's own connection is made the default."""
        home = Path(self.env("cli")["FLWR_HOME"])
        credentials.write_flwr_config(name, f"127.0.0.1:{port or self.port}", root_certificates, home)
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
                "flower-supernode", *security, "--superlink", f"127.0.0.1:{self.fleet_port}", "--port", str(port),
                "--node-config", self.node_config(partition),
            ],
        )  # fmt: skip

    def node_config(self, partition: int) -> str:
        """Node-local data when the federation has files (one per node), else a demo partition."""
        if self.data_paths:
            return f'data-path="{self.data_paths[partition]}"'  # strings are quoted (TOML)
        return f"partition-id={partition} num-partitions={self.num_nodes}"

    def _all_online(self) -> bool:
        proc = self.cli("supernode", "list", CONNECTION, "--format", "json")
        if proc.returncode != 0 or "{" not in proc.stdout:
            return False
        nodes = parse_flwr_json(proc.stdout)["nodes"]
        online = {int(n["node-id"]) for n in nodes if n["status"] == "online"}
        return set(self.node_ids) <= online

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """A short `flwr` command with the test's config.toml."""
        return subprocess.run(
            ["flwr", *args], env=self.env("cli"), cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )

    def submit(self, overrides: str, out_root: Path | None = None) -> LoopbackRun:
        """`flwr run . loopback --stream` in the background, results in `out_root` (default: a
        fresh one)."""
        assert "'" not in overrides, "the overrides travel inside single quotes"
        self._runs += 1
        out_root = out_root or self.root / f"results-{self._runs}"
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
def loopback_federation(
    tmp_path: Path, num_nodes: int = 3, secure: bool = False, data_paths: list[Path] | None = None, edge: bool = False
) -> Iterator[LoopbackFederation]:
    """A running loopback federation; every process it started is gone afterwards."""
    for tool in ("flower-superlink", "flower-supernode", "flwr"):
        if shutil.which(tool) is None:
            pytest.fail(f"`{tool}` is not on PATH: pip install -e '.[test]'")
    fed = LoopbackFederation(tmp_path / "loopback", num_nodes, secure, data_paths, edge)
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


def test_secure_federation_with_node_local_data_survives_a_killed_node(tmp_path: Path) -> None:
    """The shipped configuration: TLS with our CA, SuperNode authentication with registered
    keys, the Runtime API locked to our SuperExec, and each SuperNode reading its own data
    file (`--node-config data-path=...`). Refused: an unregistered key, a CLI without the
    CA, a stranger asking for the ServerApp task. A SuperNode killed after round 1: the sync
    run finishes its rounds with the other two (min_train_nodes=2, round timeout)."""
    sizes = [479, 300, 200]
    files = _site_files(tmp_path / "sites", sizes)
    with loopback_federation(tmp_path, secure=True, data_paths=files) as fed:
        stranger, stranger_log = fed.spawn_node("stranger", free_ports(1)[0], 0, register=False)
        fed.write_cli_config("no-ca", root_certificates=None)  # plain-text client against the TLS port
        refused = fed.cli("supernode", "list", "no-ca", "--format", "json", timeout=120)
        task_thief = acquire_task_status(fed.address, fed.creds / "ca.crt")
        run = fed.submit(
            # All three nodes are up before the run starts, so round 1 samples them all. Once the
            # SuperLink marks the killed node offline (two missed 30 s heartbeats), a minimum of
            # three available nodes would never be met again: two are enough to go on.
            "federation.rounds=3 federation.min_available_nodes=2 federation.min_train_nodes=2 "
            # Round 1 starts three fresh ClientApp processes (torch imports) on two cores: ~17 s
            # idle, past 20 s under load. Later rounds wait for the killed node up to the timeout.
            "federation.round_timeout_s=45 train.epochs=1"
        )
        _wait_until(run.metrics, 180.0, "round 1 in metrics.jsonl", interval=0.5)
        fed.kill_node(2)
        summary = run.wait(timeout=300)
        code = _wait_until(lambda: stranger.poll() is not None, 120.0, "the unregistered SuperNode to give up")
        dead = fed.node_ids[2]

    assert task_thief == 401, task_thief  # RUNTIME_AUTHENTICATION_FAILED: no SuperExec secret
    assert code and stranger.returncode != 0, _tail(stranger_log)
    assert "Exit Code: 305" in _tail(stranger_log), _tail(stranger_log)  # SUPERNODE_CONNECTION_ERROR
    answer = parse_flwr_json(refused.stdout)  # flwr exits 0 and says so in the JSON
    assert answer["success"] is False and "unavailable" in answer["error-message"], answer
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3, summary
    rows = run.metrics()
    assert [r["round"] for r in rows] == [1, 2, 3]
    # Round 1: every registered site trained on its own file; after the kill, the other two.
    assert rows[0]["num_clients"] == 3 and rows[0]["train"]["num-examples"] == sum(map(_train_size, sizes))
    for row in rows[1:]:
        assert row["num_clients"] == 2, row
        assert row["train"]["num-examples"] == sum(map(_train_size, sizes[:2])), row
        # The dead node's task, while it is still listed: given up after the round timeout
        # (missing), or answered by the SuperLink with an error once it marks the node offline.
        assert all(r["node_id"] == dead for r in row["rejected"]), row["rejected"]
    assert rows[1]["num_missing"] + rows[1]["num_rejected"] == 1, rows[1]
    # The ledger names each node by its registered key too, as `ssh-keygen -lf` prints it.
    keys = {fed.node_ids[i]: _ssh_fingerprint(fed.creds / "keys" / f"node-{i}.pub") for i in range(3)}
    records = [n for e in read_entries(Path(summary["run_dir"]) / LEDGER_FILE) for n in e["nodes"]]
    assert len(records) >= 7 and all(n["node_key"] == keys[n["node_id"]] for n in records), records


def test_fedbuff_survives_a_killed_node(tmp_path: Path) -> None:
    with loopback_federation(tmp_path) as fed:
        # Flower's default `--isolation subprocess` (used here, insecure) leaves the Runtime API
        # on the public port open to anyone: why the shipped SuperLink runs `--isolation process`.
        assert acquire_task_status(fed.address, None) == 200
        run = fed.submit("strategy=fedbuff federation.rounds=4 train.epochs=1 strategy.buffer_size=2")
        seen = _wait_until(run.metrics, 180.0, "the first server update in metrics.jsonl", interval=0.5)
        fed.kill_node(2)
        summary = run.wait(timeout=300)

    assert len(seen) < 4, "the node died only after the run had finished its versions"
    assert summary["status"] == "completed", summary
    versions = [r["version"] for r in run.metrics() if "version" in r]
    assert versions == [1, 2, 3, 4], versions


def test_server_crashes_then_resume_auto_gives_an_uninterrupted_runs_rounds_and_epsilon(tmp_path: Path) -> None:
    """Central DP over the shipped configuration. The ServerApp dies after round 1; the same
    `flwr run` again continues it. Then the whole server side (SuperLink, SuperExec,
    ServerApp) dies; restarted on its database, the nodes reconnect and the same command
    finishes the run: 4 rounds, 4 releases, the epsilon of an uninterrupted run."""
    overrides = (
        "name=crashy resume=auto privacy=central privacy.noise_multiplier=1 federation.rounds=4 "
        "federation.min_available_nodes=3 train.epochs=1"
    )
    out = tmp_path / "results"
    rounds = lambda run: [r["round"] for r in run.metrics()]  # noqa: E731
    with loopback_federation(tmp_path, secure=True) as fed:
        run = fed.submit(overrides, out)
        _wait_until(lambda: rounds(run), 180.0, "round 1", interval=0.5)
        fed.kill_serverapp()
        _killpg(run.proc)
        after_first_crash = rounds(run)

        run = fed.submit(overrides, out)
        _wait_until(lambda: max(rounds(run)) > after_first_crash[-1], 180.0, "a round after the resume", 0.5)
        fed.crash_server()
        _killpg(run.proc)
        after_second_crash = rounds(run)
        fed.start_superlink()
        fed.wait_nodes_online(timeout=180.0)  # the SuperNodes retry with back-off

        summary = fed.submit(overrides, out).wait(timeout=300)

    assert after_first_crash[0] == 1 and after_second_crash[-1] < 4, (after_first_crash, after_second_crash)
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

        upstream = _wait_until(upstreams, START_TIMEOUT_S, "the three probes in the edge's access log")
    finally:
        fed.close()

    assert (sized, chunked) == (413, 413), (sized, chunked)
    assert node == 401, f"a full chunk must pass the edge and meet node authentication, got {node}"
    assert upstream["sized"] == upstream["chunked"] == "-", upstream  # nginx never opened the SuperLink
    assert upstream["chunk"] == fed.address, upstream

"""The secure Flower stack on this machine, in the background, with one command up and one down.

    python scripts/local_deployment.py up --state-dir ~/fedgpu-local --nodes 2
    FLWR_HOME=~/fedgpu-local/cli flwr run . local --stream --run-config "overrides='name=exp1 resume=auto'"
    python scripts/local_deployment.py status --state-dir ~/fedgpu-local
    python scripts/local_deployment.py down --state-dir ~/fedgpu-local

`up` makes the credentials (a CA and the SuperLink's certificate, a SuperExec secret, one
key pair per node), exports one data file per node (scripts/export_partitions.py), starts
the SuperLink (TLS, SuperNode authentication, the Runtime API locked with `--isolation
process`), its SuperExec, registers the node keys and starts one SuperNode per data file,
then waits until every node is online. Every process runs with its own FLWR_HOME under the
state directory and writes its log there (`<name>/output.log`); `deployment.json` records
the ports, process ids and node ids. `up` again restarts whatever is no longer running (a
killed SuperNode rejoins with its key and data), and starts nothing twice.

`down` stops exactly what `up` started: the processes it spawned, each recorded with its
process id, its start time (/proc/PID/stat field 22) and its command line and stopped only
while all three still match (a recycled process id is someone else's), with the processes
they started (their descendants and the members of their sessions: the SuperLink's detached
SuperExec, the per-run ServerApps and per-message ClientApps), SIGTERM first. A process that
merely has the state directory in its environment or as its working directory (a shell
there) is not touched. The state directory keeps the credentials, the SuperLink's database
and the logs for the next `up`; `--purge` deletes it.
The state directory must lie outside any git work tree (or be ignored by git): it holds
private keys. Run results land where the run's `output-dir` says (default ~/fedgpu-runs).
`--insecure` drops TLS and node authentication (a first look only; never expose it).
`up --status-login USER PASSWORD_FILE` gives every site that login to the MQTT status channel
(node config `status-username`, `status-password-file`; docs/monitoring.md).

`up --regions R --nodes-per-region N` brings up a two-level deployment (topology=regions,
docs/deployment.md#regions-two-level-deployment; `TwoLevel`): R regional stacks under
`region-<r>/`, each with its own credentials and N site SuperNodes, and the global stack whose
R SuperNodes are the regions' aggregators; `status` and `down` cover every stack.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import re
import shutil
import socket
import string
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ run as files, not a package
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the app, also from a checkout

import credentials  # noqa: E402
from export_partitions import export_partitions  # noqa: E402
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE  # noqa: E402
from register_nodes import register, wait_for_superlink  # noqa: E402

from app.tools.processes import (  # noqa: E402
    ProcInfo,
    cmdline,
    flwr_cli,
    free_ports,
    parse_flwr_json,
    proc_stat,
    proc_table,
    protected_pids,
    stop_found,
    strip_colours,
)

REPO = Path(__file__).resolve().parents[1]
STATE_FILE = "deployment.json"
CONNECTION = "local"  # the flwr CLI's connection, in <state>/cli/config.toml
START_TIMEOUT_S = 60.0
# A killed node's key is refused until its last session expires: the SuperLink marks it offline
# HEARTBEAT_PATIENCE heartbeats after the last one (flwr.common.constant); 15 s of margin.
ACTIVATION_PATIENCE_S = HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL + 15.0
ACTIVATION_RETRY_S = 5.0
STILL_ONLINE = "Failed to activate SuperNode"  # Flower's message for FLEET_NODE_ACTIVATION_FAILED


def _node_id(proc: subprocess.Popen, log: Path, seen: int) -> int | None:
    """The node id a SuperNode logged after byte `seen` of its log; -1 once it has exited."""
    if m := re.search(r"SuperNode ID: (\d+)", tail(log, 10**7)[seen:]):
        return int(m.group(1))
    return -1 if proc.poll() is not None else None


class DeploymentError(RuntimeError):
    """Something went wrong starting or reading the stack; the message says what and where."""


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll `check` until it returns something truthy; DeploymentError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        if result := check():
            return result
        if time.monotonic() > deadline:
            raise DeploymentError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return strip_colours(path.read_text(errors="replace"))[-chars:]
    except OSError:
        return f"<no {path}>"


# ---------------------------------------------------------------------------- our processes, exactly


@dataclass(frozen=True)
class Spawned:
    """A process `up` started: its id, start time and command (program name and arguments).

    `command` is checked as a substring of the live command line: a console script runs as
    `python /path/to/flower-superlink ARGS`, and nginx's master rewrites its title to
    `nginx: master process nginx ARGS`, both of which contain `flower-superlink ARGS` and
    `nginx ARGS`."""

    pid: int
    start: int
    command: str

    @classmethod
    def of(cls, pid: int, cmd: Sequence[str]) -> Spawned:
        """The record of `pid`, just started with `cmd` (Popen returns after the exec)."""
        fields = proc_stat(pid)
        if fields is None:
            raise DeploymentError(f"{cmd[0]} (pid {pid}) is gone before its start time could be read")
        return cls(pid, int(fields[19]), " ".join([Path(cmd[0]).name, *cmd[1:]]))

    def matches(self, info: ProcInfo | None) -> bool:
        """Is `info` (the live process with our pid) this very process, still running it?"""
        return (
            info is not None and info.state != "Z" and info.start == self.start
            and self.command in cmdline(self.pid)
        )  # fmt: skip

    def gone(self, info: ProcInfo | None) -> bool:
        """Has this process ended (no process with its pid, or its own unreaped zombie)?"""
        return info is None or (info.state == "Z" and info.start == self.start)


def owned_processes(records: Iterable[Spawned]) -> set[int]:
    """The live processes that belong to `records`: each recorded process that is still the one
    recorded, the members of its session (started with it or after; Flower's SuperExecs and
    the ServerApps and ClientApps they start stay in it, and so do the ones orphaned by a
    crash), and all their descendants. A recorded pid that now names another process counts
    for nothing, session included (its session members joined that other process). A session
    whose leader has ended still counts: Linux does not hand out a pid while a session or group
    still uses it as its id. Never this process or its ancestors; zombies are left out."""
    table = proc_table()
    protected = protected_pids(table)
    found: set[int] = set()
    sessions: dict[int, int] = {}  # session id -> the earliest start time of its members
    for rec in records:
        info = table.get(rec.pid)
        if rec.matches(info):
            found.add(rec.pid)
        elif not rec.gone(info):
            continue  # the pid is someone else's now
        sessions[rec.pid] = rec.start
    found |= {p for p, i in table.items() if i.sid in sessions and i.start >= sessions[i.sid]}
    while children := {p for p, i in table.items() if i.ppid in found} - found:
        found |= children
    return {p for p in found - protected if table[p].state != "Z"}


def stop_owned(records: Iterable[Spawned], grace_s: float = 0.0) -> None:
    """SIGTERM what belongs to `records` for up to `grace_s`, then SIGKILL; DeploymentError
    naming any process that survives."""
    records = list(records)
    try:
        stop_found(lambda: owned_processes(records), "the local deployment", grace_s)
    except RuntimeError as err:
        raise DeploymentError(str(err)) from None


def nginx_worker_user() -> str | None:
    """The `user` directive's value for nginx's workers when we are root (else None: the
    workers run as we do): Debian's www-data when it exists, else nobody, each with its own
    primary group. Never root: a worker parses what strangers send."""
    if os.geteuid() != 0:
        return None
    for name in ("www-data", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        try:
            group = grp.getgrgid(entry.pw_gid).gr_name
        except KeyError:
            group = str(entry.pw_gid)
        return f"{name} {group}"
    raise DeploymentError("nginx runs as root here and needs an unprivileged user for its workers: add www-data")


class Deployment:
    """A SuperLink, its SuperExec and `num_nodes` SuperNodes on 127.0.0.1, state under `root`.

    `data_paths`: one data file per node (`data-path=` node config); None gives each node a
    demo partition (`partition-id`/`num-partitions`) instead. `node_configs`: each node's whole
    `--node-config` instead (a two-level deployment's aggregators and sites: `TwoLevel`).
    `edge`: SuperNodes connect through nginx with docker/server/fleet-edge.conf.template, as in
    the server compose file. `regions`: the regional deployments under `region-<r>/` (`TwoLevel`).
    """

    def __init__(
        self,
        root: Path,
        num_nodes: int = 2,
        secure: bool = True,
        data_paths: Sequence[Path] | None = None,
        edge: bool = False,
        port: int | None = None,
        node_configs: Sequence[str] | None = None,
        regions: int = 0,
        status_login: Sequence[str] | None = None,
    ) -> None:
        if edge and not secure:
            raise DeploymentError("the edge terminates TLS with the SuperLink's certificate: drop --insecure")
        if data_paths is not None and len(data_paths) != num_nodes:
            raise DeploymentError(f"{len(data_paths)} data files for {num_nodes} nodes: give one per node")
        if node_configs is not None and len(node_configs) != num_nodes:
            raise DeploymentError(f"{len(node_configs)} node configs for {num_nodes} nodes: give one per node")
        self.root = Path(root).expanduser().resolve()
        self.num_nodes, self.secure, self.edge = num_nodes, secure, edge
        self.data_paths = [Path(p).resolve() for p in data_paths] if data_paths is not None else None
        self.node_configs = list(node_configs) if node_configs is not None else None
        self.regions = regions
        # [username, password file] every site publishes its status-channel heartbeats with
        self.status_login = list(status_login) if status_login else None
        self.port = port or free_ports(1)[0]
        self.node_ports = free_ports(num_nodes)
        self.fleet_port = free_ports(1)[0] if edge else self.port
        self.pids: dict[str, int] = {}  # name -> process id (`procs` holds what identifies each)
        self.procs: dict[str, Spawned] = {}
        self.node_ids: list[int] = []

    # ------------------------------------------------------------------ state on disk

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def creds(self) -> Path:
        return self.root / "creds"

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        state = {
            "num_nodes": self.num_nodes, "secure": self.secure, "edge": self.edge, "port": self.port,
            "node_ports": self.node_ports, "fleet_port": self.fleet_port, "node_ids": self.node_ids,
            "pids": self.pids, "processes": {name: asdict(rec) for name, rec in self.procs.items()},
            "data_paths": [str(p) for p in self.data_paths] if self.data_paths else None,
            "node_configs": self.node_configs, "regions": self.regions, "status_login": self.status_login,
        }  # fmt: skip
        (self.root / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    @classmethod
    def load(cls, root: Path) -> Deployment:
        """The deployment recorded under `root` by an earlier `up`."""
        root = Path(root).expanduser().resolve()
        try:
            state = json.loads((root / STATE_FILE).read_text())
        except FileNotFoundError:
            raise DeploymentError(f"no {STATE_FILE} in {root}: nothing was brought up there") from None
        data = state["data_paths"]
        fed = cls(
            root, state["num_nodes"], state["secure"], data and [Path(p) for p in data], state["edge"],
            node_configs=state.get("node_configs"), regions=state.get("regions", 0),
            status_login=state.get("status_login"),
        )  # fmt: skip
        fed.port, fed.node_ports, fed.fleet_port = state["port"], state["node_ports"], state["fleet_port"]
        fed.node_ids, fed.pids = state["node_ids"], state["pids"]
        fed.procs = {name: Spawned(**rec) for name, rec in state.get("processes", {}).items()}
        return fed

    def running(self) -> dict[str, bool]:
        """Each recorded long-running process: still the very process `up` started, or not (a
        process id without its record, from an older version of this script, counts as not)."""
        table = proc_table()
        return {
            name: name in self.procs and self.procs[name].matches(table.get(pid)) for name, pid in self.pids.items()
        }

    def stop(self, names: Iterable[str], grace_s: float = 0.0) -> None:
        """Stop the recorded processes `names` with what they started (`owned_processes`)."""
        stop_owned([self.procs[n] for n in names if n in self.procs], grace_s)

    # ------------------------------------------------------------------ processes

    def env(self, home: str) -> dict[str, str]:
        """Environment of every process: a private FLWR_HOME under the state directory,
        nothing installed from the network."""
        path = self.root / home
        path.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ,
            "FLWR_HOME": str(path),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "MPLCONFIGDIR": str(self.root / "matplotlib"),  # the ServerApp's plots cache fonts here
            "PYTHONUNBUFFERED": "1",  # logs reach the files as they are written
        }

    def spawn(
        self, home: str, cmd: list[str], cwd: Path | None = None, log_name: str = "output.log"
    ) -> tuple[subprocess.Popen, Path]:
        """Start `cmd` in the background (own session) with its output in `<home>/<log_name>`."""
        env = self.env(home)
        log = self.root / home / log_name
        with log.open("ab") as out:
            proc = subprocess.Popen(
                cmd, env=env, cwd=cwd or env["FLWR_HOME"], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        if home != "cli":  # recorded at once: `down` must find it even if `up` fails later
            self.pids[home] = proc.pid
            self.procs[home] = Spawned.of(proc.pid, cmd)
            self.save()
        return proc, log

    def _wait_listening(self, proc: subprocess.Popen, log: Path, port: int, what: str) -> None:
        def listening() -> bool:
            if proc.poll() is not None:
                raise DeploymentError(f"{what} exited {proc.returncode}; its log {log}:\n{tail(log)}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_until(listening, START_TIMEOUT_S, f"{what} on port {port} (log: {log})")

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """A short `flwr` command with the deployment's config.toml (connection "local")."""
        return subprocess.run(
            [flwr_cli(), *args], env=self.env("cli"), cwd=REPO, capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def write_cli_config(self, name: str, root_certificates: Path | None, port: int | None = None) -> None:
        """A `[superlink.<name>]` entry in <state>/cli/config.toml for the SuperLink (or `port`);
        CONNECTION is made the default."""
        home = Path(self.env("cli")["FLWR_HOME"])
        credentials.write_flwr_config(name, f"127.0.0.1:{port or self.port}", root_certificates, home)
        text = (home / "config.toml").read_text()
        if not text.startswith("[superlink]\n"):
            (home / "config.toml").write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n' + text)

    def _make_credentials(self) -> None:
        """TLS for 127.0.0.1/localhost and the SuperExec secret, kept across `up`s."""
        if not (self.creds / "ca.crt").exists():
            credentials.make_tls(self.creds, ["localhost"], ["127.0.0.1"])
        credentials.make_superexec_secret(self.creds / "superexec.secret")

    def _superlink_security(self) -> list[str]:
        if not self.secure:
            return ["--insecure"]
        c = self.creds
        return [
            "--ssl-ca-certfile", str(c / "ca.crt"), "--ssl-certfile", str(c / "superlink.crt"),
            "--ssl-keyfile", str(c / "superlink.key"), "--enable-supernode-auth",
            "--isolation", "process", "--superexec-auth-secret-file", str(c / "superexec.secret"),
        ]  # fmt: skip

    def start_superlink(self) -> None:
        """The SuperLink on its database (a restart keeps runs, nodes and keys) and, when
        secure, its own `flower-superexec` for the ServerApps (the Runtime API is locked)."""
        if self.secure:
            self._make_credentials()
        proc, log = self.spawn(
            "superlink",
            [
                "flower-superlink", *self._superlink_security(), "--host", "127.0.0.1", "--port", str(self.port),
                "--database", str(self.root / "superlink" / "state.db"),
                "--disable-runtime-dependency-installation",
            ],
        )  # fmt: skip
        self._wait_listening(proc, log, self.port, "flower-superlink")
        if self.secure:
            self.start_superexec()

    def start_superexec(self) -> None:
        """The SuperLink's `flower-superexec`, which runs the ServerApps (secure stack only)."""
        self.spawn(
            "superexec",
            [
                "flower-superexec", "--runtime-api-address", self.address,
                "--root-certificates", str(self.creds / "ca.crt"),
                "--superexec-auth-secret-file", str(self.creds / "superexec.secret"),
            ],
        )  # fmt: skip

    def start_edge(self) -> None:
        """nginx with the shipped Fleet-only proxy config in front of the SuperLink."""
        home = self.root / "edge"
        for sub in ("tmp", "logs"):
            (home / sub).mkdir(parents=True, exist_ok=True)
        template = (REPO / "docker" / "server" / "fleet-edge.conf.template").read_text()
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
        # Run as root, nginx's workers (which parse what strangers send) drop to an unprivileged
        # user. The master reads the configuration, the certificates and the key and opens the logs
        # before that, as root; the workers only need to hold request bodies, which they could not
        # write into a state directory only its owner may enter: bodies are kept in memory up to
        # the template's cap (bigger ones are refused with 413 anyway), so they never touch disk.
        # The buffer is 1 MiB over the cap: a chunked body is measured as it arrives, and one that
        # filled the buffer exactly would be spilled to disk (a 500) before its excess is seen (413).
        user = nginx_worker_user()
        cap = re.search(r"^\s*client_max_body_size\s+(\d+)([kKmM]?);", template, re.M)
        cap_bytes = int(cap.group(1)) << {"": 0, "k": 10, "m": 20}[cap.group(2).lower()] if cap else 0
        (home / "nginx.conf").write_text(
            (f"user {user};\n" if user else "")
            + f"pid {home / 'nginx.pid'};\nerror_log {home / 'logs' / 'error.log'} info;\nevents {{}}\n"
            + f"http {{\n {log_format}\n access_log {home / 'logs' / 'access.log'} edge;\n {temp}\n"
            + (f" client_body_buffer_size {cap_bytes + (1 << 20)};\n" if cap_bytes else "")
            + f" include {home / 'fleet-edge.conf'};\n}}\n"
        )
        proc, log = self.spawn("edge", ["nginx", "-p", str(home), "-c", str(home / "nginx.conf"), "-g", "daemon off;"])
        self._wait_listening(proc, log, self.fleet_port, "nginx")

    def node_config(self, i: int) -> str:
        """Node `i`'s name (node-i, as its key and home: the server's logs show it beside the node
        id) and data: its file (a TOML string: quoted, absolute), else a demo partition; or the
        node config given for it (`node_configs`)."""
        if self.node_configs:
            return self.node_configs[i]
        name = f'name="node-{i}"'
        if self.secure:  # its key for signed work records (docs/ledger.md#signed-work-records)
            name += f' work-key="{self.work_key(f"node-{i}")}"'
        if self.status_login:  # its status-channel login (docs/monitoring.md#the-mqtt-status-channel)
            user, password_file = self.status_login
            name += f' status-username="{user}" status-password-file="{Path(password_file).resolve()}"'
        if self.data_paths:
            return f'{name} data-path="{self.data_paths[i]}"'
        return f"{name} partition-id={i} num-partitions={self.num_nodes}"

    def node_keys(self, name: str) -> tuple[Path, Path]:
        """(private, public) key of node `name`, made on first use and kept after."""
        private = self.creds / "keys" / name
        if private.exists():
            return private, private.with_name(f"{name}.pub")
        ((private, public),) = credentials.make_node_keys(self.creds / "keys", [name])
        return private, public

    @property
    def work_keys(self) -> Path:
        """The registered sites' public work keys: a run's `ledger.work_keys`."""
        return self.creds / "work-keys"

    def work_key(self, name: str) -> Path:
        """Node `name`'s private work key (beside its SuperNode key), made on first use and kept after;
        its public half goes into `work_keys`."""
        private = self.creds / "keys" / f"{name}.work.key"
        if not private.exists():
            ((private, public),) = credentials.make_work_keys(self.creds / "keys", [name])
            self.work_keys.mkdir(parents=True, exist_ok=True)
            (self.work_keys / public.name).write_bytes(public.read_bytes())
        return private

    def spawn_node(self, name: str, port: int, i: int, register_key: bool) -> tuple[subprocess.Popen, Path]:
        """A SuperNode for data `i`; when secure, with its own key pair (registered or not)."""
        security = ["--insecure"]
        if self.secure:
            private, public = self.node_keys(name)
            if register_key:
                register([public], CONNECTION, self.env("cli"))
            security = ["--root-certificates", str(self.creds / "ca.crt"), "--auth-supernode-private-key", str(private)]
        return self.spawn(
            name,
            [
                "flower-supernode", *security, "--superlink", f"127.0.0.1:{self.fleet_port}", "--port", str(port),
                "--node-config", self.node_config(i),
            ],
        )  # fmt: skip

    def start_node(self, i: int) -> None:
        """SuperNode `i` (name node-i), until the SuperLink has given it a node id.

        A node killed without saying goodbye still counts as online until HEARTBEAT_PATIENCE
        heartbeats have passed (60 s with Flower's defaults), and the SuperLink refuses to
        activate its key again until then (the SuperNode exits 305, "Failed to activate
        SuperNode"). `up` soon after a crash is the normal case, so that refusal is retried
        until the old session has expired, saying so once."""
        name = f"node-{i}"
        deadline = time.monotonic() + ACTIVATION_PATIENCE_S
        register_key = True
        while True:
            log = self.root / name / "output.log"
            seen = len(tail(log, 10**7))  # a restart appends to the log: read only what is new
            proc, log = self.spawn_node(name, self.node_ports[i], i, register_key=register_key)
            what = f"SuperNode {name} to connect (log: {log})"
            node = wait_until(lambda p=proc, lg=log, n=seen: _node_id(p, lg, n), START_TIMEOUT_S, what)
            if node >= 0:
                self.node_ids[i:i + 1] = [node]  # fmt: skip
                return
            refused = STILL_ONLINE in tail(log, 10**7)[seen:]
            if not refused or time.monotonic() > deadline:
                raise DeploymentError(f"flower-supernode {name} exited {proc.returncode}; its log {log}:\n{tail(log)}")
            if register_key:
                print(
                    f"{name}: the SuperLink still counts its previous run as online (a node is marked offline "
                    f"{HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL} s after its last heartbeat); retrying every "
                    f"{ACTIVATION_RETRY_S:.0f} s for up to {ACTIVATION_PATIENCE_S:.0f} s",
                    flush=True,
                )
            register_key = False  # registered on the first try
            time.sleep(ACTIVATION_RETRY_S)

    def online_nodes(self) -> set[int]:
        """Node ids `flwr supernode list` shows online (empty when the SuperLink does not answer)."""
        proc = self.cli("supernode", "list", CONNECTION, "--format", "json")
        try:
            nodes = parse_flwr_json(proc.stdout)["nodes"]
        except (ValueError, KeyError):
            return set()
        return {int(n["node-id"]) for n in nodes if n["status"] == "online"}

    def wait_nodes_online(self, timeout: float = 30.0) -> None:
        wait_until(
            lambda: set(self.node_ids) <= self.online_nodes(), timeout, f"{self.num_nodes} nodes online", 1.0
        )  # fmt: skip

    # ------------------------------------------------------------------ up / down / status

    def up(self) -> list[str]:
        """Start what is not running (all of it the first time); the names started."""
        self.root.mkdir(parents=True, exist_ok=True)
        running = self.running()
        started = []
        if not running.get("superlink"):
            if self.pids:  # a restart: nothing of the old server side may linger
                self.stop(["superlink", "superexec"], grace_s=5.0)
            self.start_superlink()
            started += ["superlink", "superexec"] if self.secure else ["superlink"]
        elif self.secure and not running.get("superexec"):  # the SuperLink is up, its SuperExec died
            self.stop(["superexec"])  # the ServerApps it left behind
            self.start_superexec()
            started.append("superexec")
        if self.edge and not running.get("edge"):
            self.start_edge()
            started.append("edge")
        self.write_cli_config(CONNECTION, self.creds / "ca.crt" if self.secure else None)
        if self.secure:
            wait_for_superlink(CONNECTION, self.env("cli"), START_TIMEOUT_S, f"at {self.address}")
        self.node_ids += [0] * (self.num_nodes - len(self.node_ids))
        for i in range(self.num_nodes):
            if not running.get(f"node-{i}"):
                self.stop([f"node-{i}"])  # a crashed node's SuperExec and ClientApps (its session)
                self.start_node(i)
                started.append(f"node-{i}")
        self.save()
        self.wait_nodes_online(timeout=180.0)  # nodes that outlived a SuperLink restart retry with back-off
        return started

    def homes(self) -> list[str]:
        """The processes' FLWR_HOMEs under the state directory, nodes first; not the CLI's
        (a `flwr run --stream` someone follows a run with is theirs, not the stack's)."""
        nodes = [f"node-{i}" for i in range(self.num_nodes)]
        return [*nodes, *sorted({*self.pids, "edge", "superexec", "superlink"} - {*nodes, "superlink"}), "superlink"]

    def down(self, grace_s: float = 10.0) -> list[str]:
        """Stop every process `up` started here (SIGTERM, then SIGKILL), with what they spawned
        (the SuperLink's detached SuperExec, ServerApps, ClientApps): only while each is still
        the process recorded (`Spawned`). Returns a warning per recorded process id that could
        not be checked (recorded by an older version of this script) and was left alone."""
        for home in self.homes():
            self.stop([home], grace_s=grace_s)
        unchecked = [
            f"{name} (pid {pid}) was recorded without its start time (an older local_deployment.py): "
            "left alone; stop it yourself if it is still the stack's"
            for name, pid in self.pids.items() if name not in self.procs
        ]  # fmt: skip
        self.pids, self.procs = {}, {}
        self.save()
        return unchecked

    def status(self, submit: str | None = "name=exp1 resume=auto") -> str:
        """A few lines for a person: processes, nodes online, and how to submit a run with the
        overrides `submit` (None: no such line)."""
        lines = [
            f"state directory {self.root}; SuperLink at {self.address}" + (" (insecure)" if not self.secure else "")
        ]
        for name, up in self.running().items():
            lines.append(f"  {name:<10} pid {self.pids[name]:<8} {'running' if up else 'NOT RUNNING'}")
        if not self.pids:
            lines.append("  nothing running (down)")
        else:
            online = self.online_nodes()
            lines.append(f"  nodes online: {sum(n in online for n in self.node_ids)} of {self.num_nodes}")
        if submit is not None:
            lines.append(
                f"submit a run:  FLWR_HOME={self.root / 'cli'} flwr run {REPO} {CONNECTION} --stream "
                f"--run-config \"overrides='{submit}'\""
            )
            if self.secure and self.node_configs is None:
                lines.append(f"  signed work records (docs/ledger.md): add ledger.work_keys={self.work_keys} to it")
        return "\n".join(lines)

    def close(self) -> None:
        """`down` without the grace period (tests)."""
        self.down(grace_s=0.0)


# ---------------------------------------------------------------------------- two levels


def region_dir(root: Path, r: int) -> Path:
    return root / f"region-{r}"


class TwoLevel:
    """A two-level deployment (topology=regions, docs/deployment.md#regions-two-level-deployment):
    `regions` regional stacks, each a `Deployment` under `<root>/region-<r>` (its SuperLink,
    SuperExec and site SuperNodes, with credentials of its own: CA, certificate, SuperExec secret,
    node keys), and the global one under `root`, whose SuperNodes are the regional aggregators
    (authenticated with the global level's keys). An aggregator reaches its regional SuperLink
    through the region's `cli/` FLWR_HOME (the region's CA) and writes its sub-runs' results
    under `<root>/region-<r>/runs`, where the regional SuperExec writes them too (one host)."""

    def __init__(self, top: Deployment, regions: list[Deployment]) -> None:
        self.top, self.regions = top, regions

    @staticmethod
    def aggregator_config(root: Path, r: int, region_overrides: str) -> str:
        """Aggregator r's node config: its name, its regional SuperLink (the connection, the
        FLWR_HOME that names it), where its sub-runs write, and the region's own overrides."""
        if '"' in region_overrides:
            raise DeploymentError("--region-overrides travels as a TOML string in the node config: no double quotes")
        home = region_dir(root, r)
        return (
            f'name="region-{r}" region-superlink="{CONNECTION}" region-flwr-home="{home / "cli"}" '
            f'region-output-dir="{home / "runs"}" region-overrides="{region_overrides}"'
        )

    @classmethod
    def create(
        cls,
        root: Path,
        regions: int,
        nodes_per_region: int,
        secure: bool,
        data_paths: Sequence[Path],
        port: int | None,
        region_overrides: str = "",
    ) -> TwoLevel:
        """The stacks of a fresh two-level deployment (nothing started): region r's sites train on
        data files r*n .. r*n+n-1."""
        if len(data_paths) != regions * nodes_per_region:
            raise DeploymentError(f"{len(data_paths)} data files for {regions} x {nodes_per_region} sites")
        stacks = []
        for r in range(regions):
            files = data_paths[r * nodes_per_region : (r + 1) * nodes_per_region]
            sites = [f'name="region-{r}-site-{i}" data-path="{Path(f).resolve()}"' for i, f in enumerate(files)]
            stacks.append(Deployment(region_dir(root, r), nodes_per_region, secure, files, node_configs=sites))
        aggregators = [cls.aggregator_config(root, r, region_overrides) for r in range(regions)]
        top = Deployment(root, regions, secure, port=port, node_configs=aggregators, regions=regions)
        return cls(top, stacks)

    @classmethod
    def load(cls, top: Deployment) -> TwoLevel:
        """The two-level deployment whose global stack `top` was loaded from `deployment.json`."""
        return cls(top, [Deployment.load(region_dir(top.root, r)) for r in range(top.regions)])

    def up(self) -> list[str]:
        """The regions first (an aggregator's task needs its SuperLink), then the global stack. The
        global deployment.json, which names the regions, is written first: a `down` after an `up`
        that failed half-way finds every stack."""
        self.top.save()
        started = []
        for r, region in enumerate(self.regions):
            started += [f"region-{r}/{name}" for name in region.up()]
        return started + self.top.up()

    def down(self, grace_s: float = 10.0) -> list[str]:
        """The global stack first (its aggregators drive the regions' runs), then each region."""
        warnings = self.top.down(grace_s)
        for region in self.regions:
            warnings += region.down(grace_s)
        return warnings

    def status(self) -> str:
        lines = [self.top.status(submit=f"topology=regions topology.regions={self.top.regions} name=exp1 resume=auto")]
        for r, region in enumerate(self.regions):
            lines.append(f"region {r}: " + region.status(submit=None))
        return "\n".join(lines)


def load(root: Path) -> Deployment | TwoLevel:
    """The deployment `up` recorded under `root`: one level, or two (`regions` in deployment.json)."""
    fed = Deployment.load(root)
    return TwoLevel.load(fed) if fed.regions else fed


def _check_state_dir(path: Path, allow_in_repo: bool) -> None:
    """Refuse a state directory that git would commit (it holds private keys)."""
    if not allow_in_repo:
        try:
            credentials.refuse_work_tree(path)
        except ValueError as err:
            raise DeploymentError(str(err).replace("--out", "--state-dir")) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--state-dir", type=Path, default=Path("~/fedgpu-local"), help="default ~/fedgpu-local")
    parser.add_argument("--nodes", type=int, help="SuperNodes, one data file each (up; default 2)")
    parser.add_argument("--port", type=int, default=9092, help="the SuperLink's port on 127.0.0.1 (up; default 9092)")
    parser.add_argument("--data", type=Path, nargs="+", help="one data file per node (up; default: exported demo data)")
    parser.add_argument("--overrides", default="", help="Hydra overrides for the exported demo data (up)")
    parser.add_argument("--insecure", action="store_true", help="no TLS, no node authentication (up; a first look)")
    parser.add_argument("--edge", action="store_true", help="nodes connect through the nginx Fleet edge (up)")
    parser.add_argument(
        "--regions", type=int, help="a two-level deployment of this many regions (up; topology=regions)"
    )
    parser.add_argument("--nodes-per-region", type=int, help="site SuperNodes per region (up; with --regions)")
    parser.add_argument(
        "--region-overrides", default="", help="Hydra overrides of every region's sub-runs, after the global run's (up)"
    )
    parser.add_argument(
        "--status-login",
        nargs=2,
        metavar=("USERNAME", "PASSWORD_FILE"),
        help="the MQTT status channel's login every site publishes its heartbeats with (up; docs/monitoring.md)",
    )
    parser.add_argument("--purge", action="store_true", help="delete the state directory after stopping (down)")
    parser.add_argument("--allow-in-repo", action="store_true", help="allow a state directory git does not ignore")
    args = parser.parse_args(argv)
    if (args.regions is None) != (args.nodes_per_region is None):
        parser.error("--regions and --nodes-per-region go together (e.g. --regions 2 --nodes-per-region 2)")
    if args.regions is not None:
        if args.regions < 1 or args.nodes_per_region < 1:
            parser.error("--regions and --nodes-per-region must be at least 1")
        if args.nodes is not None or args.edge:
            parser.error("--nodes and --edge are for a one-level deployment; a two-level one takes --nodes-per-region")
        if args.data and len(args.data) != args.regions * args.nodes_per_region:
            parser.error(f"--data needs {args.regions * args.nodes_per_region} files: region r gets the r-th slice")
    elif args.region_overrides:
        parser.error("--region-overrides needs --regions")
    root = args.state_dir.expanduser().resolve()
    os.environ["MPLCONFIGDIR"] = str(root / "matplotlib")  # Flower Datasets imports matplotlib: not in ~/.cache
    try:
        if args.command == "up":
            _check_state_dir(root, args.allow_in_repo)
            if (root / STATE_FILE).exists():
                fed = load(root)
                if isinstance(fed, TwoLevel):
                    held, same = (
                        f"{fed.top.regions} regions",
                        args.nodes is None and args.regions in (None, fed.top.regions),
                    )
                else:
                    held, same = f"{fed.num_nodes} nodes", args.regions is None and args.nodes in (None, fed.num_nodes)
                if not same:
                    raise DeploymentError(
                        f"{root} holds a deployment of {held}: bring that one up (no --nodes / --regions), "
                        "or `down --purge` it first, or use another --state-dir"
                    )
            else:
                regional = args.regions is not None
                nodes = len(args.data) if args.data else (args.regions * args.nodes_per_region if regional else 0)
                nodes = nodes or args.nodes or 2
                if nodes < 1 or (args.data and args.nodes not in (None, nodes)):
                    parser.error("--nodes must be at least 1 and match the number of --data files")
                if args.edge and shutil.which("nginx") is None:
                    raise DeploymentError("--edge needs nginx on PATH (apt-get install nginx)")
                data = args.data
                if data is None:
                    print(f"exporting {nodes} demo data files to {root / 'data'} ...", flush=True)
                    data = export_partitions(root / "data", nodes, args.overrides)
                missing = [str(p) for p in data if not Path(p).is_file()]
                if missing:
                    raise DeploymentError(f"data file(s) not found: {', '.join(missing)}")
                if regional:
                    fed = TwoLevel.create(
                        root, args.regions, args.nodes_per_region, not args.insecure, data, args.port,
                        args.region_overrides,
                    )  # fmt: skip
                else:
                    fed = Deployment(
                        root, len(data), not args.insecure, data, args.edge, args.port, status_login=args.status_login
                    )
            started = fed.up()
            print(f"started: {', '.join(started) or 'nothing (all running)'}", flush=True)
        elif args.command == "down":
            fed = load(root)
            for warning in fed.down():
                print(f"warning: {warning}", file=sys.stderr)
            print(f"stopped everything under {root}")
            if args.purge:
                shutil.rmtree(root)
                print(f"deleted {root}")
            return 0
        else:
            fed = load(root)
        print(fed.status())
    except (DeploymentError, RuntimeError) as err:  # RegistrationError too
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

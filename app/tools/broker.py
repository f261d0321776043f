"""A local Mosquitto broker for the status channel (Debian's `mosquitto`): TLS with a fresh CA
and a certificate for 127.0.0.1, a password file and the shipped ACL (docker/monitoring/mosquitto.acl),
on a free loopback port. What the tests and the channel's benchmark talk to; `stop()` kills it (a broker that dies), `start()` brings it back on
the same port."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

from app.status.channel import Broker
from app.tools.processes import free_ports

ROOT = Path(__file__).resolve().parents[2]
ACL = ROOT / "docker" / "monitoring" / "mosquitto.acl"  # who may write and read what: the deployment's own
START_TIMEOUT_S = 60.0  # a hang detector: mosquitto starts in well under a second


def _credentials():  # noqa: ANN202 - scripts/credentials.py is a script, not a package module
    spec = importlib.util.spec_from_file_location("credentials", ROOT / "scripts" / "credentials.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def missing() -> str | None:
    """Why no local broker can start here (None: it can)."""
    for tool in ("mosquitto", "mosquitto_passwd"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (Debian's mosquitto package; .ci/run installs it)"
    return None


class LocalBroker:
    """Mosquitto under `root` with users `server`, `watcher` and the sites `node` and `site-b`
    (password: `<user>-secret`, also in `root/<user>.pw`)."""

    USERS = ("server", "node", "watcher", "site-b")

    def __init__(self, root: Path) -> None:
        self.root, self.port = Path(root), free_ports(1)[0]
        self.root.mkdir(parents=True, exist_ok=True)
        certs = _credentials().make_tls(self.root / "certs", [], ["127.0.0.1"])
        self.ca: Path = certs["ca_cert"]
        passwords = self.root / "passwords"
        for i, user in enumerate(self.USERS):
            create = ["-c"] if i == 0 else []
            subprocess.run(["mosquitto_passwd", "-b", *create, str(passwords), user, f"{user}-secret"], check=True)
            (self.root / f"{user}.pw").write_text(f"{user}-secret\n")
        conf = [
            f"listener {self.port} 127.0.0.1",
            f"cafile {self.ca}",
            f"certfile {certs['cert']}",
            f"keyfile {certs['key']}",
            "allow_anonymous false",
            f"password_file {passwords}",
            f"acl_file {ACL}",
            "persistence false",
        ]
        if os.geteuid() == 0:  # as root mosquitto drops to user `mosquitto`, which cannot read the 0600 key
            conf.append("user root")
        (self.root / "mosquitto.conf").write_text("\n".join(conf) + "\n")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start mosquitto and wait until its log says it is running."""
        log_path = self.root / "mosquitto.log"
        before = log_path.read_text().count(" running") if log_path.exists() else 0
        with log_path.open("a") as log:
            self.proc = subprocess.Popen(["mosquitto", "-c", str(self.root / "mosquitto.conf")], stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while log_path.read_text().count(" running") <= before:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("mosquitto did not start:\n" + log_path.read_text()[-2000:])
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def overrides(self, queue: int = 1000) -> list[str]:
        """The run's `monitoring.mqtt.*` overrides for this broker (the `server` user)."""
        return [
            "monitoring.mqtt.host=127.0.0.1",
            f"monitoring.mqtt.port={self.port}",
            f"monitoring.mqtt.ca={self.ca}",
            "monitoring.mqtt.username=server",
            f"monitoring.mqtt.password_file={self.root / 'server.pw'}",
            f"monitoring.mqtt.queue={queue}",
        ]

    def login(self, user: str) -> Broker:
        """This broker as `user` connects to it."""
        return Broker("127.0.0.1", self.port, ca_file=str(self.ca), username=user, password=f"{user}-secret")

    def watcher(self) -> Broker:
        """This broker as a `watcher` (who reads every topic) connects to it."""
        return self.login("watcher")

    def node_env(self) -> dict[str, str]:
        """Simulated nodes' credentials (the environment of the `flwr run` that starts the SuperLink)."""
        return {"FEDGPU_STATUS_USERNAME": "node", "FEDGPU_STATUS_PASSWORD_FILE": str(self.root / "node.pw")}

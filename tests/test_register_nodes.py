"""scripts/register_nodes.py against a real `flower-superlink` on loopback (TLS and
SuperNode authentication, as deployed: Flower 1.42 refuses `--enable-supernode-auth`
without TLS), started by scripts/local_deployment.py under the test's temporary directory;
teardown stops every process marked with that path."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.tools.processes import free_ports, parse_flwr_json
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "register_nodes.py"
credentials = load_script("credentials")
local_deployment = load_script("local_deployment")


def _env(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


def _register(*args: str, home: Path, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=_env(home), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def superlink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """A secure SuperLink on 127.0.0.1, started as scripts/local_deployment.py starts it (TLS,
    node authentication), without nodes: (address, CA certificate, directory for the test's files)."""
    root = tmp_path_factory.mktemp("register").resolve()
    stack = local_deployment.Deployment(root / "stack", num_nodes=0, secure=True)
    try:
        stack.start_superlink()
        yield stack.address, stack.creds / "ca.crt", root
    finally:
        stack.close()


def _node_list(address: str, ca: Path, home: Path) -> list[dict]:
    credentials.write_flwr_config("check", address, ca, home)
    proc = subprocess.run(
        ["flwr", "supernode", "list", "check", "--format", "json"],
        env=_env(home), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    answer = parse_flwr_json(proc.stdout)
    assert answer["success"], answer
    return answer["nodes"]


def test_registers_keys_and_a_second_run_counts_them_as_registered(superlink: tuple[str, Path, Path]) -> None:
    address, ca, root = superlink
    keys = [pub for _, pub in credentials.make_node_keys(root / "keys", ["node-0", "node-1", "node-2"])]
    args = ["--address", address, "--root-certificates", str(ca), *map(str, keys)]

    first = _register(*args, home=root / "cli-1")
    second = _register(*args, home=root / "cli-2")  # e.g. `docker compose up` after a restart

    assert first.returncode == 0, first.stdout + first.stderr
    ids = {int(line.rsplit(" ", 1)[1]) for line in first.stdout.splitlines() if "registered as node" in line}
    assert len(ids) == 3, first.stdout
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("already registered") == 3, second.stdout
    nodes = _node_list(address, ca, root / "cli-check")
    assert {int(n["node-id"]) for n in nodes} == ids, nodes  # exactly the three keys, each once
    assert {n["status"] for n in nodes} == {"registered"}, nodes


def test_a_refused_key_fails_with_the_reason_after_registering_the_others(superlink: tuple[str, Path, Path]) -> None:
    address, ca, root = superlink
    ((_, good),) = credentials.make_node_keys(root / "more-keys", ["good"])
    bad = root / "more-keys" / "bad.pub"
    bad.write_text("not an ssh public key\n")

    proc = _register("--address", address, "--root-certificates", str(ca), str(bad), str(good), home=root / "cli-3")

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{good}: registered as node" in proc.stdout, proc.stdout
    assert "could not register" in proc.stderr and str(bad) in proc.stderr, proc.stderr


def test_missing_key_file_is_named_before_contacting_anything(tmp_path: Path) -> None:
    (port,) = free_ports(1)  # nothing listens: the check must come first
    ((_, present),) = credentials.make_node_keys(tmp_path, ["present"])
    t0 = time.monotonic()
    proc = _register(
        "--address",
        f"127.0.0.1:{port}",
        "--insecure",
        str(present),
        str(tmp_path / "absent.pub"),
        home=tmp_path / "cli",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not found" in proc.stderr and "absent.pub" in proc.stderr and "present.pub" not in proc.stderr
    assert time.monotonic() - t0 < 10


def test_superlink_that_never_answers_gives_a_clear_error_after_the_timeout(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    ((_, pub),) = credentials.make_node_keys(tmp_path, ["lonely"])
    t0 = time.monotonic()
    proc = _register("--address", f"127.0.0.1:{port}", "--insecure", "--timeout", "3", str(pub), home=tmp_path / "cli")
    elapsed = time.monotonic() - t0

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"127.0.0.1:{port} did not answer within 3 s" in proc.stderr, proc.stderr
    assert "unavailable" in proc.stderr, proc.stderr  # Flower's own reason is passed on
    assert 3 <= elapsed < 20, elapsed


def test_unknown_connection_fails_at_once(tmp_path: Path) -> None:
    ((_, pub),) = credentials.make_node_keys(tmp_path, ["n"])
    proc = _register("--connection", "nowhere", "--timeout", "60", str(pub), home=tmp_path / "cli")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "'nowhere' not found" in proc.stderr, proc.stderr


def test_flwr_json_answers_are_read_past_log_lines_and_missing_json_is_an_error() -> None:
    """The one parser of `flwr ... --format json` output (this script, sweeps and the tests use it)."""
    answer = parse_flwr_json('INFO :      Loaded config\n{\n  "success": false,\n  "error-message": "x"\n}\n')
    assert answer == {"success": False, "error-message": "x"}
    with pytest.raises(ValueError, match="no JSON answer"):
        parse_flwr_json("Error: the key file is not an ECDSA key\n")
    with pytest.raises(ValueError):
        parse_flwr_json("{ truncated")

"""scripts/local_deployment.py without starting Flower: bad input is refused before any work,
the state it records is what `status`/`down` read back, `down` stops exactly the processes it
recorded (stand-ins here), and the edge's nginx workers are not root. (The stack itself, up
and down: tests/test_superlink_loopback.py.)"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers import load_script

local_deployment = load_script("local_deployment")


@pytest.fixture(autouse=True)
def _own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() points MPLCONFIGDIR into the state directory: undone after each test."""
    monkeypatch.delenv("MPLCONFIGDIR", raising=False)


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = local_deployment.main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_state_directory_git_would_commit_is_refused_before_anything_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    code, out = _main(capsys, "up", "--state-dir", str(repo / "fedgpu-local"))
    assert code == 1 and "--state-dir" in out and "git work tree" in out, out
    assert not (repo / "fedgpu-local").exists()
    (repo / ".gitignore").write_text("/fedgpu-local/\n")  # ignored: fine (then it fails on the data below)
    code, out = _main(capsys, "up", "--state-dir", str(repo / "fedgpu-local"), "--data", str(tmp_path / "no.npz"))
    assert code == 1 and "data file(s) not found" in out and str(tmp_path / "no.npz") in out, out


def test_missing_data_and_mismatched_counts_are_refused_and_nothing_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    code, out = _main(capsys, "up", "--state-dir", str(state), "--data", str(tmp_path / "a.npz"))
    assert code == 1 and "not found" in out, out
    assert not (state / local_deployment.STATE_FILE).exists()
    with pytest.raises(SystemExit) as exit_:
        local_deployment.main(["up", "--state-dir", str(state), "--nodes", "3", "--data", "x.npz", "y.npz"])
    assert exit_.value.code == 2 and "match the number of --data files" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["status", "down"])
def test_status_and_down_say_when_nothing_was_brought_up(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _main(capsys, command, "--state-dir", str(tmp_path / "nothing"))
    assert code == 1 and "nothing was brought up there" in out, out


def test_the_recorded_deployment_reads_back_and_down_stops_nodes_first_and_never_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [tmp_path / "a.npz", tmp_path / "b.npz"]
    login = ["lab", str(tmp_path / "mqtt.pw")]
    fed = local_deployment.Deployment(
        tmp_path / "state", 2, secure=True, data_paths=files, port=9555, status_login=login
    )
    fed.node_ids, fed.pids = [11, 22], {"superlink": 1, "superexec": 2, "node-0": 3, "node-1": 4, "stranger": 5}
    fed.save()
    back = local_deployment.Deployment.load(tmp_path / "state")
    assert (back.port, back.node_ports, back.node_ids, back.pids) == (9555, fed.node_ports, [11, 22], fed.pids)
    assert back.data_paths == files and back.secure and not back.edge
    key = tmp_path / "state" / "creds" / "keys" / "node-1.work.key"  # made on first use, kept after
    assert back.node_config(1) == (  # TOML strings: quoted
        f'name="node-1" work-key="{key}" status-username="lab" status-password-file="{login[1]}" data-path="{files[1]}"'
    )
    assert key.is_file() and (tmp_path / "state" / "creds" / "work-keys" / "node-1.work.pub").is_file()
    assert back.homes() == ["node-0", "node-1", "edge", "stranger", "superexec", "superlink"]
    code, out = _main(capsys, "up", "--state-dir", str(tmp_path / "state"), "--nodes", "3")
    assert code == 1 and "holds a deployment of 2 nodes" in out, out


def test_an_edge_needs_tls_and_each_node_a_file() -> None:
    with pytest.raises(local_deployment.DeploymentError, match="drop --insecure"):
        local_deployment.Deployment(Path("/tmp/x"), 1, secure=False, edge=True)
    with pytest.raises(local_deployment.DeploymentError, match="one per node"):
        local_deployment.Deployment(Path("/tmp/x"), 2, data_paths=[Path("/tmp/a.npz")])


def _start_stranger(cmd: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    """A process `up` did not start, in a session of its own (like a user's shell)."""
    return subprocess.Popen(
        cmd, cwd=cwd, env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat from field 3 on (state, ppid, pgrp, session, ...: field N at index N - 3)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def _processes() -> dict[int, list[str]]:
    table = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            table[int(entry)] = _stat(int(entry))
        except OSError:
            pass
    return table


def _running(pid: int) -> bool:
    """A live process (not a zombie: the killed children of this test are not reaped at once)."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def test_down_stops_exactly_what_up_started_and_never_a_process_that_merely_names_the_state_directory(
    tmp_path: Path,
) -> None:
    """Stand-ins for the stack, spawned as `up` spawns (own session, recorded): one process, one
    with two children, one whose child outlives it in its session (a crashed SuperNode's
    SuperExec). Next to them: a shell-like process with its working directory and FLWR_HOME in
    the state directory, and two recorded process ids that are no longer what was recorded: a
    pid with another start time (recycled) and one whose command line differs. `down` stops
    the stand-ins and everything they started, and leaves the other three alone."""
    state = tmp_path / "state"
    fed = local_deployment.Deployment(state, 1, secure=True, data_paths=[tmp_path / "a.npz"])
    strangers: list[subprocess.Popen] = []
    ours: list[subprocess.Popen] = []
    try:
        ours.append(fed.spawn("superlink", ["sleep", "300"])[0])
        ours.append(fed.spawn("node-0", ["sh", "-c", "sleep 301 & sleep 302 & wait"])[0])
        orphaning = fed.spawn("superexec", ["sh", "-c", "sleep 303 & exit 0"])[0]
        ours.append(orphaning)
        orphaning.wait(timeout=10)  # gone (and reaped); its child lives on in its session

        def started_by_ours() -> set[int]:
            sessions = {p.pid for p in ours}
            return {p for p, f in _processes().items() if int(f[3]) in sessions and p not in sessions and f[0] != "Z"}

        kids = local_deployment.wait_until(lambda: len(k := started_by_ours()) == 3 and k, 10.0, "the children")
        home = state / "superlink"
        shell = _start_stranger(["sleep", "310"], home, PWD=str(home), FLWR_HOME=str(home), STATE=str(state))
        recycled = _start_stranger(["sleep", "311"], tmp_path, FLWR_HOME=str(state / "edge"))
        renamed = _start_stranger(["sleep", "312"], tmp_path, FLWR_HOME=str(state / "other"))
        strangers += [shell, recycled, renamed]
        recorded = json.loads((state / local_deployment.STATE_FILE).read_text())
        for name, proc, start_shift, command in [("edge", recycled, -1, "sleep 311"), ("other", renamed, 0, "nginx")]:
            recorded["pids"][name] = proc.pid
            recorded.setdefault("processes", {})[name] = {
                "pid": proc.pid, "start": int(_stat(proc.pid)[19]) + start_shift, "command": command,
            }  # fmt: skip
        (state / local_deployment.STATE_FILE).write_text(json.dumps(recorded))

        back = local_deployment.Deployment.load(state)
        seen = back.running()
        back.down(grace_s=5.0)
        alive = {name: _running(p.pid) for name, p in [("shell", shell), ("recycled", recycled), ("renamed", renamed)]}
    finally:
        for proc in strangers + ours:
            proc.kill()
            proc.wait(timeout=10)
    assert alive == {"shell": True, "recycled": True, "renamed": True}, alive
    assert not any(_running(p) for p in kids | {p.pid for p in ours}), "a process `up` started outlived `down`"
    assert seen == {"superlink": True, "node-0": True, "superexec": False, "edge": False, "other": False}, seen
    assert local_deployment.Deployment.load(state).pids == {}


def _uids(pid: int) -> list[int]:
    """Real, effective, saved and filesystem uid of `pid` (/proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(u) for u in line.split()[1:]]
    raise AssertionError(f"no Uid line for pid {pid}")


def test_the_edges_nginx_workers_run_as_an_unprivileged_user(tmp_path: Path) -> None:
    """Run as root, `up --edge` starts nginx whose workers (the processes that parse strangers'
    requests) drop root. They still serve from a state directory only root may enter: a 1 MiB
    body (over nginx's 16 KiB in-memory default, once spilled to a temporary file there) reaches
    the proxy step and gets 502 (no SuperLink behind it), not a 500."""
    if shutil.which("nginx") is None:
        pytest.skip("nginx is not installed (apt-get install nginx; .ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("not running as root: nginx's workers run as this (unprivileged) user already")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    fed = local_deployment.Deployment(state, 0, secure=True, edge=True)
    try:
        fed._make_credentials()
        fed.start_edge()
        master = fed.pids["edge"]
        workers = local_deployment.wait_until(
            lambda: {p for p, f in _processes().items() if int(f[1]) == master}, 10.0, "nginx's worker processes"
        )
        uids = {p: _uids(p) for p in workers}
        url = f"https://127.0.0.1:{fed.fleet_port}/v1/fleet/push-object"
        with httpx.Client(verify=ssl.create_default_context(cafile=fed.creds / "ca.crt"), timeout=60) as client:
            status = client.post(url, content=b"x" * (1 << 20), headers={"content-type": "application/protobuf"})
        error_log = (state / "edge" / "logs" / "error.log").read_text()
    finally:
        fed.close()
    assert _uids(os.getpid())[0] == 0 and uids, uids
    assert all(0 not in ids for ids in uids.values()), f"nginx workers with uid 0: {uids}"
    assert status.status_code == 502, (status.status_code, error_log[-2000:])
    assert "Permission denied" not in error_log, error_log[-2000:]

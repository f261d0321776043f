"""scripts/local_deployment.py without starting anything: bad input is refused before any
work, and the state it records is what `status`/`down` read back. (The stack itself, up and
down: tests/test_superlink_loopback.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

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
    fed = local_deployment.Deployment(tmp_path / "state", 2, secure=True, data_paths=files, port=9555)
    fed.node_ids, fed.pids = [11, 22], {"superlink": 1, "superexec": 2, "node-0": 3, "node-1": 4, "stranger": 5}
    fed.save()
    back = local_deployment.Deployment.load(tmp_path / "state")
    assert (back.port, back.node_ports, back.node_ids, back.pids) == (9555, fed.node_ports, [11, 22], fed.pids)
    assert back.data_paths == files and back.secure and not back.edge
    assert back.node_config(1) == f'data-path="{files[1]}"'  # a TOML string: quoted
    assert back.homes() == ["node-0", "node-1", "edge", "stranger", "superexec", "superlink"]
    code, out = _main(capsys, "up", "--state-dir", str(tmp_path / "state"), "--nodes", "3")
    assert code == 1 and "holds a deployment of 2 nodes" in out, out


def test_an_edge_needs_tls_and_each_node_a_file() -> None:
    with pytest.raises(local_deployment.DeploymentError, match="drop --insecure"):
        local_deployment.Deployment(Path("/tmp/x"), 1, secure=False, edge=True)
    with pytest.raises(local_deployment.DeploymentError, match="one per node"):
        local_deployment.Deployment(Path("/tmp/x"), 2, data_paths=[Path("/tmp/a.npz")])

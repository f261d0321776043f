"""The ServerApp's environment line (app/run/environment.py): what it says, its warnings when
the environment is not the app's, and the supervisor's warning when the ServerApp runs in
another environment than the supervisor's shell (the local SuperLink serves them all)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from app.config.schema import ConfigError
from app.run.environment import NONE, Environment, describe, format_line, log_environment, mismatches, parse_line
from app.tools.processes import alive, free_ports
from app.tools.supervise import LogFollower, environment_warning
from tests.test_local_superlink import NAMES, start

ROOT = Path(__file__).resolve().parents[1]
LINE = "from app.run.environment import describe, format_line; print(format_line(describe()))"


def test_the_line_names_this_environment_and_parses_back() -> None:
    env = describe()
    assert env.python == sys.executable and env.prefix == sys.prefix
    assert env.fedgpu == metadata.version("fedgpu") and env.flwr == metadata.version("flwr")
    assert env.app == metadata.version("fedgpu") and env.app_dir == str(ROOT)  # this checkout is the app
    assert env.torch == metadata.version("torch") and env.runtime_env == NONE
    # as the supervisor reads it from `flwr log`: after Flower's level prefix
    assert parse_line(f"INFO :      {format_line(env)}") == env
    spaced = Environment(**{**env.__dict__, "prefix": "/home/a b/venv", "python": "/home/a b/venv/bin/python"})
    assert parse_line(format_line(spaced)) == spaced
    assert parse_line("INFO :      [ROUND 1/3]") is None
    assert parse_line(f"WARNING :   node 4 failed: {format_line(spaced)}") is None  # quoted, not the ServerApp's


def test_a_fab_of_another_version_and_unmet_requirements_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The app being run is what its pyproject.toml says (the FAB's copy); the environment's
    installed fedgpu and packages are compared with it."""
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "fedgpu"\nversion = "9.9.9"\n'
        'dependencies = ["torch>=99", "numpy>=1", "surely-not-installed-pkg>=1", "x>=1; python_version < \'3\'"]\n'
    )
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu"):
        env = log_environment(tmp_path)
    assert env.app == "9.9.9" and "app=9.9.9" in caplog.text and f"prefix={sys.prefix}" in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert f"fedgpu {env.fedgpu} is installed" in warnings[0] and "version 9.9.9" in warnings[0]
    assert (
        f"torch>=99 (installed {env.torch})" in warnings[1]
        and "surely-not-installed-pkg>=1 (not installed)" in warnings[1]
    )
    assert "numpy" not in warnings[1] and "x>=1" not in warnings[1]  # met, and a marker that does not apply
    assert "python -m app.tools.local_superlink stop" in warnings[0]


def test_fedgpu_missing_is_a_warning_unless_flower_installed_the_requirements_per_run() -> None:
    env = Environment(**{**describe().__dict__, "fedgpu": NONE})
    (problem,) = mismatches(env, [])
    assert "fedgpu is not installed" in problem
    assert mismatches(Environment(**{**env.__dict__, "runtime_env": "/home/u/.flwr/runtime/7"}), []) == []
    assert mismatches(describe(), []) == []


def test_the_serverapp_logs_the_line_before_anything_else(caplog: pytest.LogCaptureFixture) -> None:
    from app.server_app import main

    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"overrides": "strategy=nope"}
    )
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu"), pytest.raises(ConfigError):
        main(None, context)  # type: ignore[arg-type]  # fails on the config, before it needs a grid
    assert caplog.records[0].getMessage().startswith("ServerApp environment: python=")


def test_the_supervisor_warns_when_the_serverapp_runs_in_another_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A ServerApp started from another venv (its line computed by that venv's interpreter)
    and a stand-in local SuperLink of that venv on the Control API port: the supervisor names
    both environments, the SuperLink's pid and the command that stops it."""
    venv = tmp_path / "other env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    line = subprocess.run(
        [str(venv / "bin" / "python"), "-c", LINE], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    env = parse_line(line)
    assert env is not None and Path(env.prefix) == venv and env.python == str(venv / "bin" / "python")
    assert environment_warning(describe()) is None  # this shell's own: nothing to say
    assert environment_warning(Environment(**{**env.__dict__, "host": "elsewhere"})) is None  # a remote ServerApp

    control, http = free_ports(2)
    monkeypatch.setenv("FLWR_LOCAL_CONTROL_API_PORT", str(control))
    monkeypatch.setenv("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", str(http))
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    try:
        pids = start(pids_dir, control, python=str(venv / "bin" / "python"))
        echoed: list[str] = []
        with caplog.at_level(logging.WARNING, logger="flwr.fedgpu.supervise"):
            LogFollower(echoed.append).feed(f"INFO :      {line}\nINFO :      [ROUND 1/3]\n")
    finally:
        for name in NAMES:
            if (pids_dir / name).is_file() and alive(pid := int((pids_dir / name).read_text())):
                os.kill(pid, signal.SIGKILL)
    assert len(echoed) == 2
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"executes in {venv}, not in this shell's {sys.prefix}" in warning
    assert (
        f"local SuperLink (pid {pids['superlink']})" in warning
        and "python -m app.tools.local_superlink stop" in warning
    )

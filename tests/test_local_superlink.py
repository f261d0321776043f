"""Finding the local SuperLink by its port and stopping it by its PID (app/tools/local_superlink.py),
on stand-in processes: one listening on a free port (not the real 39093) with `flower-superlink`
in its command line, a detached child in its own session (Flower's SuperExec) and a grandchild
that ignores SIGTERM (a flwr-simulation that outlives its parents)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.tools import local_superlink
from app.tools.processes import alive, free_ports

# argv: port, the SuperExec stand-in's code, the pid directory, a name ("flower-superlink" makes it a SuperLink)
SUPERLINK = """
import socket, subprocess, sys, time
from pathlib import Path
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]], start_new_session=True)
Path(sys.argv[3], "superlink").write_text(str(__import__("os").getpid()))
time.sleep(600)
"""
SUPEREXEC = """
import os, subprocess, sys, time
from pathlib import Path
code = "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
code += "open(os.path.join(sys.argv[1], 'simulation'), 'w').write(str(os.getpid())); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", code, sys.argv[1]])
Path(sys.argv[1], "superexec").write_text(str(os.getpid()))
time.sleep(600)
"""
NAMES = ("superlink", "superexec", "simulation")


def wait_for(check, timeout: float = 10.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check}")
        time.sleep(0.05)
    return result


def start(tmp: Path, port: int, python: str = sys.executable, program: str = "flower-superlink") -> dict[str, int]:
    """The three stand-ins, started; their pids by role."""
    subprocess.Popen(
        [python, "-c", SUPERLINK, str(port), SUPEREXEC, str(tmp), program],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    wait_for(lambda: all((tmp / n).is_file() and (tmp / n).read_text() for n in NAMES))
    wait_for(lambda: local_superlink.find([port])[0])
    return {n: int((tmp / n).read_text()) for n in NAMES}


@pytest.fixture
def stand_ins(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """(a free port, the pid directory); every stand-in is killed by its pid afterwards."""
    yield free_ports(1)[0], tmp_path
    for name in NAMES:
        if (tmp_path / name).is_file() and alive(pid := int((tmp_path / name).read_text())):
            os.kill(pid, signal.SIGKILL)


def test_status_finds_the_process_on_the_port_with_its_environment_and_what_it_started(
    stand_ins: tuple[int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    port, tmp = stand_ins
    pids = start(tmp, port)
    (link,), strangers = local_superlink.find([port])
    assert link.pid == pids["superlink"] and link.is_superlink and not strangers
    assert Path(link.prefix) == Path(sys.prefix)
    assert link.family() == set(pids.values())  # the detached child's session and its child included
    assert local_superlink.main(["--port", str(port)]) == 0
    out = capsys.readouterr().out
    assert f"pid {pids['superlink']}" in out and "the same as this shell's" in out
    assert f"pid {pids['superexec']}" in out and f"stop --port {port}" in out
    assert local_superlink.find([free_ports(1)[0]]) == ([], set())


def test_stop_ends_it_and_what_it_started_even_a_process_that_ignores_sigterm(
    stand_ins: tuple[int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    port, tmp = stand_ins
    pids = start(tmp, port)
    assert local_superlink.main(["stop", "--port", str(port), "--grace", "1"]) == 0
    assert not [name for name, pid in pids.items() if alive(pid)]
    assert "stopped: pid" in capsys.readouterr().out
    assert local_superlink.main(["--port", str(port)]) == 1  # nothing listens any more


def test_a_process_on_the_port_that_is_no_superlink_is_not_stopped(
    stand_ins: tuple[int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    port, tmp = stand_ins
    pids = start(tmp, port, program="some-other-server")
    assert local_superlink.main(["stop", "--port", str(port)]) == 1
    assert all(alive(pid) for pid in pids.values())
    assert "is not a flower-superlink: not stopped" in capsys.readouterr().out


def test_the_environment_is_the_one_the_process_was_started_from(stand_ins: tuple[int, Path], tmp_path: Path) -> None:
    """A venv's interpreter is a symlink to the base one: the environment is read from the
    command line as started, not from /proc/PID/exe."""
    port, tmp = stand_ins
    venv = tmp_path / "other env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    start(tmp, port, python=str(venv / "bin" / "python"))
    (link,), _ = local_superlink.find([port])
    assert Path(link.prefix) == venv
    assert "NOT this shell's" in "\n".join(local_superlink.describe(link))

"""Finding and stopping the real Flower processes started under one private FLWR_HOME
(a sweep job's, a test's), free ports for them, and the `flwr` CLI and its JSON answers.

Every such process has its private directory (its FLWR_HOME) in its command line or
environment; that path is the marker. Flower detaches some of them (the SuperLink's
SuperExec runs in its own session) and spawns others per run or message, so the
search follows sessions and descendants too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;]*m")
RUN_ID = re.compile(r"Successfully started run (\d+)")  # what `flwr run` prints once a run is submitted


def strip_colours(text: str) -> str:
    """Flower's log lines without their terminal colour codes."""
    return ANSI.sub("", text)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...);
    None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces


def alive(pid: int) -> bool:
    """A live process with that id (a zombie is dead)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _proc_table() -> dict[int, tuple[str, int, int]]:
    """pid -> (state, ppid, session id) of every visible process."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            table[int(entry)] = (fields[0], int(fields[1]), int(fields[3]))
    return table


def _marked(pid: int, marker: bytes) -> bool:
    """Does the path `marker` (as a whole path component) occur in the command line or environment?"""
    for part in ("cmdline", "environ"):
        try:
            data = Path(f"/proc/{pid}/{part}").read_bytes()
        except OSError:
            continue
        if marker + b"/" in data or marker + b"\0" in data:
            return True
    return False


def processes_under(marker: str) -> set[int]:
    """Live processes started for `marker`: matches, the sessions they lead, descendants.

    Never this process or its ancestors; zombies are skipped (already dead). Linux only
    (/proc): elsewhere nothing is found and nothing is stopped.
    """
    if not Path("/proc").is_dir():
        return set()
    table, mark = _proc_table(), marker.rstrip("/").encode()
    protected, pid = set(), os.getpid()
    while pid > 1 and pid not in protected:
        protected.add(pid)
        pid = table.get(pid, ("", 1, 0))[1]
    found = {p for p in table if p not in protected and _marked(p, mark)}
    leaders = {p for p in found if table[p][2] == p}
    found |= {p for p, (_, _, sid) in table.items() if sid in leaders}
    while children := {p for p, (_, ppid, _) in table.items() if ppid in found} - found:
        found |= children
    return {p for p in found - protected if table[p][0] != "Z"}


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_processes(marker: str, grace_s: float = 0.0) -> None:
    """SIGTERM the processes of `marker` for up to `grace_s`, SIGKILL the rest; RuntimeError
    naming any that survive."""
    deadline = time.monotonic() + grace_s
    while (pids := processes_under(marker)) and time.monotonic() < deadline:
        _signal_all(pids, signal.SIGTERM)
        time.sleep(0.5)
    for _ in range(10):
        if not (pids := processes_under(marker)):
            return
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.2)
    left = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:160] for p in processes_under(marker)}
    if left:
        raise RuntimeError(f"processes under {marker} survived SIGKILL: {left}")


def kill_matching(marker: str, program: str) -> set[int]:
    """SIGKILL the processes of `marker` whose command line mentions `program` (a crash of
    that one component); return their pids."""
    pids = {
        p for p in processes_under(marker) if program.encode() in Path(f"/proc/{p}/cmdline").read_bytes()
    }  # fmt: skip
    _signal_all(pids, signal.SIGKILL)
    return pids


def free_ports(n: int) -> list[int]:
    """Ports the kernel has just handed out (all bound at once, so they are distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def flwr_cli() -> str:
    """The `flwr` CLI of this Python environment (falls back to PATH)."""
    here = Path(sys.executable).parent / "flwr"
    found = str(here) if here.is_file() else shutil.which("flwr")
    if not found:
        raise RuntimeError("the `flwr` CLI is not installed in this environment: pip install -e . (or flwr)")
    return found


def parse_flwr_json(output: str) -> dict[str, Any]:
    """The JSON answer in the stdout of `flwr ... --format json`: from its first "{" on, as
    Flower may print log lines before it. ValueError when there is none (a
    json.JSONDecodeError, also a ValueError, when it is not valid JSON)."""
    start = output.find("{")
    if start < 0:
        raise ValueError(f"no JSON answer in flwr's output: {output[-500:]!r}")
    return json.loads(output[start:])

"""Finding and stopping the real Flower processes started under one private FLWR_HOME
(a sweep job's, a test's), free ports for them, and the `flwr` CLI and its JSON answers.

Every such process has its private directory (its FLWR_HOME) in its command line or
environment; that path is the marker. Flower detaches some of them (the SuperLink's
SuperExec runs in its own session) and spawns others per run or message, so the
search follows sessions and descendants too. The /proc reading and the stop loop here also
serve scripts/local_deployment.py, which selects by what it recorded, not by a marker.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;]*m")
RUN_ID = re.compile(r"Successfully started run (\d+)")  # what `flwr run` prints once a run is submitted


def strip_colours(text: str) -> str:
    """Flower's log lines without their terminal colour codes."""
    return ANSI.sub("", text)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...;
    field N of proc(5) is index N - 3); None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces ("" when unreadable or gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def argv(pid: int) -> list[str]:
    """The arguments of `pid`, each whole (a path may contain spaces); [] when unreadable or gone."""
    try:
        data = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in data.split(b"\0")[:-1]]


def alive(pid: int) -> bool:
    """A live process with that id (a zombie is dead)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


@dataclass(frozen=True)
class ProcInfo:
    state: str
    ppid: int
    sid: int
    start: int  # clock ticks after boot (proc(5) field 22): with the pid, a process's identity


def proc_table() -> dict[int, ProcInfo]:
    """Every visible process (Linux /proc; elsewhere empty: nothing is found, nothing stopped)."""
    table = {}
    if Path("/proc").is_dir():
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (f := proc_stat(int(entry))) is not None:
                table[int(entry)] = ProcInfo(f[0], int(f[1]), int(f[3]), int(f[19]))
    return table


def own(pid: int) -> bool:
    """Is `pid` a process of the current user (the owner of /proc/PID)?"""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def listening_sockets(port: int) -> dict[int, int]:
    """The TCP sockets listening on `port` (any local address, IPv4 or IPv6): inode -> the
    owner's uid (Linux /proc/net/tcp; elsewhere none)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()  # sl local_address rem_address st tx_queue:rx_queue tr:when retrnsmt uid timeout inode
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found[int(f[9])] = int(f[7])
    return found


def socket_holders(inodes: set[int]) -> set[int]:
    """The current user's processes with one of the sockets `inodes` open (other users' file
    descriptors are unreadable, and never ours to stop)."""
    wanted = {f"socket:[{i}]" for i in inodes}
    holders = set()
    for pid in proc_table():
        if not own(pid):
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    holders.add(pid)
                    break
            except OSError:
                continue
    return holders


def process_family(identities: dict[int, int]) -> set[int]:
    """The live processes of `identities` (pid -> start time: still that very process), the
    members of the sessions they lead (started no earlier), and all their descendants. The
    sessions keep what a dead process started and detached: Flower's SuperExec runs in its own
    session and its flwr-simulation stays in it, re-parented, when the SuperLink above is
    killed (Linux hands out no pid still used as a session id). Never this process or its
    ancestors; no zombies."""
    table = proc_table()
    protected = protected_pids(table)
    found = {p for p, start in identities.items() if p in table and table[p].start == start}
    # a pid that now names another process counts for nothing, its session included
    sessions = {p: start for p, start in identities.items() if p not in table or table[p].start == start}
    found |= {p for p, i in table.items() if i.sid in sessions and i.start >= sessions[i.sid]}
    while children := {p for p, i in table.items() if i.ppid in found} - found:
        found |= children
    return {p for p in found - protected if table[p].state != "Z"}


def protected_pids(table: dict[int, ProcInfo]) -> set[int]:
    """This process and its ancestors: never stopped by what it stops."""
    protected, pid = set(), os.getpid()
    while pid > 1 and pid not in protected:
        protected.add(pid)
        pid = table[pid].ppid if pid in table else 1
    return protected


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

    For tests and sweeps, whose Flower processes carry their own FLWR_HOME: a process is
    matched by its environment, which is no proof of who started it (scripts/local_deployment.py
    records its processes instead). Never this process or its ancestors; zombies are skipped
    (already dead). Linux only (/proc): elsewhere nothing is found and nothing is stopped.
    """
    table, mark = proc_table(), marker.rstrip("/").encode()
    protected = protected_pids(table)
    found = {p for p in table if p not in protected and _marked(p, mark)}
    leaders = {p for p in found if table[p].sid == p}
    found |= {p for p, info in table.items() if info.sid in leaders}
    while children := {p for p, info in table.items() if info.ppid in found} - found:
        found |= children
    return {p for p in found - protected if table[p].state != "Z"}


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_found(find: Callable[[], set[int]], what: str, grace_s: float = 0.0) -> None:
    """SIGTERM the processes `find` names for up to `grace_s`, then SIGKILL (`find` is asked
    again each time: children appear, recycled ids drop out); RuntimeError naming `what` and
    any process that survives."""
    deadline = time.monotonic() + grace_s
    while (pids := find()) and time.monotonic() < deadline:
        _signal_all(pids, signal.SIGTERM)
        time.sleep(0.5)
    for _ in range(10):
        if not (pids := find()):
            return
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.2)
    if left := {p: cmdline(p)[:160] for p in find()}:
        raise RuntimeError(f"processes of {what} survived SIGKILL: {left}")


def stop_processes(marker: str, grace_s: float = 0.0) -> None:
    """SIGTERM the processes of `marker` for up to `grace_s`, SIGKILL the rest; RuntimeError
    naming any that survive."""
    stop_found(lambda: processes_under(marker), marker, grace_s)


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

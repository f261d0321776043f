"""The local SuperLink that `flwr run` starts on demand: which environment it runs, and
stopping it by its process id.

    python -m app.tools.local_superlink          # status: its PID, Python environment, log
    python -m app.tools.local_superlink stop     # SIGTERM it and what it started, SIGKILL after --grace

The first `flwr run` against a connection with `address = ":local:"` starts a detached
`flower-superlink` with the environment (PATH, FLWR_* variables) of that shell; later `flwr
run`s, from any virtual environment, find it by its port and run on it, with the first
environment's packages (app/run/environment.py logs which one at the start of every run).
This tool finds it the same way: the current user's process listening on the local SuperLink's
ports (Control API 127.0.0.1:39093 and HTTP 39091, or FLWR_LOCAL_CONTROL_API_PORT and
FLWR_LOCAL_SUPERLINK_HTTP_API_PORT). `stop` ends it with its SuperExec and the
flwr-simulation processes of its runs, which outlive a killed SuperLink; nothing is matched
by name, so other users' SuperLinks and other FLWR_HOMEs' are never touched. The next `flwr
run` starts a fresh one from the shell it is called from.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.tools.processes import (
    argv,
    cmdline,
    listening_sockets,
    own,
    proc_stat,
    proc_table,
    process_family,
    socket_holders,
    stop_found,
)

PROGRAM = "flower-superlink"


def default_ports() -> list[int]:
    """The ports Flower's CLI gives the local SuperLink (its Control API, its HTTP API)."""
    return [
        int(os.environ.get("FLWR_LOCAL_CONTROL_API_PORT", "39093")),
        int(os.environ.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "39091")),
    ]


def python_prefix(pid: int) -> str:
    """The Python environment (what sys.prefix is in it) of the process `pid`: the directory
    above the interpreter's bin/ as the process was started (a console script starts as
    `/venv/bin/python /venv/bin/flower-superlink`; /proc/PID/exe would resolve a venv's
    symlinked interpreter to the base installation). "" when unreadable."""
    argv0 = next(iter(argv(pid)), "")
    if not os.path.isabs(argv0):
        try:
            argv0 = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            return ""
    return str(Path(argv0).parent.parent)


@dataclass(frozen=True)
class LocalSuperLink:
    pid: int
    start: int  # with the pid, the process's identity (/proc/PID/stat field 22)
    command: str
    prefix: str  # its Python environment

    @property
    def is_superlink(self) -> bool:
        return PROGRAM in self.command

    def family(self) -> set[int]:
        """It and what it started (SuperExec, flwr-simulation, Ray workers), the current user's."""
        return {p for p in process_family({self.pid: self.start}) if own(p)}


def find(ports: Sequence[int] | None = None) -> tuple[list[LocalSuperLink], set[int]]:
    """The current user's processes listening on `ports` (default: the local SuperLink's), and
    the uids of other users holding one of them."""
    ports = list(ports or default_ports())
    sockets = {inode: uid for port in ports for inode, uid in listening_sockets(port).items()}
    found = []
    for pid in sorted(socket_holders(set(sockets))):
        if (stat := proc_stat(pid)) is not None:
            found.append(LocalSuperLink(pid, int(stat[19]), cmdline(pid), python_prefix(pid)))
    return found, {uid for uid in sockets.values() if uid != os.getuid()}


def environ(pid: int) -> dict[str, str]:
    """The environment variables `pid` was started with ({} when unreadable)."""
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in data.split(b"\0") if b"=" in item)
    return {key: value for key, _, value in pairs}


def describe(link: LocalSuperLink) -> list[str]:
    """A few lines on `link` for a person: its environment is what every `flwr run` on it gets."""
    here = sys.prefix
    same = "the same as this shell's" if Path(link.prefix) == Path(here) else f"NOT this shell's, {here}"
    env = environ(link.pid)
    installs = env.get("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION") != "1"
    lines = [
        f"local SuperLink: pid {link.pid}",
        f"  Python environment: {link.prefix} ({same})",
        "  runtime dependency installation: "
        + ("on (each run `uv sync`s the app's requirements)" if installs else "off (runs use this environment)"),
        f"  FLWR_HOME: {env.get('FLWR_HOME', '~/.flwr (default)')}",
        f"  command: {link.command[:300]}",
    ]
    others = sorted(link.family() - {link.pid})
    for pid in others:
        lines.append(f"  started by it: pid {pid}: {cmdline(pid)[:160]}")
    return lines


def stop(link: LocalSuperLink, grace_s: float = 10.0) -> int:
    """SIGTERM `link` and what it started for up to `grace_s`, then SIGKILL; the number of
    processes there were. RuntimeError when one survives.

    Each process found at the start is followed by its own identity: once the SuperLink and
    its SuperExec are gone, a flwr-simulation that ignored the SIGTERM is no descendant of
    theirs any more, and must still get the SIGKILL."""
    table = proc_table()
    identities = {p: table[p].start for p in link.family() if p in table}
    stop_found(
        lambda: {p for p in process_family(identities) if own(p)}, f"the local SuperLink (pid {link.pid})", grace_s
    )
    return len(identities)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.tools.local_superlink",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", nargs="?", choices=("status", "stop"), default="status", help="(default: status)")
    parser.add_argument(
        "--port", type=int, action="append", default=None,
        help=f"a port the SuperLink listens on, repeatable (default: {' and '.join(map(str, default_ports()))})",
    )  # fmt: skip
    parser.add_argument("--grace", type=float, default=10.0, help="seconds of SIGTERM before SIGKILL (default: 10)")
    args = parser.parse_args(argv)
    ports = args.port or default_ports()
    links, strangers = find(ports)
    for uid in sorted(strangers):
        print(f"a process of uid {uid} (not yours) listens on port {' or '.join(map(str, ports))}: not touched")
    if not links:
        print(
            f"no local SuperLink of yours listens on 127.0.0.1:{' or '.join(map(str, ports))}; "
            "the next `flwr run` starts one with the environment of the shell it is called from"
        )
        return 0 if args.action == "stop" and not strangers else 1
    status = 0
    for link in links:
        print("\n".join(describe(link)))
        if args.action != "stop":
            continue
        if not link.is_superlink:
            print(f"  pid {link.pid} is not a {PROGRAM}: not stopped")
            status = 1
            continue
        try:
            count = stop(link, args.grace)
        except RuntimeError as err:
            print(f"  {err}")
            status = 1
            continue
        print(f"  stopped: pid {link.pid} and {max(count - 1, 0)} process(es) it started")
    if args.action == "status":
        port_args = "".join(f" --port {p}" for p in args.port or ())
        print(f"stop it (and its runs): python -m app.tools.local_superlink stop{port_args}")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Runs that recover themselves: submit a named run, follow it, and when its ServerApp fails or
falls silent, stop the stale run and submit the same command again, which continues from the
checkpoint (`resume=auto`), up to a retry budget.

    python -m app.supervise -- name=exp1 federation.rounds=20
    python -m app.supervise --superlink secure --retries 5 --stall-timeout 900 -- name=exp1 strategy=fedbuff
    fedgpu-run --federation-config "num-supernodes=10" -- name=exp1

A thin layer over the `flwr` CLI, the same in simulation and against a remote SuperLink:
`flwr run` (without --stream) submits; `flwr list --run-id` gives Flower's verdict and
`flwr log --show` the ServerApp's log, followed here (new lines are printed) and read for
progress. A run is given up when Flower says it failed or was stopped, or when it is `running`
but its log has not grown for `--stall-timeout` seconds (a killed ServerApp shows as running
for minutes). A given-up run is stopped (`flwr stop`) so its nodes stop working for it, then
the command is submitted again. "already complete" from the ServerApp (a finished run
resubmitted) ends supervision successfully, a refused configuration ("invalid configuration,
nothing was run") unsuccessfully: the same command would fail the same way. Every attempt is
logged with its run id, a silent wait gets a progress line (every ~10 s, less often as the
silence grows), and the last line
says COMPLETED or FAILED and why (exit status 0 or 1: `flwr run --stream` itself exits 0
when the ServerApp fails).

The ServerApp logs its Python environment at the start (app/run/environment.py); when that is
on this machine but not this shell's environment, the supervisor warns: the local SuperLink
was started from another environment and runs every `flwr run` with its packages.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from app.run.environment import Environment, parse_line
from app.tools import local_superlink
from app.tools.processes import RUN_ID, flwr_cli, parse_flwr_json, strip_colours
from strategies.node_text import printable

log = logging.getLogger("flwr.fedgpu.supervise")

APP_DIR = Path(__file__).resolve().parents[2]
ALREADY_COMPLETE = "already complete"
INVALID_CONFIG = "invalid configuration, nothing was run"  # app/server_app.py: the same command fails again
REFUSED = "failed: invalid configuration"  # the outcome of a refused configuration: not retried
# What the `flwr` CLI prints on stdout before a log: the connection, and once, a local SuperLink it starts.
CLI_PREAMBLE = re.compile(r"\A(?:(?:Using SuperLink|Starting local SuperLink)\b[^\n]*\n)+")
GENERIC_ERROR = re.compile(r"raised an exception$|^Exit Code: \d+$")  # Flower's, around the real one


@dataclass
class Attempt:
    run_id: str
    outcome: str  # completed | already complete | failed: ... | stalled ... | submit failed: ...


class Flwr:
    """The `flwr` commands the supervisor needs, for one SuperLink connection."""

    def __init__(self, superlink: str | None, env: dict[str, str] | None = None, app_dir: Path = APP_DIR) -> None:
        self.superlink, self.env, self.app_dir = superlink, env, app_dir
        self.problem = ""  # what the last failed command said ("" after a success): for progress lines

    def _run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run `cmd`; one that runs past `timeout` is killed and answers exit status 124 (an
        unreachable SuperLink must not end the supervision)."""
        try:
            return subprocess.run(cmd, env=self.env, cwd=self.app_dir, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
            return subprocess.CompletedProcess(cmd, 124, out, f"timed out after {timeout:.0f} s")

    def _cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """`flwr ARGS`, noting what it said when it failed."""
        proc = self._run([flwr_cli(), *args], timeout)
        self.problem = "" if proc.returncode == 0 else f"flwr {args[0]}: {complaint(proc.stderr or proc.stdout)}"
        return proc

    @property
    def _connection(self) -> list[str]:
        return [self.superlink] if self.superlink else []

    def submit(self, run_config: str, federation_config: str | None) -> tuple[str | None, str]:
        """(run id, output) of `flwr run APP [SUPERLINK] --run-config ...`."""
        fed = ["--federation-config", federation_config] if federation_config else []
        proc = self._cli("run", str(self.app_dir), *self._connection, "--run-config", run_config, *fed, timeout=600)
        out = strip_colours(proc.stdout + proc.stderr)
        match = RUN_ID.search(out)
        return (match.group(1) if match else None), out

    def status(self, run_id: str) -> str:
        """Flower's status of the run ("running", "finished:completed", ...); "" when unknown."""
        proc = self._cli("list", "--run-id", run_id, "--format", "json", *self._connection, timeout=30)
        try:
            answer = parse_flwr_json(proc.stdout)
        except ValueError:
            return ""
        if answer.get("success") is False:  # exit status 0, the error in the JSON
            self.problem = f"flwr list: {complaint(str(answer.get('error-message', '')))}"
        return str((answer.get("runs") or [{}])[0].get("status", ""))

    def logs(self, run_id: str) -> str | None:
        """The ServerApp's log so far, without colours; None when it cannot be read now.

        `flwr log --show` prints the whole log with `print(log)`: one newline more than the
        log has, which is dropped here (counted as log text, it cut the first character of
        the next new line), and before it lines of the CLI's own on stdout, not always the
        same ones (`CLI_PREAMBLE`), which are dropped too. While a run has no log yet,
        Flower's answer waits for the first line: the timeout keeps the progress lines coming."""
        proc = self._cli("log", run_id, "--show", *self._connection, timeout=20)
        if proc.returncode != 0:
            return None
        text = CLI_PREAMBLE.sub("", strip_colours(proc.stdout))
        return text[:-1] if text.endswith("\n") else text

    def stop(self, run_id: str) -> None:
        self._cli("stop", run_id, *self._connection, timeout=60)


def complaint(output: str) -> str:
    """The gist of a failed `flwr` command's output: the text in Flower's error box, else its
    last line."""
    lines = [line.strip() for line in strip_colours(output).splitlines() if line.strip()]
    boxed = [line.strip("│ ") for line in lines if line.startswith("│")]
    return printable(" ".join(boxed) if boxed else lines[-1] if lines else "no output", limit=300)


def with_resume(overrides: str) -> str:
    """The overrides with `resume=auto` (a resubmission must continue the run, not restart it);
    a ValueError without `name=` (resume=auto finds the run by its name)."""
    items = overrides.split()
    if not any(i.startswith("name=") for i in items):
        raise ValueError("give the run a name (name=exp1): a resubmission finds its checkpoint by it")
    if any(i.startswith("resume=") and i != "resume=auto" for i in items):
        raise ValueError("the supervisor sets resume=auto itself; drop the other resume=")
    return overrides if "resume=auto" in items else f"{overrides} resume=auto"


@dataclass
class LogFollower:
    """Echoes the new complete lines of a log that is read whole again and again (a line
    still being written is held back until its newline comes, or the run ends), and reads
    from them what the supervisor needs: why the run failed, whether its configuration was
    refused, whether it was already complete, and the ServerApp's environment."""

    echo: Callable[[str], None]
    seen: int = 0  # characters of the log consumed
    exception: str = ""  # the exception line that ends the last traceback
    error: str = ""  # the last ERROR message that is not one of Flower's generic ones
    invalid_config: bool = False
    already_complete: bool = False
    _in_traceback: bool = False

    @property
    def reason(self) -> str:
        return self.exception or self.error

    def feed(self, text: str | None, final: bool = False) -> bool:
        """Echo what `text` (the whole log now; None: unreadable) adds; whether it grew."""
        if text is None or len(text) <= self.seen:
            return False
        end = len(text) if final else text.rfind("\n", self.seen) + 1
        if end <= self.seen:
            return True  # a partial line grew
        for line in text[self.seen : end].splitlines():
            self._line(printable(line.expandtabs(4), limit=None))  # a tab is layout, not a control
        self.seen = end
        return True

    def _line(self, line: str) -> None:
        self.echo(line)
        self.already_complete |= ALREADY_COMPLETE in line
        if self._in_traceback and line[:1] not in ("", " "):  # the exception line ends it
            self._in_traceback, self.exception = False, line
        self._in_traceback |= line.startswith("Traceback (most recent call last)")
        level, _, message = line.partition(":")
        message = message.strip()
        if level.strip() == "ERROR" and not GENERIC_ERROR.search(message):
            self.error = message
            # at the start of the ServerApp's own line: a node's text quoted in a line cannot stop the retries
            self.invalid_config |= message.startswith(INVALID_CONFIG)
        if (env := parse_line(line)) is not None and (warning := environment_warning(env)):
            log.warning("%s", warning)


def environment_warning(env: Environment) -> str | None:
    """Why the ServerApp's environment `env` (from its log line) is not this shell's, with what
    to do; None when it is, or when the ServerApp runs on another machine."""
    if env.host != socket.gethostname() or Path(env.prefix).resolve() == Path(sys.prefix).resolve():
        return None
    text = (
        f"this run executes in {env.prefix}, not in this shell's {sys.prefix}: the SuperLink that runs it "
        f"was started from another environment and runs every `flwr run` with that environment's packages"
    )
    links, _ = local_superlink.find()
    if mine := [link for link in links if Path(link.prefix).resolve() == Path(env.prefix).resolve()]:
        text += (
            f". It is the local SuperLink (pid {mine[0].pid}): stop it with `python -m app.tools.local_superlink stop` "
            "and the next `flwr run` starts one from this shell's environment"
        )
    return text


def follow(
    flwr: Flwr,
    run_id: str,
    stall_timeout_s: float,
    poll_s: float,
    echo: Callable[[str], None],
    *,
    progress_s: float = 10.0,
    on_stall: str = "stopped and submitted again",
) -> str:
    """Follow one run to its outcome, echoing its new log lines. While none comes, a progress
    line says so, what Flower says and what happens when: every `progress_s`, and after a
    minute every sixth of the silence so far (a long round is not a flood of lines)."""
    follower = LogFollower(echo)
    progress = noted = time.monotonic()
    while True:
        if follower.feed(flwr.logs(run_id)):
            progress = time.monotonic()
        status = flwr.status(run_id)
        if status.startswith("finished"):
            follower.feed(flwr.logs(run_id), final=True)  # the last lines
            if status == "finished:completed":
                return ALREADY_COMPLETE if follower.already_complete else "completed"
            why = f"; why: {follower.reason}" if follower.reason else ""
            failed = f"{REFUSED}: " if follower.invalid_config else "failed: "
            return f"{failed}Flower says {status}{why}"
        now = time.monotonic()
        silent = now - progress
        says = f"Flower says {status}" if status else f"no status: {flwr.problem or 'Flower says nothing'}"
        if silent > stall_timeout_s:
            return f"stalled: no new log line for {stall_timeout_s:.0f} s ({says})"
        if silent >= progress_s and now - noted >= max(progress_s, silent / 6):
            noted = now
            log.info(
                "run %s: no new log line for %.0f s (%s); after %.0f s without one (--stall-timeout) it is %s",
                run_id, silent, says, stall_timeout_s, on_stall,
            )  # fmt: skip
        time.sleep(poll_s)


def supervise(
    flwr: Flwr,
    overrides: str,
    *,
    output_dir: str | None = None,
    federation_config: str | None = None,
    retries: int = 3,
    stall_timeout_s: float = 900.0,
    poll_s: float = 2.0,
    echo: Callable[[str], None] = print,
) -> list[Attempt]:
    """Submit until the run completes or `retries` resubmissions are spent; the attempts made."""
    overrides = with_resume(overrides)
    run_config = f"overrides='{overrides}'" + (f" output-dir='{output_dir}'" if output_dir else "")
    attempts: list[Attempt] = []
    total = retries + 1
    for attempt in range(1, total + 1):
        last = attempt == total
        again = " again (resume=auto continues it from its checkpoint)" if attempt > 1 else ""
        log.info("attempt %d of %d: submitting the run%s", attempt, total, again)
        run_id, out = flwr.submit(run_config, federation_config)
        if run_id is None:
            attempts.append(Attempt("", f"submit failed: {out.strip()[-500:]}"))
            log.warning("attempt %d: flwr run did not start a run: %s", attempt, out.strip()[-500:])
        else:
            log.info("attempt %d: run %s submitted", attempt, run_id)
            on_stall = "stopped, and supervision gives up (no retries left)" if last else "stopped and submitted again"
            outcome = follow(flwr, run_id, stall_timeout_s, poll_s, echo, on_stall=on_stall)
            attempts.append(Attempt(run_id, outcome))
            if outcome in ("completed", ALREADY_COMPLETE):
                log.info("attempt %d: run %s %s", attempt, run_id, outcome)
                return attempts
            if outcome.startswith(REFUSED):
                log.warning(
                    "attempt %d: run %s %s; not submitted again: it would fail the same way", attempt, run_id, outcome
                )
                return attempts
            then = "; stopping it (no retries left)" if last else "; stopping it and submitting again"
            log.warning("attempt %d: run %s %s%s", attempt, run_id, outcome, then)
            flwr.stop(run_id)
        if not last:
            time.sleep(poll_s)
    return attempts


def verdict(overrides: str, attempts: list[Attempt]) -> tuple[bool, str]:
    """(success, the closing line): COMPLETED or FAILED, the run's name, and why it failed."""
    name = next((i.split("=", 1)[1] for i in overrides.split() if i.startswith("name=")), "?")
    tries = f"{len(attempts)} attempt{'s' if len(attempts) != 1 else ''}"
    last = attempts[-1] if attempts else Attempt("", "nothing was submitted")
    if last.outcome in ("completed", ALREADY_COMPLETE):
        return True, f"COMPLETED: run '{name}' {last.outcome} (Flower run {last.run_id}, {tries})"
    where = f"; its log: flwr log {last.run_id} --show" if last.run_id else ""
    return (
        False,
        f"FAILED: run '{name}' did not complete in {tries}; the last (Flower run {last.run_id or '-'}) {last.outcome}{where}",
    )


def _echo(line: str) -> None:
    print(line, flush=True)  # flushed: a pipe (| tee) keeps the ServerApp's lines in order with ours


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.supervise", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--superlink", default=None, help="the flwr connection in config.toml (default: the one it names as default)"
    )
    parser.add_argument(
        "--federation-config", default=None, help="as for flwr run: the simulation's size (default: Flower's)"
    )
    parser.add_argument(
        "--output-dir", default=None, help="the run config's output-dir, absolute (default: the app's, ~/fedgpu-runs)"
    )
    parser.add_argument(
        "--retries", type=int, default=3, help="resubmissions after the first attempt (default: %(default)s)"
    )
    parser.add_argument(
        "--stall-timeout", type=float, default=900.0,
        help="seconds without a new ServerApp log line before a running run is stopped and resubmitted "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--poll", type=float, default=2.0, help="seconds between checks (default: %(default)s)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="-- then the Hydra overrides (name=... needed)")
    args = parser.parse_args(argv)
    overrides = " ".join(a for a in args.overrides if a != "--")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervise: %(message)s")
    try:
        attempts = supervise(
            Flwr(args.superlink, dict(os.environ)),
            overrides,
            output_dir=args.output_dir,
            federation_config=args.federation_config,
            retries=args.retries,
            stall_timeout_s=args.stall_timeout,
            poll_s=args.poll,
            echo=_echo,
        )
    except ValueError as err:
        parser.error(str(err))
    for i, a in enumerate(attempts, start=1):
        log.info("attempt %d: run %s: %s", i, a.run_id or "-", a.outcome)
    ok, line = verdict(overrides, attempts)
    sys.stdout.flush()
    if ok:
        log.info("%s", line)
    else:
        log.error("%s", line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

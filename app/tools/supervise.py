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
resubmitted) ends supervision successfully. Every attempt is logged with its run id.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from app.tools.processes import RUN_ID, flwr_cli, parse_flwr_json, strip_colours
from strategies.node_text import printable

log = logging.getLogger("flwr.fedgpu.supervise")

APP_DIR = Path(__file__).resolve().parents[2]
ALREADY_COMPLETE = "already complete"


@dataclass
class Attempt:
    run_id: str
    outcome: str  # completed | already complete | failed: ... | stalled ... | submit failed: ...


class Flwr:
    """The `flwr` commands the supervisor needs, for one SuperLink connection."""

    def __init__(self, superlink: str | None, env: dict[str, str] | None = None, app_dir: Path = APP_DIR) -> None:
        self.superlink, self.env, self.app_dir = superlink, env, app_dir

    def _cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [flwr_cli(), *args], env=self.env, cwd=self.app_dir, capture_output=True, text=True, timeout=timeout
        )

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
        proc = self._cli("list", "--run-id", run_id, "--format", "json", *self._connection, timeout=60)
        try:
            return str((parse_flwr_json(proc.stdout).get("runs") or [{}])[0].get("status", ""))
        except ValueError:
            return ""

    def logs(self, run_id: str) -> str:
        proc = self._cli("log", run_id, "--show", *self._connection, timeout=60)
        return strip_colours(proc.stdout)

    def stop(self, run_id: str) -> None:
        self._cli("stop", run_id, *self._connection, timeout=60)


def with_resume(overrides: str) -> str:
    """The overrides with `resume=auto` (a resubmission must continue the run, not restart it);
    a ValueError without `name=` (resume=auto finds the run by its name)."""
    items = overrides.split()
    if not any(i.startswith("name=") for i in items):
        raise ValueError("give the run a name (name=exp1): a resubmission finds its checkpoint by it")
    if any(i.startswith("resume=") and i != "resume=auto" for i in items):
        raise ValueError("the supervisor sets resume=auto itself; drop the other resume=")
    return overrides if "resume=auto" in items else f"{overrides} resume=auto"


def follow(flwr: Flwr, run_id: str, stall_timeout_s: float, poll_s: float, echo: Callable[[str], None]) -> str:
    """Follow one run to its outcome, echoing its new log lines."""
    seen, progress = 0, time.monotonic()
    while True:
        text = flwr.logs(run_id)
        if len(text) > seen:
            for line in text[seen:].splitlines():
                echo(printable(line, limit=None))
            seen, progress = len(text), time.monotonic()
        status = flwr.status(run_id)
        if status.startswith("finished"):
            text = flwr.logs(run_id)  # the last lines
            for line in text[seen:].splitlines():
                echo(printable(line, limit=None))
            if status == "finished:completed":
                return ALREADY_COMPLETE if ALREADY_COMPLETE in text else "completed"
            return f"failed: Flower says {status}"
        if time.monotonic() - progress > stall_timeout_s:
            return f"stalled: no new log line for {stall_timeout_s:.0f} s while Flower says {status or 'nothing'}"
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
    for attempt in range(retries + 1):
        run_id, out = flwr.submit(run_config, federation_config)
        if run_id is None:
            attempts.append(Attempt("", f"submit failed: {out.strip()[-500:]}"))
            log.warning("attempt %d: flwr run did not start a run: %s", attempt + 1, out.strip()[-500:])
        else:
            log.info("attempt %d: run %s submitted", attempt + 1, run_id)
            outcome = follow(flwr, run_id, stall_timeout_s, poll_s, echo)
            attempts.append(Attempt(run_id, outcome))
            if outcome in ("completed", ALREADY_COMPLETE):
                log.info("attempt %d: run %s %s", attempt + 1, run_id, outcome)
                return attempts
            log.warning("attempt %d: run %s %s; stopping it and submitting again", attempt + 1, run_id, outcome)
            flwr.stop(run_id)
        if attempt < retries:
            time.sleep(poll_s)
    return attempts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.supervise", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--superlink", default=None, help="the flwr connection (config.toml); default: its default")
    parser.add_argument("--federation-config", default=None, help="as for flwr run (simulation size)")
    parser.add_argument("--output-dir", default=None, help="the run config's output-dir (absolute)")
    parser.add_argument("--retries", type=int, default=3, help="resubmissions after the first attempt")
    parser.add_argument("--stall-timeout", type=float, default=900.0, help="seconds without a new log line")
    parser.add_argument("--poll", type=float, default=2.0, help="seconds between checks")
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
        )
    except ValueError as err:
        parser.error(str(err))
    for i, a in enumerate(attempts, start=1):
        log.info("attempt %d: run %s: %s", i, a.run_id or "-", a.outcome)
    return 0 if attempts and attempts[-1].outcome in ("completed", ALREADY_COMPLETE) else 1


if __name__ == "__main__":
    sys.exit(main())

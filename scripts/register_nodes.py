"""Register SuperNode public keys with a SuperLink (`flwr supernode register`), idempotently.

    python scripts/register_nodes.py --connection cloud keys/lab-b.pub keys/lab-c.pub
    python scripts/register_nodes.py --address superlink:9092 --root-certificates creds/ca.crt creds/keys/*.pub

Waits until the SuperLink answers on its Control API (`flwr supernode list`, up to
`--timeout` seconds: it may still be starting), then registers each key. A key that is
already registered ("Public key already in use") counts as done, so the same command can
run on every start of a compose project. Exits non-zero, naming the cause, when a key file
is missing, the SuperLink never answers, or a registration is refused.

`--connection NAME` uses the `[superlink.NAME]` entry of `$FLWR_HOME/config.toml` (made by
`scripts/credentials.py flwr-config`); `--address` with `--root-certificates` (or
`--insecure`) needs no config: the entry is written to a private temporary FLWR_HOME.
A SuperNode connects only once its key is registered (`flower-superlink
--enable-supernode-auth`); the private key never leaves the SuperNode, only the `.pub` file
is needed here.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ run as files, not a package
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the app, also from a checkout

from credentials import write_flwr_config  # noqa: E402

from app.tools.processes import flwr_cli, parse_flwr_json  # noqa: E402

CONNECTION = "register-nodes"  # the entry's name in the temporary FLWR_HOME (--address)
ALREADY_REGISTERED = "already in use"  # Flower 1.42: "[code: 23] Public key already in use."
# Errors worth waiting out (the SuperLink is starting or not reachable yet); any other answer
# (an unknown connection, a refused request) will not change by waiting.
TRANSIENT = ("unavailable", "timed out", "timeout", "gave no answer")
CLI_TIMEOUT_S = 60.0


class RegistrationError(RuntimeError):
    """Something an operator must fix; the message says what."""


def _run_json(args: Sequence[str], env: dict[str, str]) -> dict:
    """Run `flwr ... --format json`; its JSON answer, or {"success": False, ...} with the output.

    `flwr` exits 0 with `"success": false` for errors it handles and prints plain text
    (exit code != 0) for others (e.g. an invalid key file); both come back as a dict."""
    try:
        proc = subprocess.run(
            [flwr_cli(), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {"success": False, "error-message": f"`flwr {' '.join(args)}` gave no answer in {CLI_TIMEOUT_S:.0f} s"}
    try:
        return parse_flwr_json(proc.stdout)
    except ValueError:  # no JSON, or not valid JSON
        pass
    output = "\n".join(part.strip() for part in (proc.stdout, proc.stderr) if part.strip())
    return {"success": False, "error-message": f"exit code {proc.returncode}: {output or '(no output)'}"}


def _last_line(message: str) -> str:
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def wait_for_superlink(
    connection: str, env: dict[str, str], timeout: float, where: str = "", interval: float = 2.0
) -> None:
    """Return once `flwr supernode list` succeeds; RegistrationError after `timeout` seconds,
    or at once for an error that waiting cannot fix."""
    where = where or f"of connection {connection!r}"
    deadline = time.monotonic() + timeout
    while True:
        answer = _run_json(["supernode", "list", connection, "--format", "json"], env)
        if answer.get("success"):
            return
        message = str(answer.get("error-message", ""))
        if not any(word in message.lower() for word in TRANSIENT):
            raise RegistrationError(f"the SuperLink {where} answered: {_last_line(message)}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RegistrationError(
                f"the SuperLink {where} did not answer within {timeout:.0f} s; "
                f"last error: {_last_line(answer.get('error-message', ''))} "
                "(is it running and reachable, and does its certificate match the address and CA?)"
            )
        time.sleep(min(interval, remaining))


def register(keys: Sequence[Path], connection: str, env: dict[str, str]) -> dict[Path, str]:
    """Register each key; {key: "registered as node N" | "already registered"}.

    Every key is tried; RegistrationError lists those that failed."""
    outcome, failures = {}, []
    for key in keys:
        answer = _run_json(["supernode", "register", str(key), connection, "--format", "json"], env)
        if answer.get("success"):
            outcome[key] = f"registered as node {answer.get('node-id')}"
        elif ALREADY_REGISTERED in str(answer.get("error-message", "")).lower():
            outcome[key] = "already registered"
        else:
            failures.append(f"{key}: {_last_line(answer.get('error-message', ''))}")
        if key in outcome:
            print(f"{key}: {outcome[key]}", flush=True)
    if failures:
        raise RegistrationError("could not register:\n  " + "\n  ".join(failures))
    return outcome


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("keys", nargs="+", type=Path, help="SuperNode public key files (<name>.pub)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--connection", help="a [superlink.NAME] entry of $FLWR_HOME/config.toml")
    target.add_argument("--address", help="the SuperLink's HOST:PORT (a name in its certificate)")
    security = parser.add_mutually_exclusive_group()
    security.add_argument("--root-certificates", type=Path, help="the federation's CA certificate (with --address)")
    security.add_argument("--insecure", action="store_true", help="plain-text connection (with --address; tests)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the SuperLink (default 120)")
    args = parser.parse_args(argv)
    if args.address and not (args.root_certificates or args.insecure):
        parser.error("--address needs --root-certificates CA_FILE (or --insecure)")
    if args.connection and (args.root_certificates or args.insecure):
        parser.error("--root-certificates/--insecure go with --address; a connection entry has its own")
    missing = [str(k) for k in args.keys if not k.is_file()]
    if missing:
        print(f"error: public key file(s) not found: {', '.join(missing)}", file=sys.stderr)
        return 2

    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    with tempfile.TemporaryDirectory(prefix="register-nodes-") as tmp:
        try:
            if args.address:
                env["FLWR_HOME"] = tmp
                try:
                    write_flwr_config(CONNECTION, args.address, args.root_certificates, Path(tmp))
                except ValueError as err:
                    parser.error(str(err))
                connection = CONNECTION
            else:
                connection = args.connection
            where = f"at {args.address}" if args.address else f"of connection {connection!r}"
            print(f"waiting for the SuperLink {where} ...", flush=True)
            wait_for_superlink(connection, env, args.timeout, where)
            register(args.keys, connection, env)
        except RuntimeError as err:  # RegistrationError, or no `flwr` CLI
            print(f"error: {err}", file=sys.stderr)
            return 1
    print(f"{len(args.keys)} key(s) registered with the SuperLink {where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

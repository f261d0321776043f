"""The supervisor's output (`fedgpu-run`, app/tools/supervise.py): the ServerApp's log lines
exactly as the ServerApp wrote them, a progress line while it waits, defaults in --help, and a
verdict that cannot be missed. Its recovery logic is tested in tests/test_recovery.py."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.cli.log import print_logs
from flwr.proto.control_pb2 import StreamLogsResponse  # pylint: disable=no-name-in-module

from app.tools.processes import strip_colours
from app.tools.supervise import Flwr, LogFollower, follow, main, supervise, verdict
from tests.test_recovery import FakeFlwr

INFO, WARN, RESET = "\x1b[92mINFO \x1b[0m", "\x1b[93mWARNING \x1b[0m", "\x1b[0m"


def shown(server_log: str) -> str:
    """What `flwr log RUN --show` prints for a ServerApp log: Flower's own `print_logs` (a
    `print(log_output)`, so one newline more than the log) on a stub of the Control API."""

    class Stub:
        def StreamLogs(self, request: object) -> Iterator[StreamLogsResponse]:  # noqa: N802 (Flower's name)
            yield StreamLogsResponse(log_output=server_log, latest_timestamp=1.0)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_logs(1, Stub())  # type: ignore[arg-type]
    return out.getvalue()


class ScriptedCli(Flwr):
    """`Flwr` with the `flwr` CLI answering from a script (`_run`): each `flwr log --show` sees the next
    stage of the ServerApp's log (a stage may end in the middle of a line, as Flower stores
    each write of the ServerApp's stdout), and `flwr list` says running until the last."""

    def __init__(self, stages: list[str], final: str = "finished:completed") -> None:
        super().__init__(None)
        self.stages, self.final, self.calls = stages, final, 0

    def _run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        args = cmd[1:]
        if args[0] == "log":
            stage = self.stages[min(self.calls, len(self.stages) - 1)]
            self.calls += 1
            # The CLI prints its connection first on stdout (the first call: the local SuperLink
            # it started too), the log after it; its own log line goes to stderr.
            preamble = "\x1b[34mUsing SuperLink: local (127.0.0.1:39091)\x1b[0m\n"
            if self.calls == 1:
                preamble = "Starting local SuperLink on 127.0.0.1:39091...\n" + preamble
            return subprocess.CompletedProcess(
                args, 0, preamble + shown(stage), "INFO :      Printing logstream for run_id `1`\n"
            )
        if args[0] == "list":
            status = self.final if self.calls >= len(self.stages) else "running"
            return subprocess.CompletedProcess(args, 0, json.dumps({"success": True, "runs": [{"status": status}]}), "")
        raise AssertionError(f"unexpected flwr {args}")


def test_each_log_line_is_echoed_once_whole_and_without_blank_lines() -> None:
    """Flower's `flwr log --show` prints the whole log each time plus one newline of its own:
    counting that newline as log text cut the first character of the next new line
    (`NFO :      [ROUND 2]`) and echoed an empty line after every chunk. The CLI's own lines
    before the log are no log lines."""
    lines = [
        f"{INFO}:      Starting Flower ServerApp",
        f"{INFO}:      [ROUND 1/3]",
        f"{INFO}:      [round 1/3] accuracy 0.51",
        f"{WARN}:      node 1002 is slow",
        f"{INFO}:      [ROUND 2/3]",
        f"{INFO}:      [round 3/3] accuracy 0.93",
    ]
    log = "".join(line + "\n" for line in lines)
    stages = [log[: log.index(lines[1])], log[: log.index(lines[3])], log]
    stages.insert(2, stages[1] + f"{INFO}:      partial li")  # a line still being written
    echoed: list[str] = []
    assert follow(ScriptedCli(stages), "1", stall_timeout_s=60, poll_s=0, echo=echoed.append) == "completed"
    want = [line.replace(INFO, "INFO ").replace(WARN, "WARNING ") for line in lines]
    assert "" not in echoed, echoed
    assert [e for e in echoed if "partial" not in e] == want, echoed


def test_a_line_written_in_two_pieces_is_echoed_as_one() -> None:
    """print() in the ServerApp writes the text and the newline separately: Flower may store
    (and show) the first piece alone. The line is echoed once it is complete, and a last line
    without a newline when the run has finished."""
    stages = ["first\nsecond ha", "first\nsecond half\n", "first\nsecond half\nlast words"]
    echoed: list[str] = []
    assert follow(ScriptedCli(stages), "1", stall_timeout_s=60, poll_s=0, echo=echoed.append) == "completed"
    assert echoed == ["first", "second half", "last words"]


def test_a_silent_run_gets_a_progress_line_naming_the_wait_and_what_comes_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    echoed: list[str] = []
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu.supervise"):
        outcome = follow(
            ScriptedCli(["[ROUND 1/3]\n"] * 10**6), "7", stall_timeout_s=0.5, poll_s=0.02, echo=echoed.append,
            progress_s=0.1,
        )  # fmt: skip
    assert outcome.startswith("stalled")
    progress = [r.getMessage() for r in caplog.records if "no new log line for" in r.getMessage()]
    assert len(progress) >= 2, caplog.text
    assert (
        "run 7" in progress[0] and "Flower says running" in progress[0] and "stopped and submitted again" in progress[0]
    )
    assert echoed == ["[ROUND 1/3]"]


# A ServerApp's failure as `flwr log` shows it in simulation: its own ERROR line, then
# Flower's generic one, the traceback, and Flower's exit code.
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/home/u/.flwr/apps/fedgpu/app/server_app.py", line 36, in main\n'
    "    cfg, raw = load_config(overrides)\n"
    "{exception}\n"
    "\x1b[91mERROR \x1b[0m:     Exit Code: 700\n\nAn unhandled exception occurred when running the simulation.\n"
)


def failure(own_line: str, exception: str) -> str:
    return (
        f"{INFO}:      [ROUND 1/3]\n{own_line}"
        "\x1b[91mERROR \x1b[0m:     Simulation raised an exception\n" + TRACEBACK.format(exception=exception)
    )


def test_a_superlink_that_does_not_answer_is_named_in_the_progress_line(caplog: pytest.LogCaptureFixture) -> None:
    class Unreachable(ScriptedCli):
        def _run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
            if cmd[1] == "list":  # what Flower's CLI answers then: exit status 0, the error in the JSON
                error = "Using SuperLink: x\\nConnection to the SuperLink is unavailable. Please check ..."
                return subprocess.CompletedProcess(cmd, 0, f'{{"success": false, "error-message": "{error}"}}', "")
            return super()._run(cmd, timeout)

    with caplog.at_level(logging.INFO, logger="flwr.fedgpu.supervise"):
        outcome = follow(Unreachable(["[ROUND 1/3]\n"] * 10**6), "7", 0.3, 0.02, lambda _: None, progress_s=0.1)
    said = "no status: flwr list: Connection to the SuperLink is unavailable. Please check ..."
    assert outcome == f"stalled: no new log line for 0 s ({said})"
    assert f"({said})" in caplog.text


def test_the_flwr_cli_against_a_dead_superlink_says_why(tmp_path: Path) -> None:
    """The real CLI: `flwr list` puts its error in the JSON, `flwr log` in a box on stderr."""
    (tmp_path / "config.toml").write_text(
        '[superlink]\ndefault = "dead"\n\n[superlink.dead]\naddress = "127.0.0.1:9"\ninsecure = true\n'
    )
    flwr = Flwr(None, {**os.environ, "FLWR_HOME": str(tmp_path), "FLWR_DISABLE_UPDATE_CHECK": "1"})
    assert flwr.status("1") == "" and flwr.problem.startswith("flwr list: Connection to the SuperLink is unavailable.")
    assert flwr.logs("1") is None and flwr.problem.startswith("flwr log: Connection to the SuperLink is unavailable.")


def test_a_failed_run_says_why_with_the_exception_not_flowers_generic_lines() -> None:
    crash = failure("", "RuntimeError: CUDA error: an illegal memory access was encountered")
    outcome = follow(ScriptedCli([crash], final="finished:failed"), "3", 60, 0, echo=lambda _: None)
    assert outcome == (
        "failed: Flower says finished:failed; why: RuntimeError: CUDA error: an illegal memory access was encountered"
    )


def test_a_refused_configuration_is_not_submitted_again() -> None:
    """The ServerApp's "invalid configuration, nothing was run" (app/server_app.py): the same
    command would fail the same way, so one attempt, FAILED at once."""
    exception = "app.config.schema.ConfigError: strategy='fedavgg' is not a known strategy option"
    own = "\x1b[91mERROR \x1b[0m:     invalid configuration, nothing was run: strategy='fedavgg' is not a known\n"
    flwr = FakeFlwr([[("finished:failed", strip_colours(failure(own, exception)))]] * 4)  # as Flwr.logs gives it
    (attempt,) = supervise(flwr, "name=x strategy=fedavgg", retries=3, poll_s=0, echo=lambda _: None)
    assert attempt.outcome == f"failed: invalid configuration: Flower says finished:failed; why: {exception}"
    assert len(flwr.submitted) == 1 and verdict("name=x", [attempt])[1].startswith("FAILED: run 'x' did not complete")
    quoted = f"{WARN}:   node 3 failed: {own}"  # a node's error reason that quotes the words: retried
    flwr = FakeFlwr([[("finished:failed", strip_colours(failure(quoted, exception)))]] * 2)
    assert len(supervise(flwr, "name=x", retries=1, poll_s=0, echo=lambda _: None)) == 2


def test_the_serverapp_refuses_a_bad_configuration_in_the_words_the_supervisor_reads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from flwr.app import Context, RecordDict

    from app.config.schema import ConfigError
    from app.server_app import main as server_main

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"overrides": "strategy=x"})
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu"), pytest.raises(ConfigError):
        server_main(None, context)  # type: ignore[arg-type]
    follower = LogFollower(lambda _: None)
    follower.feed("".join(f"{r.levelname} :     {r.getMessage()}\n" for r in caplog.records))
    assert follower.invalid_config and "strategy" in follower.error


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "resubmissions after the first attempt (default: 3)" in text
    assert "(default: 900" in text and "(default: 2.0)" in text


def test_a_run_that_never_completes_exits_1_and_its_last_line_says_failed(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """`flwr run --stream` exits 0 when the ServerApp fails; `fedgpu-run` exits 1, and its very
    last line (stdout and stderr together, as a terminal shows them) says FAILED and why."""
    log = failure("", "torch.OutOfMemoryError: CUDA out of memory")

    class Failing(ScriptedCli):
        def __init__(self, superlink: str | None, env: dict[str, str] | None = None) -> None:
            super().__init__([log], final="finished:failed")

        def _run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
            if cmd[1] == "run":
                self.calls = 0
                return subprocess.CompletedProcess(cmd, 0, "Successfully started run 12\n", "")
            if cmd[1] == "stop":
                return subprocess.CompletedProcess(cmd, 0, "", "")
            return super()._run(cmd, timeout)

    monkeypatch.setattr("app.tools.supervise.Flwr", Failing)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # main's basicConfig writes to this stderr
    assert main(["--retries", "1", "--poll", "0", "--", "name=exp1"]) == 1
    out, err = capfd.readouterr()
    assert "INFO :      [ROUND 1/3]" in out
    last = err.strip().splitlines()[-1]
    assert "FAILED" in last and "2 attempts" in last and "CUDA out of memory" in last, err

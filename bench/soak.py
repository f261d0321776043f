"""Soak test: a supervised run on the local secure stack, crashed again and again, must end as
if nothing had happened.

    python bench/soak.py                          # 30 rounds, 5 SuperNodes (about an hour on 2 cores)
    python bench/soak.py --quick --json out.json  # 4 rounds, 2 SuperNodes (tests/test_soak.py)

The user's path throughout: `scripts/local_deployment.py up` brings up the secure stack (TLS,
SuperNode authentication, `--isolation process`), `fedgpu-run` (app/tools/supervise.py)
submits a named run with central DP (`privacy=central`) and re-submits it whenever Flower says
it failed or its log falls silent, and this script, watching `metrics.jsonl`, breaks things:

- a SuperNode is SIGKILLed (with its SuperExec and ClientApps) after every `--node-every`
  rounds, in turn, and brought back by `up` once one more round has completed;
- the ServerApp process is SIGKILLed after the rounds in `--serverapp-kills`;
- the SuperLink process is SIGKILLed after the rounds in `--superlink-kills`, and `up`
  restarts the server side at once (as a service manager would).

Each recovery's cost is the time from the kill until the next round appears in
`metrics.jsonl`. Done when the supervisor exits 0 and: every round is in `metrics.jsonl`
exactly once, `python -m app.ledger verify` accepts the run's ledger, and the final ε is the
one an uninterrupted run with the same configuration reports (that run is made in this process,
`app/tools/in_process.py`) and the one an independent accountant (Google's `dp_accounting`)
computes from the accountant history in the final checkpoint. The killed nodes change the
cohorts, but not ε: with every connected node sampled (`fraction_train=1`) each round is one
Gaussian release at sampling rate 1, whoever answers. The models cannot be compared: central
DP draws its noise from the OS's CSPRNG, so no two runs share a model.

The figures are printed and written as JSON (`--json`, default docs/soak-results.json for the
full soak): the wall time, each recovery and its cost, the supervisor's attempts, the checks.
A hang detector aborts (and still writes the JSON, `ok: false`) when no round completes for
`--stuck-after` seconds. The stack is brought down at the end (`down`), whatever happened.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's `app`, ahead of any installed copy
sys.path.insert(1, str(ROOT / "scripts"))  # local_deployment.py, which puts its own neighbours there too
sys.path.append(str(ROOT / "bench"))  # machine.py (last: the test that imports this module shadows nothing)

import local_deployment  # noqa: E402
from machine import cpu_model  # noqa: E402

from app.tools.processes import cmdline, free_ports, proc_table, strip_colours  # noqa: E402

NAME = "soak"
SCRIPT = ROOT / "scripts" / "local_deployment.py"


@dataclass
class Plan:
    """What the soak runs and what it breaks (rounds after which each kill happens)."""

    rounds: int = 30
    nodes: int = 5
    node_kills: tuple[int, ...] = (5, 10, 15, 20, 25)
    serverapp_kills: tuple[int, ...] = (8, 18)
    superlink_kills: tuple[int, ...] = (13,)
    seed: int = 7
    noise_multiplier: float = 1.0
    round_timeout_s: float = 120.0  # a killed node's task is given up after this (or on Flower's error)
    stall_timeout_s: float = 300.0  # the supervisor's: no new ServerApp log line for this long
    retries: int = 8
    stuck_after_s: float = 1200.0  # the hang detector: no new round for this long
    timeout_s: float = 3 * 3600.0  # the whole soak

    def overrides(self, name: str = NAME) -> str:
        """The run's Hydra overrides: central DP, every connected node sampled each round, one
        node may be missing at (re)start."""
        return (
            f"name={name} seed={self.seed} privacy=central privacy.noise_multiplier={self.noise_multiplier} "
            f"federation.rounds={self.rounds} federation.min_available_nodes={max(1, self.nodes - 1)} "
            f"federation.min_train_nodes=1 federation.round_timeout_s={self.round_timeout_s} train.epochs=1"
        )


# The shortened soak (tests/test_soak.py): the killed node comes back with the server side
# (the `up` after the SuperLink kill), so that the three recoveries overlap where they can.
QUICK = Plan(
    rounds=4, nodes=2, node_kills=(1,), superlink_kills=(2,), serverapp_kills=(3,),
    round_timeout_s=45.0, stall_timeout_s=150.0, retries=4, stuck_after_s=480.0, timeout_s=1500.0,
)  # fmt: skip


@dataclass
class Event:
    """One kill: what, after which round, when (seconds since the soak started) and its cost."""

    kind: str  # node | serverapp | superlink
    after_round: int
    target: str = ""
    at_s: float | None = None
    rounds_done: int = 0  # rounds in metrics.jsonl when it was killed
    cost_s: float | None = None  # kill -> the next round in metrics.jsonl
    restarted_after_round: int | None = None  # node: `up` once this round is in metrics.jsonl
    restart_s: float | None = None  # how long the `up` that restarted it took
    restarted_by: str = ""  # node: which `up` (its own, or the one after a SuperLink kill)
    detail: str = ""


def schedule(plan: Plan) -> list[Event]:
    events = [Event("node", r, f"node-{i % plan.nodes}") for i, r in enumerate(plan.node_kills)]
    events += [Event("serverapp", r, "flwr-serverapp") for r in plan.serverapp_kills]
    events += [Event("superlink", r, "superlink") for r in plan.superlink_kills]
    events.sort(key=lambda e: e.after_round)
    rounds = [e.after_round for e in events]
    if len(set(rounds)) != len(rounds) or any(not 0 < r < plan.rounds for r in rounds):
        raise ValueError(f"one kill per round, each before the last round ({plan.rounds}): {rounds}")
    down = {}  # node -> the round after which it comes back
    for e in events:
        if e.kind == "node":
            if down.get(e.target, 0) > e.after_round:
                raise ValueError(f"{e.target} is killed after round {e.after_round} while it is still down")
            e.restarted_after_round = down[e.target] = e.after_round + 1
            if e.restarted_after_round >= plan.rounds:
                raise ValueError(f"{e.target} would come back after the last round ({plan.rounds})")
    return events


class RoundWatch(threading.Thread):
    """Reads metrics.jsonl twice a second: when each round first appeared, and whether the file
    ever lost rows (a resume truncating rounds past its checkpoint)."""

    def __init__(self, metrics: Path, t0: float) -> None:
        super().__init__(daemon=True)
        self.metrics, self.t0 = metrics, t0
        self.first_seen: dict[int, float] = {}
        self.shrunk = 0
        self._rows = 0
        self._halt = threading.Event()

    def rows(self) -> list[dict[str, Any]]:
        try:
            complete = self.metrics.read_text().split("\n")[:-1]  # the last piece may be a line being written
        except OSError:
            return []
        return [json.loads(line) for line in complete if line.strip()]

    def run(self) -> None:
        while not self._halt.wait(0.5):
            rows = self.rows()
            if len(rows) < self._rows:
                self.shrunk += 1
            self._rows = len(rows)
            for row in rows:
                self.first_seen.setdefault(int(row["round"]), time.monotonic() - self.t0)

    def done(self) -> int:
        """The highest round seen so far."""
        return max(self.first_seen, default=0)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class Soak:
    def __init__(self, plan: Plan, state: Path, echo: Any = print, reference: bool = True) -> None:
        self.plan, self.state, self.echo, self.reference = plan, state.resolve(), echo, reference
        self.out = self.state / "runs"
        self.run_dir = self.out / NAME
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def script(self, *args: str, timeout: float = 900.0) -> str:
        """`python scripts/local_deployment.py ARGS --state-dir STATE`, as a user runs it."""
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *args, "--state-dir", str(self.state)],
            capture_output=True, text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"local_deployment.py {args[0]} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def deployment(self) -> Any:
        return local_deployment.Deployment.load(self.state)

    # ------------------------------------------------------------------ the kills

    def kill_node(self, name: str) -> str:
        """SIGKILL a SuperNode with its SuperExec and ClientApps (a crash: no goodbye)."""
        fed = self.deployment()
        killed = local_deployment.owned_processes([fed.procs[name]])
        fed.stop([name])  # no grace: SIGKILL
        return f"SIGKILL {sorted(killed)}"

    def kill_serverapp(self) -> str:
        """SIGKILL the run's ServerApp process (the SuperExec's child), nothing else."""
        fed = self.deployment()

        def serverapps() -> set[int]:
            owned = local_deployment.owned_processes([fed.procs["superexec"]])
            return {p for p in owned if "flwr-serverapp" in cmdline(p)}

        pids = local_deployment.wait_until(serverapps, 120.0, "a running flwr-serverapp", 0.2)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return f"SIGKILL {sorted(pids)}"

    def kill_superlink(self) -> str:
        """SIGKILL the flower-superlink process only; `up` then restarts the server side."""
        fed = self.deployment()
        rec = fed.procs["superlink"]
        if not rec.matches(proc_table().get(rec.pid)):
            raise RuntimeError("the recorded SuperLink is not running")
        os.kill(rec.pid, signal.SIGKILL)
        return f"SIGKILL {rec.pid}"

    def leftover_clientapps(self) -> list[dict[str, Any]]:
        """ClientApp processes still alive once the run has completed: tasks of runs that died
        (a killed ServerApp, a restarted SuperLink) whose processes never exited."""
        fed, table = self.deployment(), proc_table()
        ticks = os.sysconf("SC_CLK_TCK")
        boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
        left = []
        for name in sorted(n for n in fed.procs if n.startswith("node-")):
            for pid in sorted(local_deployment.owned_processes([fed.procs[name]])):
                if "flwr-clientapp" in cmdline(pid) and pid in table:
                    age = time.time() - (boot + table[pid].start / ticks)
                    left.append({"node": name, "pid": pid, "age_s": round(age), "rss_mib": _rss_mib(pid)})
        return left

    # ------------------------------------------------------------------ the run

    def supervisor(self, log: Path) -> subprocess.Popen:
        """`fedgpu-run` against the stack's connection, results under <state>/runs."""
        exe = Path(sys.executable).parent / "fedgpu-run"
        cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "app.supervise"]
        plan = self.plan
        cmd += [
            "--superlink", local_deployment.CONNECTION, "--output-dir", str(self.out), "--retries", str(plan.retries),
            "--stall-timeout", str(plan.stall_timeout_s), "--poll", "2", "--", *plan.overrides().split(),
        ]  # fmt: skip
        env = self.deployment().env("cli")
        with log.open("ab") as out:
            return subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )  # fmt: skip

    def run(self) -> dict[str, Any]:
        plan, events = self.plan, schedule(self.plan)
        result: dict[str, Any] = {"plan": asdict(plan), "overrides": plan.overrides(), "machine": machine()}
        log = self.state / "supervise.log"
        watch: RoundWatch | None = None
        sup: subprocess.Popen | None = None
        try:
            port = str(free_ports(1)[0])
            self.echo(f"[{self.now():7.1f} s] up: {plan.nodes} SuperNodes, state {self.state}")
            self.script("up", "--nodes", str(plan.nodes), "--port", port)
            result["up_s"] = round(self.now(), 1)
            watch = RoundWatch(self.run_dir / "metrics.jsonl", self.t0)
            watch.start()
            sup = self.supervisor(log)
            self.echo(f"[{self.now():7.1f} s] fedgpu-run started (log {log})")
            last_round, last_progress = 0, self.now()
            while sup.poll() is None:
                done = watch.done()
                if done > last_round:
                    last_round, last_progress = done, self.now()
                    self.echo(f"[{self.now():7.1f} s] round {done} in metrics.jsonl")
                if self.now() - last_progress > plan.stuck_after_s or self.now() > plan.timeout_s:
                    raise TimeoutError(
                        f"hang detector: no new round for {self.now() - last_progress:.0f} s "
                        f"(last {last_round}; {self.now():.0f} s since the start)"
                    )
                self.step(events, done)
                time.sleep(0.5)
            result["supervisor_exit"] = sup.returncode
            result["wall_time_s"] = round(self.now(), 1)
            result["clientapps_left_running"] = self.leftover_clientapps()
            time.sleep(1.0)  # the watcher's last look
        except Exception as err:  # noqa: BLE001 - recorded in the result, which says ok: false
            result["error"] = f"{type(err).__name__}: {err}"
            self.echo(f"[{self.now():7.1f} s] ERROR {result['error']}")
        finally:
            if sup is not None and sup.poll() is None:
                sup.terminate()
                try:
                    sup.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    sup.kill()
            if watch is not None:
                watch.stop()
            try:
                result["down"] = self.script("down", timeout=300).strip().splitlines()[-1:]
            except Exception as err:  # noqa: BLE001
                result["down"] = f"FAILED: {err}"
        result["supervisor"] = supervisor_attempts(log)
        result["round_log"] = round_lines(log)
        if watch is not None:
            result["round_first_seen_s"] = {str(k): round(v, 1) for k, v in sorted(watch.first_seen.items())}
            result["metrics_rewritten"] = watch.shrunk
        result.update(self.costs(events, watch))
        result.update(check(self.run_dir, plan, self.reference))
        result["total_s"] = round(self.now(), 1)  # with the checks and the uninterrupted run
        recovered = all(e["fired"] for e in result["recoveries"].values())
        result["ok"] = bool(
            "error" not in result and result.get("supervisor_exit") == 0 and result["rounds"]["seen_once"]
            and result["ledger"]["ok"] and result["epsilon"]["ok"] and recovered
        )  # fmt: skip
        if not result["ok"]:
            result["supervisor_log_tail"] = strip_colours(_tail(log, 6000))
        return result

    def step(self, events: list[Event], done: int) -> None:
        """Fire what is due, kills first: a kill after round r, and the `up` that brings back a
        node killed a round earlier (unless the `up` after a SuperLink kill did already). One
        action per call: the caller looks at metrics.jsonl again in between."""
        for e in events:
            if e.at_s is None and e.after_round <= done:
                e.rounds_done = done
                e.at_s = round(self.now(), 1)
                if e.kind == "node":
                    e.detail = self.kill_node(e.target)
                else:
                    e.detail = self.kill_serverapp() if e.kind == "serverapp" else self.kill_superlink()
                self.echo(f"[{e.at_s:7.1f} s] killed {e.target} after round {done}: {e.detail}")
                if e.kind == "superlink":
                    e.restart_s = self.restart(events, "after the SuperLink kill")
                return
        for e in events:
            if e.kind == "node" and e.at_s is not None and not e.restarted_by and e.restarted_after_round <= done:
                self.restart(events, f"{e.target} after round {done}")
                return

    def restart(self, events: list[Event], why: str) -> float:
        """`up`, which starts whatever is not running; the killed nodes it brought back are marked."""
        t = self.now()
        out = self.script("up")
        took = round(self.now() - t, 1)
        started = next((line for line in out.splitlines() if line.startswith("started:")), "")
        self.echo(f"[{self.now():7.1f} s] up ({why}): {started} in {took:.1f} s")
        for e in events:
            if (
                e.kind == "node"
                and e.at_s is not None
                and not e.restarted_by
                and e.target in re.findall(r"[\w-]+", started)
            ):
                e.restart_s, e.restarted_by = took, f"up {why}"
        return took

    def costs(self, events: list[Event], watch: RoundWatch | None) -> dict[str, Any]:
        """Each kill's cost (kill -> next round in metrics.jsonl), per kind, and the median time
        between rounds that no kill touched (what a round costs anyway)."""
        seen = watch.first_seen if watch else {}
        for e in events:
            if e.at_s is not None and (nxt := seen.get(e.rounds_done + 1)) is not None:
                e.cost_s = round(nxt - e.at_s, 1)
        touched = {e.rounds_done + 1 for e in events} | {e.rounds_done + 2 for e in events if e.kind == "node"}
        gaps = [seen[r] - seen[r - 1] for r in seen if r - 1 in seen and r not in touched and r > 1]
        kinds: dict[str, Any] = {}
        for kind in ("node", "serverapp", "superlink"):
            mine = [e for e in events if e.kind == kind]
            costs = [e.cost_s for e in mine if e.cost_s is not None]
            kinds[kind] = {
                "planned": len(mine),
                "fired": all(e.at_s is not None for e in mine)
                and len(costs) == len(mine)
                and all(e.restarted_by for e in mine if e.kind == "node"),
                "recovered": len(costs),
                "cost_s": costs,
                "mean_cost_s": round(statistics.mean(costs), 1) if costs else None,
            }
        return {
            "events": [asdict(e) for e in events],
            "recoveries": kinds,
            "median_round_s": round(statistics.median(gaps), 1) if gaps else None,
        }


def _tail(path: Path, chars: int) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def supervisor_attempts(log: Path) -> list[dict[str, str]]:
    """The supervisor's closing lines: `attempt N: run ID: OUTCOME`."""
    found = re.findall(r"supervise: attempt (\d+): run (\S+): (.+)$", strip_colours(_tail(log, 10**7)), re.M)
    return [{"attempt": a, "run_id": r, "outcome": o.strip()} for a, r, o in found]


def _rss_mib(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) >> 10 for line in status.splitlines() if line.startswith("VmRSS:")), None)


def round_lines(log: Path) -> dict[str, str]:
    """Per round, what the ServerApp's log said of its cohort the last time it ran it
    ("clients 4  rejected 0  missing 1"): metrics.jsonl leaves cohorts out under central DP."""
    found = re.findall(r"\[round (\d+)/\d+\].*?(clients \d+.*)$", strip_colours(_tail(log, 10**7)), re.M)
    return {r: " ".join(text.split()) for r, text in found}


def machine() -> dict[str, Any]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "load_avg_at_start": os.getloadavg()}


def accountant_history(strategy_state: Any) -> list[tuple[float, float, int]] | None:
    """The central-DP accountant's history (noise multiplier, sample rate, steps) wherever the
    strategy keeps it in its checkpointed state."""
    if isinstance(strategy_state, dict):
        if isinstance(history := strategy_state.get("history"), list | tuple) and all(len(h) == 3 for h in history):
            return [(float(z), float(q), int(n)) for z, q, n in history]
        for value in strategy_state.values():
            if (found := accountant_history(value)) is not None:
                return found
    return None


def independent_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """ε of `history` from Google's dp_accounting RDP accountant (not Opacus, which the run uses)."""
    from dp_accounting import dp_event, rdp

    accountant = rdp.RdpAccountant()
    for z, q, steps in history:
        event = dp_event.GaussianDpEvent(z)
        accountant.compose(event if q >= 1 else dp_event.PoissonSampledDpEvent(q, event), steps)
    return float(accountant.get_epsilon(delta))


def check(run_dir: Path, plan: Plan, reference: bool = True) -> dict[str, Any]:
    """The run's rounds, its ledger and its ε (against the history and an uninterrupted run)."""
    from app.run.checkpoint import load_checkpoint
    from app.run.results import read_rows, read_summary

    rows = read_rows(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    rounds = [int(r["round"]) for r in rows]
    want = list(range(1, plan.rounds + 1))
    out: dict[str, Any] = {
        "rounds": {
            "expected": plan.rounds, "seen_once": rounds == want, "missing": sorted(set(want) - set(rounds)),
            "duplicates": sorted({r for r in rounds if rounds.count(r) > 1}),
        },
    }  # fmt: skip
    ledger = subprocess.run(
        [sys.executable, "-m", "app.ledger", "verify", str(run_dir)], capture_output=True, text=True, cwd=ROOT
    )
    out["ledger"] = {"ok": ledger.returncode == 0, "output": (ledger.stdout + ledger.stderr).strip()[-2000:]}
    summary = read_summary(run_dir) or {}
    privacy = summary.get("privacy") or {}
    eps: dict[str, Any] = {
        "summary_status": summary.get("status"), "summary": privacy.get("epsilon"), "releases": privacy.get("releases"),
        "delta": privacy.get("delta"), "ok": False,
    }  # fmt: skip
    try:
        history = accountant_history(load_checkpoint(run_dir / "checkpoint.pt").strategy_state)
    except (OSError, ValueError) as err:
        history, eps["error"] = None, f"checkpoint: {err}"
    eps["history"] = history
    if history and eps["summary"] is not None:
        eps["independent"] = independent_epsilon(history, float(eps["delta"]))
        eps["independent_rel_diff"] = abs(eps["independent"] - eps["summary"]) / eps["summary"]
        eps["steps_in_history"] = sum(n for _, _, n in history)
        eps["ok"] = eps["independent_rel_diff"] < 1e-9 and eps["steps_in_history"] == plan.rounds == eps["releases"]
    if reference and eps["ok"]:
        from app.tools.in_process import run_in_process

        with tempfile.TemporaryDirectory(prefix="fedgpu-soak-ref-") as tmp:
            whole, _ = run_in_process(plan.overrides("uninterrupted"), tmp, nodes=plan.nodes)
        eps["uninterrupted"] = whole["privacy"]["epsilon"]
        eps["uninterrupted_releases"] = whole["privacy"]["releases"]
        eps["ok"] = eps["uninterrupted_releases"] == plan.rounds and abs(
            eps["uninterrupted"] - eps["summary"]
        ) <= 1e-12 * abs(eps["summary"])
    out["epsilon"] = eps
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 rounds, 2 nodes, one kill of each kind")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--state-dir", type=Path, help="default: a fresh temporary directory, deleted after")
    parser.add_argument("--json", type=Path, help="default docs/soak-results.json (full soak), none with --quick")
    parser.add_argument("--keep", action="store_true", help="keep the state directory (logs, results)")
    parser.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run (its ε)")
    args = parser.parse_args(argv)
    plan = Plan(**asdict(QUICK)) if args.quick else Plan()
    if args.rounds or args.nodes:
        plan.rounds, plan.nodes = args.rounds or plan.rounds, args.nodes or plan.nodes
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="fedgpu-soak-"))
    try:
        result = Soak(plan, state, reference=not args.no_reference).run()
    finally:
        if not args.keep and args.state_dir is None:
            shutil.rmtree(state, ignore_errors=True)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    path = args.json or (None if args.quick else ROOT / "docs" / "soak-results.json")
    if path is not None:
        path.write_text(text + "\n")
        print(f"written to {path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

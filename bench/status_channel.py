"""What the MQTT status channel costs a round (issue 39; goal: under 1% of the round time on the
default run), through `flwr run`.

    python bench/status_channel.py --repeats 3 --json docs/status-channel-benchmark.json

The default federation (5 simulated nodes, 10 rounds, the default recipe) runs with and without
`monitoring.mqtt` against a local Mosquitto (TLS, passwords: app/tools/broker.py), the nodes with
their own credentials, interleaved (the order flips every repeat, so drift in the machine's load
falls on both arms). Reported per arm: the median round time over rounds 2-10 of each run (round 1
holds the ClientApps' start-up), and the ratio with / without. Also read from the runs: the
messages the server handed over, delivered and dropped (the rows' `status_channel`), and the
heartbeats the broker relayed (a subscriber counts them), so the channel is shown to have worked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's `app`, ahead of any installed copy

from app.run.results import read_rows  # noqa: E402
from app.status.channel import paho_client  # noqa: E402
from app.tools.broker import LocalBroker, missing  # noqa: E402
from app.tools.sweep import run_in_simulation  # noqa: E402
from bench.flwr_runs import app_copy  # noqa: E402
from bench.machine import cpu_model  # noqa: E402

FEDERATION = "num-supernodes=5 client-resources-num-cpus=1"


def heartbeat_counter(broker: LocalBroker) -> tuple[mqtt.Client, dict[str, int]]:
    """A subscriber (the `watcher` user) counting node heartbeats per run."""
    counts: dict[str, int] = {}
    client = paho_client(broker.watcher(), "bench-sub")
    client.on_connect = lambda c, *_: c.subscribe("fedgpu/nodes/#", qos=1)
    lock = threading.Lock()

    def on_message(c, userdata, msg) -> None:  # noqa: ANN001, ARG001
        run = json.loads(msg.payload).get("run", "?")
        with lock:
            counts[run] = counts.get(run, 0) + 1

    client.on_message = on_message
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    return client, counts


def one_run(name: str, extra: list[str], runs: Path, app_dir: Path) -> dict[str, Any]:
    job = runs / "jobs" / name
    job.mkdir(parents=True, exist_ok=True)
    result = run_in_simulation(job, runs / "runs", [f"name={name}", *extra], FEDERATION, 0, app_dir)
    if result["error"]:
        raise RuntimeError(f"{name}: {result['error']} (log: {job / 'flwr.log'})")
    rows = read_rows(runs / "runs" / name)
    times = [r["round_time_s"] for r in rows[1:]]
    return {
        "name": name,
        "median_round_s": statistics.median(times),
        "round_times_s": [r["round_time_s"] for r in rows],
        "final_accuracy": rows[-1]["accuracy"],
        "status_channel": rows[-1].get("status_channel"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if (why := missing()) is not None:
        parser.error(why)
    runs = (args.runs or Path(tempfile.mkdtemp(prefix="status-bench-"))).resolve()
    app_dir = runs / "app"
    if not (app_dir / "pyproject.toml").is_file():
        app_copy(runs, "app")
    broker = LocalBroker(runs / "broker")
    os.environ.update(broker.node_env())  # each run's local SuperLink starts with it: the nodes' credentials
    subscriber, heartbeats = heartbeat_counter(broker)
    machine = f"{cpu_model()}, {os.cpu_count()} CPUs"
    print(f"machine: {machine}; runs in {runs}", flush=True)
    arms: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    try:
        for repeat in range(args.repeats):
            order = ["without", "with"] if repeat % 2 == 0 else ["with", "without"]
            for arm in order:
                extra = broker.overrides() if arm == "with" else []
                found = one_run(f"{arm}-r{repeat}", extra, runs, app_dir)
                found["heartbeats"] = heartbeats.get(found["name"], 0)
                arms[arm].append(found)
                print(
                    f"{found['name']}: median round {found['median_round_s']:.3f} s, final accuracy "
                    f"{found['final_accuracy']:.4f}, channel {found['status_channel']}, heartbeats {found['heartbeats']}",
                    flush=True,
                )
    finally:
        subscriber.loop_stop()
        broker.stop()
    medians = {arm: statistics.median(r["median_round_s"] for r in found) for arm, found in arms.items()}
    ratio = medians["with"] / medians["without"]
    print(f"\nmedian round time without {medians['without']:.3f} s, with {medians['with']:.3f} s: ratio {ratio:.4f}")
    print(f"goal (under 1% of the round time): {'met' if ratio < 1.01 else 'NOT met'}")
    if args.json:
        payload = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine,
            "federation": FEDERATION,
            "repeats": args.repeats,
            "median_round_s": medians,
            "ratio": ratio,
            "runs": arms,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

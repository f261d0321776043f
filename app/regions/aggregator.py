"""A regional aggregator: a SuperNode of the global SuperLink whose training task is its region's
sub-federation (topology=regions on a deployment, docs/deployment.md#regions-two-level-deployment).

The aggregator's ClientApp (`app/client_app.py`'s train handler, when the node config names a
`region-superlink`) submits one run of this very app to the regional SuperLink through Flower's
Control API (`flwr run`, with the region's own FLWR_HOME: its address and TLS root certificate),
starting from the global model it received (`model.init_weights`) for one round
(`federation.rounds=1`), waits for Flower's verdict (`flwr list`), and replies with the sub-run's
final model and the region's weight: the sum of its sites' capped example counts, which the
sub-run's row records as `train["num-examples"]` (`strategies/replies.py: weighted_metrics`).
Nothing here is a transport of its own: the sites are ordinary SuperNodes of the regional
SuperLink, and the regional server is this app's ServerApp.

Every wait is bounded (the node's `region-timeout-s` and the task's own time to live); a sub-run
that fails, stops without an update or runs out of time makes this task fail, and the global
server counts the region as lost for the round. Imported only inside the train handler: most
nodes are sites.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message

from app.protocol import (
    ARRAYS,
    CONFIG,
    FROZEN,
    NAME,
    NUM_EXAMPLES,
    REGION_FLWR_HOME,
    REGION_NODES,
    REGION_OUTPUT_DIR,
    REGION_OVERRIDES,
    REGION_RUN_OVERRIDES,
    REGION_SAMPLED,
    REGION_SUPERLINK,
    REGION_TIMEOUT_S,
    SERVER_ROUND,
    is_reply_metric,
)

log = logging.getLogger("flwr.fedgpu." + __name__)

CLI_TIMEOUT_S = 120.0  # one `flwr` command (a Python start plus one Control API call) on a loaded host
POLL_S = 3.0  # between two `flwr list` calls while the sub-run goes on
TTL_MARGIN_S = 30.0  # the reply must reach the global SuperLink before the task it answers expires
INIT_DIR = "aggregator"  # under region-output-dir: the global models the sub-runs start from


class RegionFailed(RuntimeError):
    """The region's sub-run gave no update this round; the message says why (the global server logs
    it as this node's error reply)."""


# ---------------------------------------------------------------------------- overrides


def override_key(item: str) -> str:
    """The key a Hydra override sets: `strategy` for `strategy=krum`, `a.b` for `++a.b=1` or `~a.b`."""
    return item.lstrip("+~").partition("=")[0]


def split_overrides(overrides: str) -> list[str]:
    """Hydra overrides split as the ServerApp splits them (`app/config/compose.py`: shlex, quotes
    kept), without importing Hydra on a node."""
    import shlex

    return shlex.split(overrides, posix=False)


def merge_overrides(*layers: str) -> str:
    """The layers' overrides, a later layer winning key by key: an item drops every earlier item
    that sets the same key or a key under it (a group choice such as `strategy=median` drops the
    earlier `strategy.*` values, which belonged to the earlier choice). Hydra would refuse a group
    chosen twice; a plain key given twice would depend on its order."""
    merged: list[str] = []
    for layer in layers:
        for item in split_overrides(layer):
            key = override_key(item)
            merged = [m for m in merged if (k := override_key(m)) != key and not k.startswith(key + ".")]
            merged.append(item)
    return " ".join(merged)


def quoted(value: str) -> str:
    """A Hydra string value in single quotes (a path may hold '=' or ','). Whitespace cannot travel:
    the ServerApp splits its overrides at every space (non-POSIX shlex sees quotes only at a word's
    start)."""
    if "'" in value or "\\" in value or any(c.isspace() for c in value):
        raise RegionFailed(f"{value!r}: a path with whitespace, a quote or a backslash cannot travel in an override")
    return f"'{value}'"


# ---------------------------------------------------------------------------- the node's settings


@dataclass(frozen=True)
class RegionNode:
    """An aggregator's node config: where its regional SuperLink is and where sub-runs write."""

    connection: str  # region-superlink: a [superlink.<name>] of flwr_home's config.toml
    flwr_home: Path  # region-flwr-home
    output_dir: Path  # region-output-dir: the sub-runs' results, on a disk the regional executor shares
    overrides: str  # region-overrides: the region's own (its minimum sites, its waits), after the global run's
    timeout_s: float  # region-timeout-s: 0 = only the task's TTL
    name: str  # the node config's name (a directory-safe form), or node<id>

    @classmethod
    def of(cls, context: Context) -> RegionNode:
        """From the node config; a RegionFailed naming the key for a missing or unusable value."""
        cfg = context.node_config
        missing = [k for k in (REGION_SUPERLINK, REGION_FLWR_HOME, REGION_OUTPUT_DIR) if not str(cfg.get(k, ""))]
        if missing:
            raise RegionFailed(f"node {context.node_id}: an aggregator's node config needs {', '.join(missing)}")
        home, out = Path(str(cfg[REGION_FLWR_HOME])), Path(str(cfg[REGION_OUTPUT_DIR]))
        if not home.is_absolute() or not out.is_absolute():
            raise RegionFailed(f"node {context.node_id}: {REGION_FLWR_HOME} and {REGION_OUTPUT_DIR} must be absolute")
        if not (home / "config.toml").is_file():
            raise RegionFailed(f"node {context.node_id}: {REGION_FLWR_HOME}={home} has no config.toml")
        try:
            timeout = float(cfg.get(REGION_TIMEOUT_S, 0.0))
        except (TypeError, ValueError):
            timeout = -1.0
        if not timeout >= 0:
            raise RegionFailed(f"node {context.node_id}: {REGION_TIMEOUT_S} must be a number of seconds >= 0")
        name = re.sub(r"[^A-Za-z0-9._-]", "_", str(cfg.get(NAME, "") or "")) or f"node{context.node_id}"
        return cls(
            str(cfg[REGION_SUPERLINK]), home, out, str(cfg.get(REGION_OVERRIDES, "") or ""), timeout, name.lstrip(".")
        )


# ---------------------------------------------------------------------------- the sub-run


def _flwr() -> str:
    """This environment's `flwr` CLI (the one next to the interpreter), else the one on PATH."""
    here = Path(sys.executable).parent / "flwr"
    return str(here) if here.is_file() else "flwr"


def _json_answer(text: str) -> dict[str, Any]:
    """The JSON object of `flwr ... --format json` (Flower may print log lines before it)."""
    start = text.find("{")
    if start < 0:
        raise ValueError(f"no JSON answer in flwr's output: {text[-500:]!r}")
    return json.loads(text[start:])


class RegionalSuperLink:
    """The `flwr` CLI against the region's SuperLink, with the region's FLWR_HOME (its own CA)."""

    def __init__(self, node: RegionNode) -> None:
        self.node = node
        self.env = {**os.environ, "FLWR_HOME": str(node.flwr_home)}

    def cli(self, *args: str) -> dict[str, Any]:
        """One `flwr` command's JSON answer; RegionFailed when it fails or does not answer."""
        cmd = [_flwr(), *args, "--format", "json"]
        try:
            proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RegionFailed(
                f"`flwr {args[0]}` got no answer from {self.node.connection} in {CLI_TIMEOUT_S:.0f} s"
            ) from None
        try:
            return _json_answer(proc.stdout)
        except ValueError:
            raise RegionFailed(
                f"`flwr {args[0]}` on {self.node.connection} failed: {proc.stdout[-800:]} {proc.stderr[-800:]}"
            ) from None

    def submit(self, app_dir: Path, run_config: Path) -> int:
        answer = self.cli("run", str(app_dir), self.node.connection, "--run-config", str(run_config))
        if not answer.get("success") or answer.get("run-id") is None:
            why = " ".join(str(answer.get("error-message") or answer).split())
            raise RegionFailed(f"the sub-run could not be submitted to the regional SuperLink: {why}")
        return int(answer["run-id"])

    def status(self, run_id: int) -> dict[str, Any]:
        """The run's row of `flwr list` (status e.g. `finished:completed`, status-details)."""
        runs = self.cli("list", self.node.connection, "--run-id", str(run_id)).get("runs") or [{}]
        return runs[0]

    def wait(self, run_id: int, deadline: float) -> dict[str, Any]:
        """Poll Flower's verdict until the run finishes; at `deadline` stop it and fail."""
        while True:
            row = self.status(run_id)
            if str(row.get("status", "")).startswith("finished"):
                return row
            if time.monotonic() > deadline:
                with contextlib.suppress(RegionFailed):  # the failure below says what matters
                    self.cli("stop", str(run_id), self.node.connection)
                raise RegionFailed(f"sub-run {run_id} still {row.get('status')!r} at its deadline: stopped")
            time.sleep(POLL_S)


def deadline_of(msg: Message, node: RegionNode) -> float:
    """When the sub-run must be over (time.monotonic): the task's TTL less a margin, and the node's
    own `region-timeout-s`, whichever comes first."""
    meta = msg.metadata
    left = meta.created_at + meta.ttl - time.time() - TTL_MARGIN_S if meta.ttl else float("inf")
    if node.timeout_s:
        left = min(left, node.timeout_s)
    if left <= 0:
        raise RegionFailed(f"the task leaves no time for a sub-run (ttl {meta.ttl:.0f} s)")
    return time.monotonic() + left


def run_config_file(path: Path, overrides: str, output_dir: Path) -> Path:
    """The sub-run's run config as a TOML file: `--run-config 'k="v"'` cannot carry a value holding
    a double quote (Flower splits it with a regular expression); JSON strings are TOML strings."""
    path.write_text(f"overrides = {json.dumps(overrides)}\noutput-dir = {json.dumps(str(output_dir))}\n")
    return path


@dataclass(frozen=True)
class RegionResult:
    """What the sub-run left: the final model, its round's row and the region's weight."""

    state: dict[str, torch.Tensor]
    row: dict[str, Any]
    weight: float


def read_result(run_dir: Path) -> RegionResult:
    """The sub-run's summary.json, its one row of metrics.jsonl and model_final.pt; RegionFailed
    when the round left the model unchanged or the weight is not on record."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as err:
        raise RegionFailed(f"sub-run results in {run_dir} are unreadable: {err}") from None
    if summary.get("status") != "completed" or not rows:
        raise RegionFailed(f"sub-run {run_dir.name} ended {summary.get('status')!r} ({summary.get('stop_reason')})")
    row = rows[-1]
    if not row.get("model_updated"):
        raise RegionFailed(f"sub-run {run_dir.name}: its round left the model unchanged ({row.get('rejected')})")
    weight = (row.get("train") or {}).get(NUM_EXAMPLES)
    if not isinstance(weight, int | float) or not weight > 0:
        raise RegionFailed(
            f"sub-run {run_dir.name}: its row records no train[{NUM_EXAMPLES!r}] (privacy leaves exact "
            "statistics out of rows): the region's weight is unknown"
        )
    state = torch.load(run_dir / "model_final.pt", map_location="cpu", weights_only=True)
    return RegionResult(state, row, float(weight))


def reply_of(result: RegionResult, sent: dict[str, torch.Tensor]) -> tuple[ArrayRecord, dict[str, Any]]:
    """The reply: the sub-run's model on the keys the server sent (same shapes and dtypes), the
    region's weight, its sites, and the sites' mean training metrics as the sub-run recorded them."""
    arrays = {}
    for key, like in sent.items():
        got = result.state.get(key)
        if got is None or got.shape != like.shape:
            raise RegionFailed(f"the sub-run's model has no {key} of shape {tuple(like.shape)}")
        arrays[key] = got.to(like.dtype).contiguous()
    train = result.row.get("train") or {}
    metrics: dict[str, Any] = {
        k: v for k, v in train.items() if is_reply_metric(k) and k != NUM_EXAMPLES and isinstance(v, int | float)
    }
    metrics |= {
        NUM_EXAMPLES: result.weight,
        REGION_SAMPLED: int(result.row.get("num_sampled") or 0),
        REGION_NODES: int(result.row.get("num_clients") or 0),
    }
    return ArrayRecord(arrays), metrics


def region_update(msg: Message, context: Context) -> tuple[ArrayRecord, dict[str, Any]]:
    """The training task of an aggregator: the region's one-round sub-run from the received model;
    the reply's arrays and metrics. RegionFailed (an error reply) when the region has no update."""
    node = RegionNode.of(context)
    record = msg.content[CONFIG]
    if REGION_RUN_OVERRIDES not in record:
        raise RegionFailed(
            f"node {context.node_id} is a regional aggregator ({REGION_SUPERLINK} in its node config), but the "
            "global run is not two-level: submit it with topology=regions"
        )
    deadline = deadline_of(msg, node)
    sent = msg.content[ARRAYS].to_torch_state_dict()
    frozen = msg.content[FROZEN].to_torch_state_dict() if FROZEN in msg.content else {}
    name = f"{node.name}-run{msg.metadata.run_id}-round{int(record.get(SERVER_ROUND, 0))}-{msg.metadata.message_id[:8]}"
    init_dir = node.output_dir / INIT_DIR
    init_dir.mkdir(parents=True, exist_ok=True)
    init = init_dir / f"{name}.pt"
    torch.save({**frozen, **sent}, init)
    own = f"model.init_weights={quoted(str(init))} name={name} resume=null"
    overrides = merge_overrides(str(record[REGION_RUN_OVERRIDES]), node.overrides, own)
    link = RegionalSuperLink(node)
    app_dir = Path(__file__).resolve().parents[2]  # the app copy this ClientApp runs from: the same FAB
    run_id = link.submit(app_dir, run_config_file(init_dir / f"{name}.toml", overrides, node.output_dir))
    log.info("region %s: sub-run %d (%s) on %s: %s", node.name, run_id, name, node.connection, overrides)
    verdict = link.wait(run_id, deadline)
    if verdict.get("status") != "finished:completed":
        raise RegionFailed(f"sub-run {run_id} ({name}): {verdict.get('status')} {verdict.get('status-details', '')}")
    result = read_result(node.output_dir / name)
    arrays, metrics = reply_of(result, sent)
    log.info(
        "region %s: sub-run %d: %d of %d sites, weight %g",
        node.name,
        run_id,
        metrics[REGION_NODES],
        metrics[REGION_SAMPLED],
        result.weight,
    )
    return arrays, metrics

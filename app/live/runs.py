"""What the live page shows of each run, read from its results directory as it grows (or fed from
the MQTT status channel, app/live/feed.py): status, rows, per-node state, alerts.

Files are read incrementally: `metrics.jsonl` and `ledger.jsonl` from the byte offset reached
last time, at most READ_MAX bytes a poll, complete lines only (a row being written is kept and
finished by the next poll, never read again), so a long run costs a poll only its new rows, and
a huge or torn file costs a bounded read and bounded memory. A line longer than MAX_LINE is
skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app.status.alerts import AlertRules
from app.status.schema import exact_shown

log = logging.getLogger("flwr.fedgpu." + __name__)

ROW_KEYS = ("round", "loss", "wall_time_s", "epsilon", "bytes_up_total", "bytes_down_total", "num_clients")
MAX_ALERTS = 200  # the newest kept per run
MAX_NODES = 1000  # per run (`--max-nodes`): what a page message carries stays bounded
MAX_LINE = 16 * 2**20  # bytes in one row or ledger entry (a round of 1000 nodes is well under 1 MiB)
READ_MAX = 2 * MAX_LINE  # bytes read from one file in one poll


class Tail:
    """The complete new lines of a growing JSON-lines file. `offset`: the bytes read so far;
    `partial`: those of the last line, not yet ended; `skipped`: lines over MAX_LINE left out."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""
        self.skipping = False  # inside a line over MAX_LINE: what comes up to its end is dropped
        self.skipped = 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read(READ_MAX)
        except OSError:
            return []
        self.offset += len(data)
        *lines, rest = (self.partial + data).split(b"\n")
        if self.skipping and lines:  # the end of the long line
            self.skipping = False
            lines.pop(0)
        elif self.skipping:
            rest = b""
        out = []
        for line in lines:
            if len(line) > MAX_LINE:
                self._skip()
                continue
            try:
                out.append(json.loads(line))
            except (ValueError, RecursionError):
                continue  # a broken line is skipped, never fatal to the page
        if len(rest) > MAX_LINE:
            self._skip()
            self.skipping, rest = True, b""
        self.partial = rest
        return out

    def _skip(self) -> None:
        self.skipped += 1
        log.warning("live page: %s: a line longer than %d bytes skipped (%d so far)", self.path, MAX_LINE, self.skipped)


@dataclass
class NodeState:
    last_step: int | None = None
    last_seen: str | None = None  # the ledger entry's time, or a heartbeat's
    examples: float = 0.0
    applied: int = 0
    excluded: int = 0  # left out by the robust rule
    rejected: int = 0
    contribution: float | None = None
    heartbeat: str | None = None  # the node's last task state from the channel

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RunView:
    """One run as the page shows it."""

    name: str
    path: Path | None = None
    primary: str = "accuracy"
    unit: str = "round"
    planned: int | None = None
    strategy: str = ""
    status: str = "running"
    why: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    rules: AlertRules = field(default_factory=AlertRules)
    changed: float = field(default_factory=time.time)
    max_nodes: int = MAX_NODES
    nodes_left_out: int = 0  # updates of nodes past max_nodes
    _metrics: Tail | None = None
    _ledger: Tail | None = None

    @classmethod
    def of_dir(cls, path: Path) -> RunView:
        """A run directory: its config says the primary metric, the plan and the alert rules."""
        try:
            cfg = yaml.safe_load((path / "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            cfg = {}
        metrics = (cfg.get("task") or {}).get("metrics") or ["accuracy"]
        first = metrics[0]
        primary = first if isinstance(first, str) else str(first.get("name") or "metric")
        strategy = str((cfg.get("strategy") or {}).get("name", ""))
        unit = "version" if strategy == "fedbuff" else "round"
        view = cls(path.name, path, primary, unit, (cfg.get("federation") or {}).get("rounds"), strategy)
        if cfg.get("federation") and cfg.get("privacy"):
            view.rules = AlertRules.of_config(cfg, unit, primary)
        view._metrics = Tail(path / "metrics.jsonl")
        privacy = cfg.get("privacy") or {}
        if exact_shown(str(privacy.get("name", "none")), bool(privacy.get("report_exact"))):
            view._ledger = Tail(path / "ledger.jsonl")  # its per-node records are exact figures
        return view

    def add_row(self, row: dict[str, Any], alerts: bool = True) -> None:
        """A row as metrics.jsonl records it, and (`alerts`) the alerts it shows."""
        self.rows.append(row)
        if alerts:
            self.add_alerts(self.rules.of_row(row))
        for r in row.get("rejected") or []:  # a row's facts, where the ledger is off
            self.node(r.get("node_id"))

    def add_alerts(self, alerts: list[dict[str, Any]]) -> None:
        self.alerts = (self.alerts + alerts)[-MAX_ALERTS:]

    def node(self, node_id: Any) -> NodeState | None:  # noqa: ANN401
        """The node's state, new if need be; None (counted) for a new node past `max_nodes`."""
        key = str(node_id)
        if key not in self.nodes and len(self.nodes) >= self.max_nodes:
            self.nodes_left_out += 1
            return None
        return self.nodes.setdefault(key, NodeState())

    def add_entry(self, entry: dict[str, Any]) -> None:
        """A ledger entry: each node's last step, its examples, rejections and contribution."""
        for record in entry.get("nodes", []):
            if (state := self.node(record.get("node_id"))) is None:
                continue
            state.last_step, state.last_seen = entry.get("step"), entry.get("recorded_at")
            outcome = str(record.get("outcome", ""))
            if outcome == "applied":
                state.applied += 1
                state.examples += float(record.get("reported_examples") or 0.0)
            elif outcome.startswith("rejected"):
                state.rejected += 1
            elif outcome.startswith("excluded"):
                state.excluded += 1
            if isinstance(record.get("contribution"), int | float):
                state.contribution = (state.contribution or 0.0) + float(record["contribution"])

    def poll(self) -> bool:
        """Read what the run's files gained; whether anything did."""
        if self.path is None:
            return False
        grew = False
        for row in self._metrics.new() if self._metrics else []:
            self.add_row(row)
            grew = True
        for entry in self._ledger.new() if self._ledger else []:
            self.add_entry(entry)
            grew = True
        # a finished run's summary changes only when the run goes on (a resume), which adds rows first
        summary = _summary(self.path) if grew or self.status == "running" else None
        if summary is not None and summary.get("status") != self.status:
            self.status, self.why = str(summary.get("status")), summary.get("stop_reason")
            self.add_alerts(self.rules.of_end(self.rows[-1].get("round") if self.rows else None, self.why))
            grew = True
        if grew:
            self.changed = time.time()
        return grew

    def as_dict(self) -> dict[str, Any]:
        """What the page receives: the run, its rows (the chart's columns and the table's), its nodes."""
        last = self.rows[-1] if self.rows else {}
        return {
            "name": self.name,
            "status": self.status,
            "why": self.why,
            "strategy": self.strategy,
            "primary": self.primary,
            "unit": self.unit,
            "planned": self.planned,
            "step": last.get("round"),
            "metric": last.get(self.primary),
            "loss": last.get("loss"),
            "epsilon": last.get("epsilon"),
            "bytes": (last.get("bytes_up_total") or 0) + (last.get("bytes_down_total") or 0) or None,
            "rows": [{k: r.get(k) for k in (*ROW_KEYS, self.primary)} for r in self.rows],
            "nodes": {n: s.as_dict() for n, s in sorted(self.nodes.items())},
            "max_nodes": self.max_nodes,
            "nodes_left_out": self.nodes_left_out,
            "lines_skipped": sum(t.skipped for t in (self._metrics, self._ledger) if t is not None),
            "alerts": self.alerts[-50:],
            "changed": self.changed,
        }


def _summary(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def is_run_dir(path: Path) -> bool:
    """A results directory of a run: its resolved config (written before round 1) names a federation."""
    config = path / "config.yaml"
    try:
        return config.is_file() and "federation:" in config.read_text()
    except OSError:
        return False


def find_run_dirs(root: Path, depth: int = 3, known: frozenset[Path] = frozenset()) -> list[Path]:
    """`root` if it is a run, else the runs at most `depth` levels below it (sweep jobs included),
    hidden directories skipped; directories in `known` are taken as runs without reading them again."""
    root = Path(root)
    is_run = lambda d: d in known or is_run_dir(d)  # noqa: E731
    if is_run(root):
        return [root]
    found: list[Path] = []
    frontier = [root]
    for _ in range(depth):
        nxt = []
        for d in frontier:
            try:
                children = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                continue
            for child in children:
                (found if is_run(child) else nxt).append(child)
        frontier = nxt
    return found

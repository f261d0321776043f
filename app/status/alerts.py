"""The alerts a run's rows show (app/status/schema.py ALERTS): one set of rules for the status
channel's publisher (app/status/server.py) and the live page (app/live/), so both say the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.status.schema import NEARLY_SPENT


@dataclass
class AlertRules:
    """`target`: the value of `metric` that counts as reached (0: none); `max_epsilon`: the privacy
    budget (0: none). The once-only alerts (budget nearly spent, target reached) remember they fired."""

    unit: str = "round"
    metric: str = "accuracy"
    target: float = 0.0
    max_epsilon: float = 0.0
    nearly: bool = False
    reached: bool = False

    def of_row(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The alerts of one row as metrics.jsonl records it (without the fields every message has)."""
        step = row.get("round")
        out = [
            {"alert": "node_rejected", "step": step, "node": r.get("node_id"), "why": r.get("reason")}
            for r in row.get("rejected") or []
        ]
        out += [
            {"alert": "node_lost", "step": step, "node": n, "why": f"no reply within the {self.unit}'s timeout"}
            for n in row.get("missing") or []
        ]
        if row.get("model_updated") is False:
            why = "the model was not updated (too few valid replies, or an aborted round)"
            out.append({"alert": "round_skipped", "step": step, "why": why})
        epsilon = row.get("epsilon")
        if self.max_epsilon > 0 and isinstance(epsilon, int | float) and not self.nearly:
            if epsilon >= NEARLY_SPENT * self.max_epsilon:
                self.nearly = True
                out.append(
                    {"alert": "budget_nearly_spent", "step": step, "epsilon": epsilon, "max_epsilon": self.max_epsilon}
                )
        value = row.get(self.metric)
        if self.target > 0 and isinstance(value, int | float) and value >= self.target and not self.reached:
            self.reached = True
            out.append(
                {"alert": "target_reached", "step": step, "metric": self.metric, "value": value, "target": self.target}
            )
        return out

    def of_end(self, step: int | None, why: str | None) -> list[dict[str, Any]]:
        """The alert of a run's end: the privacy budget spent."""
        return [{"alert": "budget_spent", "step": step, "why": why}] if why and "budget" in why else []

    @classmethod
    def of_config(cls, cfg: Any, unit: str, primary: str) -> AlertRules:  # noqa: ANN401 - Config or its dict
        """The rules of a run's config (the dataclass, or config.yaml read as a dict)."""
        get = (
            (lambda section, key: cfg[section].get(key))
            if isinstance(cfg, dict)
            else (lambda section, key: getattr(getattr(cfg, section), key))
        )
        target_value = float(get("federation", "target_value") or 0.0)
        target = target_value if target_value > 0 else float(get("federation", "target_accuracy") or 0.0)
        metric = get("federation", "target_metric") or (primary if target_value > 0 else "accuracy")
        return cls(unit, str(metric), target, float(get("privacy", "max_epsilon") or 0.0))

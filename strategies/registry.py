"""The robust rules by the name a configuration gives them, and their too-few-replies policies.

Declared once, here: the config schema allows exactly these names (strategy.name,
strategy.buffer_aggregator), and the server builds a rule by looking its class up here
(`rule_class`) and calling its `from_config` with the strategy section. A new rule is its
module, one line below and its conf/strategy/<name>.yaml; nothing else names it. The
classes are given as import paths so that this module imports nothing: the schema, the
ClientApp and the command-line tools read the names without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

ROBUST_RULE_CLASSES = {
    "krum": "strategies.krum:KrumRule",
    "multikrum": "strategies.krum:MultiKrumRule",
    "median": "strategies.coordinatewise:MedianRule",
    "trimmed_mean": "strategies.coordinatewise:TrimmedMeanRule",
    "bulyan": "strategies.bulyan:BulyanRule",
}
ROBUST_RULES = tuple(ROBUST_RULE_CLASSES)  # strategy.name, strategy.buffer_aggregator
POLICIES = ("skip", "fallback")  # strategy.on_too_few


def rule_class(name: str) -> Any:  # noqa: ANN401 - a RobustRule subclass (importing it here would load torch)
    """The `RobustRule` subclass registered as `name` (a KeyError for any other: validation has
    checked the name against ROBUST_RULES before this is asked)."""
    module, cls = ROBUST_RULE_CLASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)

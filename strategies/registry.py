"""The names a configuration gives the robust rules and their too-few-replies policies.

Declared once, here: the config schema allows exactly these, `strategies.robust`
checks a rule's policy against them, and the server's strategy factory maps each rule
name to its class (`KrumRule` in `strategies.krum`, ...). This module imports nothing,
so the schema, the ClientApp and the command-line tools read the names without
loading torch or the aggregation code.
"""

from __future__ import annotations

ROBUST_RULES = ("krum", "multikrum", "median", "trimmed_mean")  # strategy.name, strategy.buffer_aggregator
POLICIES = ("skip", "fallback")  # strategy.on_too_few

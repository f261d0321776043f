"""Undo Opacus's one side effect on import.

`opacus/utils/module_utils.py` (Opacus 1.6) calls `logging.basicConfig` when it is
imported: the root logger gets a stderr handler, and every Flower log line is then
printed twice (once in Flower's format, once as `11/30/2026 14:23:11:INFO:...`).
Modules that import Opacus call `remove_opacus_root_handler()` right after.
"""

from __future__ import annotations

import logging

OPACUS_FORMAT = "%(asctime)s:%(levelname)s:%(message)s"


def remove_opacus_root_handler() -> None:
    """Remove the root handler Opacus's basicConfig added (and only that one)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and getattr(handler.formatter, "_fmt", None) == OPACUS_FORMAT:
            root.removeHandler(handler)

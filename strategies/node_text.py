"""Text a node supplies, made safe to log and store.

A node chooses its error replies' `reason` and its metric names. Written raw, a newline
in them forges a log line of the server's own, and a terminal escape sequence (ESC ...)
reaches whoever follows the log (the supervisor echoes it). Every such string passes
through `printable` before it is logged or stored: control and format characters
(Unicode category C: newlines, ESC, bidirectional overrides, ...) become their Python
escapes, and the text is cut to a bounded length. Pure standard library: the supervisor
imports it too.
"""

from __future__ import annotations

import unicodedata

MAX_NODE_TEXT = 500  # characters of a node's text kept; an error reason is a sentence, not a payload


def _escaped(ch: str) -> str:
    return ascii(ch)[1:-1] if unicodedata.category(ch)[0] == "C" else ch


def printable(text: object, limit: int | None = MAX_NODE_TEXT) -> str:
    """`text` with every control or format character escaped (a newline becomes the two
    characters backslash-n), cut to `limit` characters (None: no cut) with a note of the rest."""
    s = str(text)
    cut = s if limit is None or len(s) <= limit else s[:limit]
    out = "".join(_escaped(ch) for ch in cut)
    return out if cut is s else f"{out}... ({len(s) - limit} more characters)"


def is_plain(text: str) -> bool:
    """No character that `printable` would escape."""
    return not any(unicodedata.category(ch)[0] == "C" for ch in text)

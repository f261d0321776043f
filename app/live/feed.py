"""The live page's MQTT source (`--mqtt-host`): runs and nodes as the status channel reports them
(app/status/schema.py), for a server whose results directory is elsewhere.

A site's message is taken on trust for nothing. The broker's ACL (docker/monitoring/mosquitto.acl)
lets a login write only `<prefix>/nodes/<login>/<node>/tasks`; the feed takes such a heartbeat only
for a node that login may speak for (`NodeLogins`: the operator's `--node-logins` file), as
standard JSON (no NaN, Infinity or deep nesting) of at most MAX_HEARTBEAT bytes, never a retained
one, and stamps it with its own time of receipt (never the sender's: a time in the future would
freeze the node on the page). Each refusal is counted by its reason
(`counts()`, which the page shows) and logged once per login and reason; nothing a message holds
can end paho's network thread, which would end the feed without a word.

Messages arrive on paho's thread and wait in a queue; the page's loop applies them (`apply`)
between polls, so the run views are only ever touched by one thread.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.live.runs import RunView
from app.status.channel import Broker, paho_client
from app.status.schema import loads

log = logging.getLogger("flwr.fedgpu." + __name__)

MAX_HEARTBEAT = 64 * 1024  # bytes; a heartbeat is about 1 KB (app/status/node.py caps a failure's text)
NODE_ID = re.compile(r"[0-9]{1,20}")  # a Flower node id: a 64-bit integer
TEXT_CHARS = 32  # a heartbeat's `task` and `state`, as the page shows them
LOGGED_MAX = 1000  # (login, reason) pairs logged; later refusals are only counted

# Why a message was refused (the keys of `counts()`).
NOT_LISTED = "a login that --node-logins does not list"
NOT_OWNED = "a login speaking for a node it does not own"
NOT_JSON = "not strict JSON (NaN, Infinity, or nested too deeply)"
TOO_LARGE = f"a heartbeat over {MAX_HEARTBEAT} bytes"
BAD_TOPIC = "a topic that is not <prefix>/nodes/<login>/<node id>/tasks"
OTHER_NODE = "a payload naming another node than its topic"
RETAINED = "a retained heartbeat (a node never retains one)"
NOT_A_MESSAGE = "a payload that is not a status message of its topic"
BEHIND = "the page fell behind (its queue was full)"


class Refused(Exception):
    """A message the feed does not take; the argument is why (one of the reasons above)."""


@dataclass(frozen=True)
class NodeLogins:
    """The node ids each status-channel login may speak for; None: any node (one login that every
    site shares, as a simulation's or scripts/local_deployment.py's sites do). A login not listed
    speaks for no node."""

    nodes: dict[str, frozenset[str] | None] = field(default_factory=dict)

    def may(self, login: str, node: str) -> bool:
        if login not in self.nodes:
            return False
        allowed = self.nodes[login]
        return allowed is None or node in allowed

    @classmethod
    def read(cls, path: Path) -> NodeLogins:
        """A TOML file of `login = [node ids]` or `login = "*"` (any node); ValueError naming a bad entry."""
        nodes: dict[str, frozenset[str] | None] = {}
        for login, value in tomllib.loads(path.read_text()).items():
            if value == "*":
                nodes[login] = None
            elif isinstance(value, list) and all(_is_node_id(n) for n in value):
                nodes[login] = frozenset(str(n) for n in value)
            else:
                raise ValueError(f'{path}: {login} = {value!r}: give a list of node ids, or "*" for any node')
        return cls(nodes)


def _is_node_id(value: Any) -> bool:  # noqa: ANN401
    return isinstance(value, int | str) and not isinstance(value, bool) and NODE_ID.fullmatch(str(value)) is not None


@dataclass(frozen=True)
class Heartbeat:
    """A node's heartbeat as the page takes it; `received`: the page's clock (ISO, UTC)."""

    run: str
    node: str
    text: str
    step: int | None
    received: str


def _text(value: Any) -> str:  # noqa: ANN401
    if not isinstance(value, str) or not 0 < len(value) <= TEXT_CHARS or not value.isprintable():
        raise Refused(NOT_A_MESSAGE)
    return value


def heartbeat(node: str, body: Any, received: datetime) -> Heartbeat:  # noqa: ANN401
    """The parsed payload of node `node`'s topic, checked; Refused says why not."""
    if not isinstance(body, dict) or not isinstance(body.get("run"), str):
        raise Refused(NOT_A_MESSAGE)
    if "node" in body and str(body["node"]) != node:
        raise Refused(OTHER_NODE)
    step = body.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise Refused(NOT_A_MESSAGE)
    text = f"{_text(body.get('task'))} {_text(body.get('state'))}"
    return Heartbeat(body["run"], node, text, step, received.isoformat(timespec="milliseconds"))


class Feed:
    """A subscription to `<prefix>/#` on `broker`; heartbeats count for the nodes `logins` allows."""

    def __init__(self, broker: Broker, prefix: str = "fedgpu", logins: NodeLogins | None = None) -> None:
        self.prefix, self.logins = prefix, logins or NodeLogins()
        self.inbox: queue.Queue[tuple[list[str], dict[str, Any]] | Heartbeat] = queue.Queue(maxsize=100_000)
        self._refused: dict[str, int] = {}
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        client = paho_client(broker, "fedgpu-live")
        client.on_connect = lambda c, *_: c.subscribe(f"{prefix}/#", qos=1)
        client.on_message = self._on_message
        client.connect_async(broker.host, broker.port, keepalive=30)
        client.loop_start()
        self.client = client

    def read(self, topic: str, body: bytes, retain: bool) -> tuple[list[str], dict[str, Any]] | Heartbeat:
        """One message as the page's loop applies it; Refused says why not."""
        parts = topic.split("/")
        if len(parts) >= 2 and parts[1] == "nodes":
            if len(parts) != 5 or parts[4] != "tasks" or not NODE_ID.fullmatch(parts[3]):
                raise Refused(BAD_TOPIC)
            if retain:
                raise Refused(RETAINED)
            if parts[2] not in self.logins.nodes:
                raise Refused(NOT_LISTED)
            if not self.logins.may(parts[2], parts[3]):  # the broker vouches for the login level
                raise Refused(NOT_OWNED)
            if len(body) > MAX_HEARTBEAT:
                raise Refused(TOO_LARGE)
            return heartbeat(parts[3], _parsed(body), datetime.now(UTC))
        parsed = _parsed(body)  # a run's topics: only the server's login may write them
        if len(parts) != 4 or parts[1] != "runs" or not isinstance(parsed, dict):
            raise Refused(NOT_A_MESSAGE)
        if parts[3] == "rounds" and parsed.get("event") == "ended" and not isinstance(parsed.get("row"), dict):
            raise Refused(NOT_A_MESSAGE)
        return parts, parsed

    def _on_message(self, client, userdata, msg) -> None:  # noqa: ANN001, ARG002
        """paho's thread: every exception ends here, counted, so that thread (and the feed) lives."""
        try:
            self.inbox.put_nowait(self.read(msg.topic, msg.payload, bool(msg.retain)))
        except Refused as why:
            self._refuse(str(why), msg.topic)
        except queue.Full:  # the page's loop is behind: drop, never block paho's thread
            self._refuse(BEHIND, msg.topic)
        except Exception as err:  # noqa: BLE001 - a bug must not end the feed in silence either
            self._refuse(f"an error in the feed: {type(err).__name__}", msg.topic)

    def _refuse(self, why: str, topic: str) -> None:
        parts = topic.split("/")
        login = parts[2] if len(parts) > 3 and parts[1] == "nodes" else "?"
        with self._lock:
            self._refused[why] = self._refused.get(why, 0) + 1
            first = (login, why) not in self._logged and len(self._logged) < LOGGED_MAX
            if first:
                self._logged.add((login, why))
        if first:
            log.warning(
                "status channel: refused a message from login %s on %s: %s (further ones only counted)",
                login,
                topic[:200],
                why,
            )

    def counts(self) -> dict[str, int]:
        """Messages refused, by reason."""
        with self._lock:
            return dict(self._refused)

    def apply(self, views: dict[str, RunView], new_view: Callable[[str], RunView]) -> list[str]:
        """Put the waiting messages into `views` (a run seen only here gets `new_view(name)`); the
        names of the runs they changed."""
        changed: list[str] = []
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return changed
            name = self._heartbeat(views, item) if isinstance(item, Heartbeat) else self._run(views, new_view, *item)
            if name is None:
                continue
            views[name].changed = time.time()
            if name not in changed:
                changed.append(name)

    @staticmethod
    def _run(views: dict[str, RunView], new_view: Callable[[str], RunView], parts: list[str], body: dict) -> str | None:
        name = _key(views, str(body.get("run") or parts[2]))
        if name not in views:
            views[name] = new_view(name)
        view = views[name]
        if view.path is not None:  # its files say the same, and more exactly
            return None
        if parts[3] == "state":
            view.status, view.why = str(body.get("state")), body.get("why")
            view.strategy = str(body.get("strategy") or view.strategy)
            view.planned = body.get("steps") or view.planned
        elif parts[3] == "rounds" and body.get("event") == "ended":
            view.add_row(dict(body["row"]), alerts=False)  # the channel's own alerts follow
        elif parts[3] == "alerts":
            view.add_alerts([{k: v for k, v in body.items() if k not in ("v", "time", "run")}])
        else:
            return None
        return name

    @staticmethod
    def _heartbeat(views: dict[str, RunView], beat: Heartbeat) -> str | None:
        name = _key(views, beat.run)
        if name not in views or (state := views[name].node(beat.node)) is None:
            return None
        state.heartbeat, state.last_step, state.last_seen = beat.text, beat.step, beat.received
        return name

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _parsed(body: bytes) -> Any:  # noqa: ANN401
    try:
        return loads(body)
    except ValueError:  # UnicodeDecodeError included
        raise Refused(NOT_JSON) from None


def _key(views: dict[str, RunView], run: str) -> str:
    """The view of the run the channel calls `run` (its directory's name): a run found on disk below
    the root is keyed by its relative path."""
    if run in views:
        return run
    return next((key for key in views if key.rsplit("/", 1)[-1] == run), run)

"""The live page's MQTT source (`--mqtt-host`): runs and nodes as the status channel reports them
(app/status/schema.py), for a server whose results directory is elsewhere. Messages arrive on
paho's thread and wait in a queue; the page's loop applies them (`apply`) between polls, so the
run views are only ever touched by one thread."""

from __future__ import annotations

import json
import logging
import queue
import time
from typing import Any

from app.live.runs import RunView
from app.status.channel import Broker, paho_client

log = logging.getLogger("flwr.fedgpu." + __name__)


class Feed:
    """A subscription to `<prefix>/#` on `broker`."""

    def __init__(self, broker: Broker, prefix: str = "fedgpu") -> None:
        self.prefix = prefix
        self.inbox: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue(maxsize=100_000)
        client = paho_client(broker, "fedgpu-live")
        client.on_connect = lambda c, *_: c.subscribe(f"{prefix}/#", qos=1)
        client.on_message = self._on_message
        client.connect_async(broker.host, broker.port, keepalive=30)
        client.loop_start()
        self.client = client

    def _on_message(self, client, userdata, msg) -> None:  # noqa: ANN001, ARG002
        try:
            body = json.loads(msg.payload)
        except ValueError:
            return
        if isinstance(body, dict):
            try:
                self.inbox.put_nowait((msg.topic, body))
            except queue.Full:  # the page's loop is behind: drop, never block paho's thread
                pass

    def apply(self, views: dict[str, RunView]) -> list[str]:
        """Put the waiting messages into `views` (a run seen only here gets a view of its own);
        the names of the runs they changed."""
        changed: list[str] = []
        while True:
            try:
                topic, body = self.inbox.get_nowait()
            except queue.Empty:
                return changed
            parts = topic.split("/")
            if len(parts) == 4 and parts[1] == "runs":
                name = str(body.get("run") or parts[2])
                name = _key(views, name)
                view = views.setdefault(name, RunView(name))
                on_disk = view.path is not None  # its files say the same, and more exactly
                if parts[3] == "state" and not on_disk:
                    view.status, view.why = str(body.get("state")), body.get("why")
                    view.strategy = str(body.get("strategy") or view.strategy)
                    view.planned = body.get("steps") or view.planned
                elif parts[3] == "rounds" and body.get("event") == "ended" and not on_disk:
                    view.add_row(dict(body.get("row") or {}), alerts=False)  # the channel's own alerts follow
                elif parts[3] == "alerts" and not on_disk:
                    view.add_alerts([{k: v for k, v in body.items() if k not in ("v", "time", "run")}])
                else:
                    continue
            elif len(parts) == 4 and parts[1] == "nodes":
                name = _key(views, str(body.get("run", "")))
                if name not in views:
                    continue
                view = views[name]
                state = view.node(body.get("node", parts[2]))
                if state.last_seen is not None and str(body.get("time")) < str(state.last_seen):
                    continue  # an older message that arrived late (ISO times in UTC sort as strings)
                state.heartbeat = f"{body.get('task')} {body.get('state')}"
                state.last_seen, state.last_step = body.get("time"), body.get("step")
            else:
                continue
            view.changed = time.time()
            if name not in changed:
                changed.append(name)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _key(views: dict[str, RunView], run: str) -> str:
    """The view of the run the channel calls `run` (its directory's name): a run found on disk below
    the root is keyed by its relative path."""
    if run in views:
        return run
    return next((key for key in views if key.rsplit("/", 1)[-1] == run), run)

"""The live page's server: the page and its files over HTTP, the runs over a WebSocket, on one
loopback port (`websockets`: its HTTP hook serves the static files, so one library does both).

Every `interval` seconds it looks for new run directories under the root, reads what each run's
files gained (app/live/runs.py) and what the MQTT feed brought (app/live/feed.py), and sends the
runs that changed to every open page. A page that connects gets every run first.

Only pages served by this server may open the WebSocket (its Origin is checked): another site
open in the same browser cannot read the runs through it. It binds 127.0.0.1 only; to watch a
remote server, forward the port over SSH.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mimetypes
from pathlib import Path
from typing import Any

from websockets.asyncio.server import ServerConnection, broadcast, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from app.live.feed import Feed
from app.live.runs import RunView, find_run_dirs

log = logging.getLogger("flwr.fedgpu." + __name__)

STATIC = Path(__file__).parent / "static"
FILES = {p.name for p in STATIC.iterdir() if p.is_file()} if STATIC.is_dir() else set()


class LiveServer:
    """The runs under `root` (and those `feed` reports), served to pages on 127.0.0.1:`port`."""

    def __init__(self, root: Path, interval: float = 1.0, feed: Feed | None = None) -> None:
        self.root, self.interval, self.feed = Path(root), interval, feed
        self.views: dict[str, RunView] = {}
        self.clients: set[ServerConnection] = set()
        self.port = 0

    # --- the data ------------------------------------------------------------------------------
    def refresh(self) -> list[str]:
        """The names of the runs that changed: new directories found, files grown, feed messages."""
        changed = []
        known = frozenset(v.path for v in self.views.values() if v.path is not None)
        for path in find_run_dirs(self.root, known=known):  # only new directories' configs are read
            key = str(path.relative_to(self.root)) if path != self.root else path.name
            if key not in self.views:
                self.views[key] = RunView.of_dir(path)
                self.views[key].name = key
                changed.append(key)
        for key, view in self.views.items():
            if view.poll() and key not in changed:
                changed.append(key)
        if self.feed is not None:
            for key in self.feed.apply(self.views):
                if key not in changed:
                    changed.append(key)
        return changed

    def message(self, kind: str, names: list[str]) -> str:
        return json.dumps({"type": kind, "runs": [self.views[n].as_dict() for n in names]}, default=str)

    # --- the network ---------------------------------------------------------------------------
    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """Plain HTTP for the page and its files; None lets /ws go on to the WebSocket handshake."""
        path = request.path.split("?", 1)[0]
        if path == "/ws":
            return None
        name = "index.html" if path == "/" else path.removeprefix("/static/")
        if name not in FILES or (path != "/" and not path.startswith("/static/")):
            return connection.respond(404, "not found\n")
        body = (STATIC / name).read_bytes()
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        headers = Headers(
            [
                ("Content-Type", kind + ("; charset=utf-8" if kind.startswith("text/") else "")),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-store"),
                ("Content-Security-Policy", "default-src 'self'; connect-src 'self'; img-src 'self' data:"),
            ]
        )
        return Response(200, "OK", headers, body)

    async def handler(self, connection: ServerConnection) -> None:
        self.clients.add(connection)
        try:
            await connection.send(self.message("snapshot", sorted(self.views)))
            await connection.wait_closed()
        finally:
            self.clients.discard(connection)

    async def tick(self) -> None:
        while True:
            changed = self.refresh()
            if changed and self.clients:
                broadcast(self.clients, self.message("update", changed))
            await asyncio.sleep(self.interval)

    async def run(self, port: int, started: asyncio.Event | None = None) -> None:
        """Serve until cancelled; `port` 0 picks a free one (then in `self.port`)."""
        self.refresh()
        origins: list[Any] = []
        async with serve(
            self.handler,
            "127.0.0.1",
            port,
            process_request=self.process_request,
            origins=origins,
            max_size=2**16,  # pages send nothing; a large frame is not one of ours
        ) as server:
            self.port = server.sockets[0].getsockname()[1]
            # the page's own origins, once the port is known (the list is read per handshake)
            origins += [f"http://127.0.0.1:{self.port}", f"http://localhost:{self.port}"]
            log.info("live page: http://127.0.0.1:%d/ (runs under %s)", self.port, self.root)
            if started is not None:
                started.set()
            await self.tick()

"""The live page's server: the page and its files over HTTP, the runs over a WebSocket, on one
loopback port (`websockets`: its HTTP hook serves the static files, so one library does both).

Every `interval` seconds it looks for new run directories under the root, reads what each run's
files gained (app/live/runs.py) and what the MQTT feed brought (app/live/feed.py), and sends the
runs that changed to every open page. A page that connects gets every run first.

Every request, the page's files and the WebSocket alike, needs the random token the command prints
in the page's URL (as Jupyter does): in the query (`?token=`), then in the cookie the page sets, or
an `Authorization: token ...` header, compared in constant time. Any local user can reach the
loopback port and claim any Origin; only who was shown the URL has the token. The WebSocket
also checks its Origin, so another site open in the same browser cannot read the runs through it.
It binds 127.0.0.1 only; to watch a remote server, forward the port over SSH.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import mimetypes
import secrets
from http.cookies import CookieError, SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection, broadcast, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from app.live.feed import Feed
from app.live.runs import MAX_NODES, RunView, find_run_dirs
from app.status.schema import dumps

log = logging.getLogger("flwr.fedgpu." + __name__)

STATIC = Path(__file__).parent / "static"
FILES = {p.name for p in STATIC.iterdir() if p.is_file()} if STATIC.is_dir() else set()


class LiveServer:
    """The runs under `root` (and those `feed` reports), served to pages on 127.0.0.1:`port` that
    bring `token` (a fresh random one per server); each run shows at most `max_nodes` nodes."""

    def __init__(self, root: Path, interval: float = 1.0, feed: Feed | None = None, max_nodes: int = MAX_NODES) -> None:
        self.root, self.interval, self.feed, self.max_nodes = Path(root), interval, feed, max_nodes
        self.token = secrets.token_urlsafe(32)
        self.views: dict[str, RunView] = {}
        self.clients: set[ServerConnection] = set()
        self.port = 0

    def view(self, name: str, path: Path | None = None) -> RunView:
        """A new run's view: its directory's, or an empty one for a run known only from the feed."""
        view = RunView.of_dir(path) if path is not None else RunView(name)
        view.name, view.max_nodes = name, self.max_nodes
        return view

    # --- the data ------------------------------------------------------------------------------
    def refresh(self) -> list[str]:
        """The names of the runs that changed: new directories found, files grown, feed messages."""
        changed = []
        known = frozenset(v.path for v in self.views.values() if v.path is not None)
        for path in find_run_dirs(self.root, known=known):  # only new directories' configs are read
            key = str(path.relative_to(self.root)) if path != self.root else path.name
            if key not in self.views:
                self.views[key] = self.view(key, path)
                changed.append(key)
        for key, view in self.views.items():
            if view.poll() and key not in changed:
                changed.append(key)
        if self.feed is not None:
            for key in self.feed.apply(self.views, self.view):
                if key not in changed:
                    changed.append(key)
        return changed

    def message(self, kind: str, names: list[str]) -> str:
        """Standard JSON (a NaN in a row is null: the browser's JSON.parse refuses NaN)."""
        body: dict[str, Any] = {"type": kind, "runs": [self.views[n].as_dict() for n in names]}
        if self.feed is not None:
            body["channel"] = {"refused": self.feed.counts()}
        return dumps(body)

    # --- the network ---------------------------------------------------------------------------
    @property
    def cookie(self) -> str:
        """The token's cookie, named by the port: browsers share cookies between a host's ports."""
        return f"fedgpu-live-{self.port}"

    def authorized(self, request: Request) -> str | None:
        """Where the request brings the token (`query`, `header` or `cookie`); None if it does not."""
        given = [("query", v) for v in parse_qs(urlsplit(request.path).query).get("token", [])[:1]]
        given += [("header", v[6:]) for v in request.headers.get_all("Authorization") if v.startswith("token ")]
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load("; ".join(request.headers.get_all("Cookie")))
        except CookieError:
            pass
        if self.cookie in jar:
            given.append(("cookie", jar[self.cookie].value))
        expected = self.token.encode()
        return next((where for where, v in given if hmac.compare_digest(v.encode("utf-8", "replace"), expected)), None)

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """Plain HTTP for the page and its files; None lets /ws go on to the WebSocket handshake."""
        where = self.authorized(request)
        if where is None:
            return connection.respond(403, "the live page needs its token: open the URL the command printed\n")
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
        if where == "query":  # the page's files and its WebSocket then bring the token as this cookie
            headers["Set-Cookie"] = f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict"
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
            log.info("live page: http://127.0.0.1:%d/?token=%s (runs under %s)", self.port, self.token, self.root)
            if started is not None:
                started.set()
            await self.tick()

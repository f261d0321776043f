"""python -m app.live RUN_DIR_OR_ROOT [--port 8765] [--interval 1] [--max-nodes 1000] [--mqtt-host HOST ...]

Serves the live run page on http://127.0.0.1:PORT/?token=... until interrupted; the URL, with its
fresh random token, is printed at the start (docs/monitoring.md#the-live-run-page)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from app.live.feed import Feed, NodeLogins
from app.live.runs import MAX_NODES
from app.live.server import LiveServer
from app.status.channel import Broker


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.live", description=__doc__)
    parser.add_argument("root", type=Path, help="a run's results directory, or a root of runs (e.g. ~/fedgpu-runs)")
    parser.add_argument("--port", type=int, default=8765, help="on 127.0.0.1 (0: any free port)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between looks at the files")
    parser.add_argument("--max-nodes", type=int, default=MAX_NODES, help="nodes shown per run (more are counted)")
    mqtt = parser.add_argument_group("the MQTT status channel (optional): runs whose files are elsewhere")
    mqtt.add_argument("--mqtt-host")
    mqtt.add_argument("--mqtt-port", type=int, default=1883)
    mqtt.add_argument("--mqtt-ca", help="PEM CA certificate: TLS")
    mqtt.add_argument("--mqtt-username")
    mqtt.add_argument("--mqtt-password-file", type=Path)
    mqtt.add_argument("--topic-prefix", default="fedgpu")
    mqtt.add_argument(
        "--node-logins",
        type=Path,
        help='TOML: `login = [node ids]` (or "*": any node); a heartbeat counts only for a node its login may speak for',
    )
    args = parser.parse_args(argv)
    root = args.root.expanduser().resolve()
    if not root.is_dir():
        parser.error(f"{root} is not a directory (give a run's results directory or a root of runs)")
    if not args.interval > 0:
        parser.error("--interval must be > 0")
    if args.max_nodes < 1:
        parser.error("--max-nodes must be >= 1")
    try:
        logins = NodeLogins.read(args.node_logins) if args.node_logins else NodeLogins()
    except (OSError, ValueError) as err:
        parser.error(f"--node-logins: {err}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    feed = None
    if args.mqtt_host:
        password = args.mqtt_password_file.read_text().strip() if args.mqtt_password_file else None
        broker = Broker(
            args.mqtt_host, args.mqtt_port, ca_file=args.mqtt_ca, username=args.mqtt_username, password=password
        )
        feed = Feed(broker, args.topic_prefix, logins)
    server = LiveServer(root, args.interval, feed, args.max_nodes)
    try:
        asyncio.run(server.run(args.port))
    except KeyboardInterrupt:
        pass
    except OSError as err:
        print(f"live page: cannot serve on 127.0.0.1:{args.port} ({err}); pick another --port", file=sys.stderr)
        return 1
    finally:
        if feed is not None:
            feed.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

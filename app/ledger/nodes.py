"""Who a node id is: in a deployment with node authentication, the ledger names each node also by
its SuperNode's public key, as `ssh-keygen -lf node.pub` prints it (SHA256:base64 of the OpenSSH
key blob), so a site can find its own records without trusting the SuperLink's id assignment.

The key is what the SuperLink registered for the node (`flwr supernode register`), read through
the Grid (`grid.get_nodes()`: NodeInfo.public_key, PEM). In simulation and without node
authentication there is no key and records carry the node id alone.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

log = logging.getLogger("flwr.fedgpu." + __name__)


def key_fingerprint(public_key: bytes) -> str | None:
    """`SHA256:...` of a PEM (or OpenSSH) public key, as ssh-keygen prints it; None for no key or
    one that does not parse."""
    if not public_key:
        return None
    try:
        key = (
            serialization.load_ssh_public_key(public_key)
            if public_key.startswith(b"ecdsa-") or public_key.startswith(b"ssh-")
            else serialization.load_pem_public_key(public_key)
        )
        line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None
    blob = base64.b64decode(line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


class NodeKeys:
    """node id -> its key fingerprint (or None), asking the SuperLink only when an unseen id appears."""

    def __init__(self, nodes: Callable[[], Iterable[Any]]) -> None:
        self._nodes = nodes  # grid.get_nodes: NodeInfo-like objects with node_id and public_key
        self._known: dict[int, str | None] = {}

    def name(self, records: list[dict[str, Any]]) -> None:
        """Add `node_key` to every record whose node has a registered key."""
        if any(r["node_id"] not in self._known for r in records):
            try:
                infos = list(self._nodes())
            except Exception as err:  # noqa: BLE001 - naming is best effort; the run goes on
                log.warning("ledger: could not read the nodes' public keys from the SuperLink: %s", err)
                infos = []
            for info in infos:
                self._known[int(info.node_id)] = key_fingerprint(bytes(info.public_key))
            for r in records:  # ids the SuperLink no longer lists (a node gone since): no key
                self._known.setdefault(r["node_id"], None)
        for r in records:
            if (key := self._known[r["node_id"]]) is not None:
                r["node_key"] = key

"""Signed work records (`ledger.work_keys`): each training reply of a node that holds a work key
(node config `work-key`) carries a record of the work it did, signed with that key, which the server
checks against the site's registered public key before the reply may count, and keeps in the ledger
so that anyone with the public keys can check it again (`python -m app.ledger verify`) and a pool can
be settled from it (`python -m app.ledger settle`, app/ledger/settle.py).

The record (`fedgpu-work-v1`): the run (the ledger's run id, sent with the task), the step (round or
FedBuff version of the task) and task number, a nonce the server drew for this one task,
the node id, the examples and optimizer steps, wall and device seconds of the training, the sha256
of the reply's arrays as they cross the wire (`strategies.replies.arrays_digest`) and the key's
fingerprint. Signed with ECDSA P-384 / SHA-384 over `fedgpu-work-v1\\0` + its canonical JSON.

What the check proves, and what it assumes: the reply came from the holder of a registered key, for
this task of this run (the nonce is drawn by the server's CSPRNG and used once: a record replayed from
another run, round or task is refused), and its arrays are the ones signed. It does not prove that
the counts and seconds are true: a site signs its own claims. Settlement therefore pays on what the
server made of the reply (the weight the aggregation gave it, the contribution score), never on the
claimed seconds. The record's size is bounded before it is parsed (MAX_RECORD, MAX_SIGNATURE).
One key, one node: a key that signs for a second node id in a run is refused (two SuperNodes sharing
one site's key would otherwise both be paid as that site), across restarts too: a resumed run takes
each key's node and the used nonces up from its ledger (`WorkChecks.take_up`), as `verify` reads them.
One key, one site: a registry holding one public key under two site names is refused (the later file
would silently take the other site's records); that a site holds the private half of the key it
registers is the operator's check before registering (docs/ledger.md#registering-a-sites-key).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from app.ledger.signing import load_signing_key

FORMAT = "fedgpu-work-v1"
FIELDS = (
    "format", "run", "step", "task", "nonce", "node", "examples", "steps", "wall_s", "device_s", "arrays_sha256", "key"
)  # fmt: skip
PUBLIC_SUFFIX = ".work.pub"  # a registered site's public key: `<site>.work.pub` (scripts/credentials.py work-keys)
# A record is about 500 characters and its signature (DER, base64) under 150: anything longer is refused
# unread, so that a node's input never reaches the JSON parser at a size or depth it cannot take.
MAX_RECORD = 2048
MAX_SIGNATURE = 256


class WorkRecordError(ValueError):
    """A work record that must not count: the reason names what is wrong."""


def fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    """`sha256:<hex>` of the key's DER SubjectPublicKeyInfo: how a record names its key."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _message(record: dict[str, Any]) -> bytes:
    return FORMAT.encode() + b"\0" + json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def load_private_key(path: str | Path) -> ec.EllipticCurvePrivateKey:
    """The node's PEM private work key, or ValueError saying what is wrong with it."""
    return load_signing_key(path, "work-key", "work-keys")


def sign_work(key: ec.EllipticCurvePrivateKey, claims: dict[str, Any]) -> dict[str, str]:
    """The reply's `work` ConfigRecord: the record (canonical JSON) and its signature (base64)."""
    record = {"format": FORMAT, **claims, "key": fingerprint(key.public_key())}
    missing = set(FIELDS) - record.keys()
    if missing:
        raise ValueError(f"work record lacks {sorted(missing)}")
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    signature = key.sign(_message(record), ec.ECDSA(hashes.SHA384()))
    return {"record": body, "signature": base64.b64encode(signature).decode()}


def load_public_keys(directory: str | Path) -> dict[str, tuple[str, ec.EllipticCurvePublicKey]]:
    """The registered sites' keys in `directory` (`<site>.work.pub`, PEM): fingerprint -> (site, key).
    ValueError for a directory with none, a file that is not an ECDSA public key, or one key in two
    files (which site signs would be a matter of file order)."""
    found: dict[str, tuple[str, ec.EllipticCurvePublicKey]] = {}
    paths = sorted(Path(directory).glob(f"*{PUBLIC_SUFFIX}")) if Path(directory).is_dir() else []
    if not paths:
        raise ValueError(
            f"ledger.work_keys={directory}: no <site>{PUBLIC_SUFFIX} files there "
            "(python scripts/credentials.py work-keys --out DIR --names SITE ...)"
        )
    for path in paths:
        try:
            key = serialization.load_pem_public_key(path.read_bytes())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: not a PEM public key ({err})") from None
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise ValueError(f"{path}: not an ECDSA public key")
        site = path.name.removesuffix(PUBLIC_SUFFIX)
        if (earlier := found.get(fingerprint(key))) is not None:
            raise ValueError(
                f"{path.parent / (earlier[0] + PUBLIC_SUFFIX)} and {path} hold the same public key: one key "
                f"registers one site (a site registered another's public key?); keep the file of the site "
                "that proved it holds the private key (docs/ledger.md#registering-a-sites-key)"
            )
        found[fingerprint(key)] = (site, key)
    return found


def read_record(work: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """(the record, its signature) of a `work` ConfigRecord or a ledger entry's copy, parsed but not
    verified; WorkRecordError for anything unreadable: over the size limits, not base64, not a
    `fedgpu-work-v1` JSON object (nested too deep included)."""
    try:
        body, signature = str(work["record"]), str(work["signature"])
    except (KeyError, TypeError) as err:
        raise WorkRecordError(f"unreadable ({type(err).__name__})") from None
    if len(body) > MAX_RECORD or len(signature) > MAX_SIGNATURE:
        raise WorkRecordError(
            f"unreadable (record of {len(body)} characters, signature of {len(signature)}; "
            f"at most {MAX_RECORD} and {MAX_SIGNATURE})"
        )
    try:
        raw = base64.b64decode(signature, validate=True)
        record = json.loads(body)
    except (ValueError, RecursionError) as err:
        raise WorkRecordError(f"unreadable ({type(err).__name__})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or set(record) != set(FIELDS):
        raise WorkRecordError(f"not a {FORMAT} record")
    return record, raw


def open_record(work: dict[str, Any], keys: dict[str, tuple[str, ec.EllipticCurvePublicKey]]) -> dict[str, Any]:
    """The record in a `work` ConfigRecord (or a ledger entry's copy), if it is well formed, its key
    registered and its signature valid; else WorkRecordError naming why."""
    record, signature = read_record(work)
    if (known := keys.get(str(record["key"]))) is None:
        raise WorkRecordError(f"signed with an unregistered key {str(record['key'])[:23]}")
    try:
        known[1].verify(signature, _message(record), ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise WorkRecordError("the signature does not verify (forged, or a field was changed)") from None
    return record


@dataclass
class WorkChecks:
    """The server's side: a nonce per training task, and the check of each reply's record.

    One nonce per node at a time: a node has one training task open (a round's, or FedBuff's one in
    flight), so its record must sign the nonce of the last task it was sent; a record of an earlier
    task (a withheld reply replayed later) or of another run is refused. `required`: a reply without
    a record is refused (else it counts, unverified, and earns nothing in a settlement). Verified
    records wait in `verified` (by node) for the step's ledger entry. `bound` and `used` are what
    `verify` checks over the whole ledger (one node per key, each nonce once): a resumed run takes
    them up from the ledger it continues (`take_up`), or a key would sign for a second node after a
    restart and the whole ledger would fail `verify`."""

    keys: dict[str, tuple[str, ec.EllipticCurvePublicKey]]
    required: bool = True
    run: str = ""  # the ledger's run id, set when the ledger opens
    issued: dict[int, str] = field(default_factory=dict)  # node -> the nonce of its open task
    bound: dict[str, int] = field(default_factory=dict)  # key fingerprint -> the node it signed for
    used: set[str] = field(default_factory=set)  # nonces of verified records: never issued again
    verified: dict[int, dict[str, Any]] = field(default_factory=dict)  # node -> its record (for the ledger)

    def issue(self, node: int) -> str:
        """A fresh nonce for `node`'s next training task (its earlier one's is void from now)."""
        while (nonce := secrets.token_hex(16)) in self.used:
            pass  # 2^-128 per draw; a nonce is never issued twice all the same
        self.issued[node] = nonce
        return nonce

    def take_up(self, entries: list[dict[str, Any]]) -> None:
        """Continue after `entries` (a resumed run's ledger, cut back to its checkpoint): each key stays
        bound to the first node it signed for there, and their nonces stay used. The records were
        verified when they were taken; `verify` checks them again."""
        for _, node in signed_records(entries):
            try:
                record, _ = read_record(node["work"])
            except WorkRecordError:
                continue  # not one this server took: `verify` names it
            self.bound.setdefault(str(record["key"]), node.get("node_id"))
            self.used.add(str(record["nonce"]))

    def check(self, work: dict[str, Any] | None, node: int, arrays_sha256: str) -> dict[str, Any] | None:
        """The verified record of a reply of `node` whose arrays hash to `arrays_sha256`; None for a
        reply without one where none is required; WorkRecordError for anything that must not count."""
        if work is None:
            if self.required:
                raise WorkRecordError("missing (ledger.work_required)")
            return None
        record = open_record(work, self.keys)
        if record["run"] != self.run or record["nonce"] != self.issued.get(node):
            raise WorkRecordError("signs no open task of this node in this run (a replayed or foreign record)")
        if record["node"] != node:
            raise WorkRecordError(f"signs for node {record['node']}")
        if record["arrays_sha256"] != arrays_sha256:
            raise WorkRecordError("its arrays hash is not the reply's: the arrays were changed after signing")
        key = str(record["key"])
        if self.bound.setdefault(key, node) != node:
            raise WorkRecordError(f"{self.keys[key][0]}'s key already signs for node {self.bound[key]}")
        del self.issued[node]
        self.used.add(record["nonce"])
        self.verified[node] = {**work, "site": self.keys[key][0]}
        return record

    def take(self, node: int) -> dict[str, Any] | None:
        """The verified record of `node` since the last entry, for the ledger (then forgotten)."""
        return self.verified.pop(node, None)


def signed_records(entries: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(entry, node record) for every node record holding a work record, in ledger order."""
    for entry in entries:
        for node in entry.get("nodes", []):
            if "work" in node:
                yield entry, node


def check_entries(entries: list[dict[str, Any]], keys: dict[str, tuple[str, ec.EllipticCurvePublicKey]]) -> list[str]:
    """What is wrong with the work records a ledger holds (`python -m app.ledger verify`): each must
    verify with a registered key, name the entry's run and its node, sign the reply hash the entry
    records, and use its nonce once; one key signs for one node."""
    problems: list[str] = []
    nonces: set[str] = set()
    signer: dict[str, int] = {}
    for entry, node in signed_records(entries):
        where = f"entry {entry.get('step')}, node {node.get('node_id')}: work record"
        try:
            record = open_record(node["work"], keys)
        except WorkRecordError as err:
            problems.append(f"{where} {err}")
            continue
        if record["run"] != entry.get("run") or record["node"] != node.get("node_id"):
            problems.append(f"{where} signs run {record['run']}, node {record['node']}")
        if "reply_sha256" in node and record["arrays_sha256"] != node["reply_sha256"]:
            problems.append(f"{where} signs arrays {record['arrays_sha256'][:12]}, the entry records another reply")
        if record["nonce"] in nonces:
            problems.append(f"{where} reuses a nonce (a replayed record)")
        nonces.add(record["nonce"])
        if signer.setdefault(record["key"], node.get("node_id")) != node.get("node_id"):
            problems.append(f"{where} is signed by the key of node {signer[record['key']]}")
    return problems

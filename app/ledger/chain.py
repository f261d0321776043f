"""The contribution ledger: one hash-chained JSON entry per round (FedBuff: per version) in
`<run>/ledger.jsonl`, saying who was sent a task, what each reply was (its sha256), what became
of it and what it weighed, and which model went in and came out.

Every entry carries `prev`, the hash of the entry before it, and `hash`, the sha256 of its own
canonical JSON (sorted keys, no whitespace) without `hash`: changing any field of any entry,
removing one or reordering them breaks the chain at a place `verify_chain` names. The model
hashes tie the chain to the files the run leaves (`model_final.pt`, `checkpoint.pt`). What the
chain cannot prove: that the operator did not rewrite the whole file and every model file
together (sign the head hash, or hand it to the members, e.g. in each node's receipt); nor that
a site really trained on the data it claims.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric import ec

from app.ledger.signing import RUNNING, sign_head, utc_now

GENESIS = "0" * 64  # `prev` of a chain's first entry
LEDGER_FILE = "ledger.jsonl"
CONFIG_FILE = "config.yaml"  # the run's resolved config, as app/run/results.py saves it


def file_digest(path: Path) -> str | None:
    """sha256 of a file's bytes; None when there is no such file."""
    path = Path(path)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` through a temporary file in the same directory and os.replace:
    a crash leaves the old file or the new one, never a part of either."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def model_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 of a model over a canonical serialisation: keys sorted, each key, dtype, shape and
    raw little-endian bytes; the same for the same values whatever the device, dict order or
    memory layout."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().to("cpu").contiguous()
        h.update(f"{key}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def entry_hash(entry: Mapping[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != "hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Ledger:
    """Appends entries to `<run_dir>/ledger.jsonl`, continuing the chain a resumed run left."""

    def __init__(self, run_dir: Path, signing_key: ec.EllipticCurvePrivateKey | None = None) -> None:
        self.path = Path(run_dir) / LEDGER_FILE
        self.signing_key = signing_key  # signs the head after every entry (app/ledger/signing.py)
        self.config_sha256 = file_digest(Path(run_dir) / CONFIG_FILE)  # saved before the ledger opens
        self.run_id = uuid.uuid4().hex  # a new chain's; a resumed one keeps its own (_continue)
        self.head = GENESIS
        self.length = 0
        # node -> (step, entry hash, reply_sha256) of the entry that recorded its last reply
        self.receipts: dict[int, tuple[int, str, str]] = {}
        if self.path.exists():
            entries = read_entries(self.path)
            if (problem := verify_chain(entries)) is not None:
                raise ValueError(f"{self.path}: {problem}; refusing to extend a broken chain")
            self._continue(entries)

    def _continue(self, entries: list[dict[str, Any]]) -> None:
        """Take up the chain after `entries`: its run id, head, length and the nodes' latest receipts."""
        self.head, self.length, self.receipts = GENESIS, 0, {}
        self.run_id = next((e["run"] for e in entries if "run" in e), self.run_id)
        for entry in entries:
            self._advance(entry)

    def _advance(self, entry: dict[str, Any]) -> None:
        self.head, self.length = entry["hash"], self.length + 1
        for node in entry.get("nodes", []):
            if "reply_sha256" in node:  # the entry records a reply of this node: its next task says so
                self.receipts[node["node_id"]] = (entry["step"], entry["hash"], node["reply_sha256"])

    def truncate_after(self, step: int) -> None:
        """Drop entries past `step` (a resume re-runs the steps after its checkpoint), atomically,
        and sign the shorter head."""
        if not self.path.exists():
            return
        entries = read_entries(self.path)
        kept = [e for e in entries if e["step"] <= step]
        if len(kept) == len(entries):
            return
        write_atomically(self.path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in kept))
        self._continue(kept)
        self._sign(RUNNING)

    def append(self, entry: dict[str, Any]) -> str:
        """Chain `entry` (sets `run`, `config_sha256`, `recorded_at`, `prev` and `hash`), write it,
        sign the new head, and return its hash."""
        entry = {
            **entry,
            "run": self.run_id,
            "config_sha256": self.config_sha256,
            "recorded_at": utc_now(),
            "prev": self.head,
        }
        entry["hash"] = entry_hash(entry)
        with self.path.open("a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
        self._advance(entry)
        self._sign(RUNNING)
        return entry["hash"]

    def seal(self, status: str) -> None:
        """Sign the head as the run's last (`status`: completed, stopped, failed): a signature made
        while the run was going (`running`) then no longer passes for the end of the run."""
        self._sign(status)

    def _sign(self, status: str) -> None:
        if self.signing_key is not None:
            sign_head(
                self.signing_key,
                self.path.parent,
                head=self.head,
                entries=self.length,
                run=self.run_id,
                config_sha256=self.config_sha256,
                status=status,
            )


def read_entries(path: Path) -> list[dict[str, Any]]:
    """The entries of a ledger file; a line that is not a JSON object raises ValueError naming it."""
    entries = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as err:  # a line nested past the parser's depth too
            raise ValueError(f"line {number}: not JSON ({type(err).__name__}: {err})") from None
        if not isinstance(entry, dict):
            raise ValueError(f"line {number}: not a JSON object")
        entries.append(entry)
    return entries


def verify_chain(entries: list[dict[str, Any]]) -> str | None:
    """None when every entry hashes to its `hash` and links to the one before; else what broke first."""
    prev = GENESIS
    for number, entry in enumerate(entries, start=1):
        step = entry.get("step", "?")
        if entry.get("hash") != entry_hash(entry):
            return f"entry {number} (step {step}) was altered: its content no longer matches its hash"
        if entry.get("prev") != prev:
            return (
                f"entry {number} (step {step}) does not follow entry {number - 1}: an entry between them was "
                f"removed, entries were reordered, or entry {number - 1} was altered and re-hashed"
            )
        prev = entry["hash"]
    return None

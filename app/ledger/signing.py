"""The operator's signature over the ledger's head (`ledger.signing_key`): `<run>/ledger.sig`,
rewritten after every entry and sealed when the run ends, so whoever holds the public key can
check that the chain up to that head is the one the server's key vouched for. ECDSA P-384 with
SHA-384 (`cryptography`, already a Flower dependency); keys from
`python scripts/credentials.py ledger-key --out DIR`.

What is signed (`fedgpu-ledger-v2`, then the canonical JSON of the body without the signature):
the head hash and the entry count, the run's id and the sha256 of its `config.yaml` (so a
signature cannot be moved to another run or config), when it was signed, and the run's status:
`running` after each entry, the run's final status (`completed`, `stopped`, `failed`) once it
ends. An old signature over a ledger cut back to it says `running`, or is older than the
entries it should follow, and `verify --public-key` names it.
"""

from __future__ import annotations

import base64
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

SIGNATURE_FILE = "ledger.sig"
FORMAT = 2
RUNNING = "running"  # the status of a signature made after an entry, before the run ended


def utc_now() -> str:
    """The time now, UTC, ISO 8601 to the microsecond: what entries and signatures record."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def load_signing_key(
    path: str | Path, setting: str = "ledger.signing_key", made_by: str = "ledger-key"
) -> ec.EllipticCurvePrivateKey:
    """The PEM private key at `path` (the value of `setting`, made by `scripts/credentials.py
    made_by`), or ValueError saying what is wrong with it."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{setting}={path}: not a readable unencrypted PEM private key ({err})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{setting}={path}: expected an ECDSA key (scripts/credentials.py {made_by})")
    return key


def _message(body: dict[str, Any]) -> bytes:
    signed = {k: v for k, v in body.items() if k != "signature"}
    return b"fedgpu-ledger-v2\0" + json.dumps(signed, sort_keys=True, separators=(",", ":")).encode()


def sign_head(
    key: ec.EllipticCurvePrivateKey,
    run_dir: Path,
    *,
    head: str,
    entries: int,
    run: str,
    config_sha256: str | None,
    status: str = RUNNING,
) -> None:
    """Write `ledger.sig` for this head, entry count, run, config and status, signed now (a
    temporary file, then renamed)."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "run": run,
        "config_sha256": config_sha256,
        "entries": entries,
        "head": head,
        "signed_at": utc_now(),
        "status": status,
    }
    body["signature"] = base64.b64encode(key.sign(_message(body), ec.ECDSA(hashes.SHA384()))).decode()
    tmp = Path(run_dir) / f".{SIGNATURE_FILE}.tmp"
    tmp.write_text(json.dumps(body, sort_keys=True) + "\n")
    os.replace(tmp, Path(run_dir) / SIGNATURE_FILE)


def check_signature(
    run_dir: Path,
    public_key: Path,
    entries: list[dict[str, Any]],
    config_sha256: str | None,
    summary_status: str | None = None,
) -> list[str]:
    """What is wrong with `ledger.sig` for this chain (`entries`), the sha256 of the run's
    config.yaml now (`config_sha256`) and the status summary.json records; empty when it signs
    exactly them with the key at `public_key`, as the run's last signature."""
    path = Path(run_dir) / SIGNATURE_FILE
    if not path.exists():
        return [f"{SIGNATURE_FILE} is missing: the run was not signed (ledger.signing_key)"]
    try:
        key = serialization.load_pem_public_key(Path(public_key).read_bytes())
        body = json.loads(path.read_text())
        signature = base64.b64decode(body["signature"], validate=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"cannot read {SIGNATURE_FILE} or the public key ({err})"]
    if not isinstance(key, ec.EllipticCurvePublicKey):
        return [f"{public_key} is not an ECDSA public key"]
    if body.get("format") != FORMAT:
        return [
            f"{SIGNATURE_FILE} is in the old format: it signs only an entry count and a head, not the run, its "
            "config or the time, so it cannot show that the ledger was not cut back to an older head"
        ]
    try:
        key.verify(signature, _message(body), ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        return [
            f"{SIGNATURE_FILE}: the signature does not match this public key (forged, another key's, or a "
            "signed field was changed)"
        ]
    problems = []
    head = entries[-1]["hash"] if entries else None
    if body.get("head") != head or body.get("entries") != len(entries):
        problems.append(
            f"{SIGNATURE_FILE} signs {body.get('entries')} entries ending in {str(body.get('head'))[:12]}, "
            f"the ledger has {len(entries)}" + (f" ending in {head[:12]}" if head else "")
        )
    runs = {e["run"] for e in entries if "run" in e}
    if runs and body.get("run") not in runs:
        problems.append(f"{SIGNATURE_FILE} signs run {body.get('run')}, the ledger is run {', '.join(sorted(runs))}")
    recorded = entries[-1].get("config_sha256") if entries else None
    for what, digest in (("config.yaml", config_sha256), ("the last entry's config", recorded)):
        if digest is not None and body.get("config_sha256") != digest:
            problems.append(
                f"{SIGNATURE_FILE} signs config {str(body.get('config_sha256'))[:12]}, {what} hashes to "
                f"{digest[:12]}: the signature belongs to another config"
            )
    last_time = entries[-1].get("recorded_at") if entries else None
    if last_time is not None and str(body.get("signed_at")) < last_time:
        problems.append(
            f"{SIGNATURE_FILE} was signed at {body.get('signed_at')}, before the last entry (recorded "
            f"{last_time}): an old signature"
        )
    if body.get("status") == RUNNING:
        step = entries[-1].get("step") if entries else None
        problems.append(
            f"{SIGNATURE_FILE} was signed while the run was going (after step {step}, at {body.get('signed_at')}) "
            "and never sealed: the run has not ended, it crashed (resume it to seal the ledger), or entries "
            "after that step were cut"
        )
    elif summary_status is not None and body.get("status") != summary_status:
        problems.append(f"{SIGNATURE_FILE} seals the run as {body.get('status')}, summary.json says {summary_status}")
    return problems

"""The operator's signature over the ledger's head (`ledger.signing_key`): `<run>/ledger.sig`,
rewritten after every entry, so whoever holds the public key can check that the chain up to that
head is the one the server's key vouched for. ECDSA P-384 with SHA-384 (`cryptography`, already
a Flower dependency); keys from `python scripts/credentials.py ledger-key --out DIR`.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

SIGNATURE_FILE = "ledger.sig"


def load_signing_key(path: str | Path) -> ec.EllipticCurvePrivateKey:
    """The PEM private key at `path`, or ValueError saying what is wrong with it."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"ledger.signing_key={path}: not a readable unencrypted PEM private key ({err})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"ledger.signing_key={path}: expected an ECDSA key (scripts/credentials.py ledger-key)")
    return key


def _message(head: str, entries: int) -> bytes:
    return f"fedgpu-ledger\0{entries}\0{head}".encode()


def sign_head(key: ec.EllipticCurvePrivateKey, run_dir: Path, head: str, entries: int) -> None:
    """Write `ledger.sig` for this head and entry count (a temporary file, then renamed)."""
    signature = key.sign(_message(head, entries), ec.ECDSA(hashes.SHA384()))
    body = {"head": head, "entries": entries, "signature": base64.b64encode(signature).decode()}
    tmp = Path(run_dir) / f".{SIGNATURE_FILE}.tmp"
    tmp.write_text(json.dumps(body) + "\n")
    os.replace(tmp, Path(run_dir) / SIGNATURE_FILE)


def check_signature(run_dir: Path, public_key: Path, head: str | None, entries: int) -> str | None:
    """None when ledger.sig signs this head and count with the key at `public_key`; else why not."""
    path = Path(run_dir) / SIGNATURE_FILE
    if not path.exists():
        return f"{SIGNATURE_FILE} is missing: the run was not signed (ledger.signing_key)"
    try:
        key = serialization.load_pem_public_key(Path(public_key).read_bytes())
        body = json.loads(path.read_text())
        signature = base64.b64decode(body["signature"], validate=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"cannot read {SIGNATURE_FILE} or the public key ({err})"
    if not isinstance(key, ec.EllipticCurvePublicKey):
        return f"{public_key} is not an ECDSA public key"
    try:
        key.verify(signature, _message(str(body.get("head")), int(body.get("entries", -1))), ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        return f"{SIGNATURE_FILE}: the signature does not match this public key (forged, or another key's)"
    if body.get("head") != head or body.get("entries") != entries:
        return (
            f"{SIGNATURE_FILE} signs {body.get('entries')} entries ending in {str(body.get('head'))[:12]}, "
            f"the ledger has {entries}" + (f" ending in {head[:12]}" if head else "")
        )
    return None

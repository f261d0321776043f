"""Credentials for a secure deployment: a CA, the SuperLink's TLS certificate, SuperNode
key pairs and the `flwr` CLI's connection entry.

    python scripts/credentials.py tls --out certs --dns superlink.example.org --ip 203.0.113.7
    python scripts/credentials.py node-keys --out keys --names lab-a lab-b lab-c
    python scripts/credentials.py superexec-secret --out certs/superexec.secret
    python scripts/credentials.py ledger-key --out certs
    python scripts/credentials.py work-keys --out keys --names lab-a lab-b lab-c
    python scripts/credentials.py flwr-config --name cloud --address superlink.example.org:9092 \
        --root-certificates certs/ca.crt

`tls` writes `ca.crt` / `ca.key` (keep the key offline), `superlink.crt` /
`superlink.key` (for `flower-superlink --ssl-ca-certfile ca.crt --ssl-certfile
superlink.crt --ssl-keyfile superlink.key`); the certificate's subject alternative
names are exactly the DNS names and IPs given, which is what clients check. `node-keys`
writes ECDSA P-384 key pairs in OpenSSH format (`<name>` and `<name>.pub`), the kind
`flower-supernode --auth-supernode-private-key` loads and `flwr supernode register
<name>.pub <connection>` registers. `work-keys` writes each site's key for signing its work
records (`<name>.work.key`, node config `work-key`) and its public half (`<name>.work.pub`, which
the server's `ledger.work_keys` directory registers; docs/ledger.md#signed-work-records). `superexec-secret` writes the shared secret with
which the SuperLink (`--isolation process --superexec-auth-secret-file`) accepts only
its own `flower-superexec` on the Runtime API that shares the public port. `flwr-config` adds a `[superlink.<name>]` entry to
`$FLWR_HOME/config.toml` (default ~/.flwr) so that `flwr run . <name>` reaches it.

Written with `cryptography` (already a Flower dependency) rather than shell + openssl,
so it runs the same on every OS and is testable.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
import secrets
import subprocess
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 825  # the longest validity clients commonly accept for a server certificate


def _refuse_symlinks(*paths: Path) -> None:
    """Writing through a symlink would put a key or certificate wherever it points (say, a
    file another user can read); checked for a whole set before any of it is written."""
    for path in paths:
        if path.is_symlink():
            raise ValueError(
                f"{path} is a symbolic link (to {os.readlink(path)}): refusing to write through it; "
                "remove the link or choose another --out"
            )


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write `path` atomically: a new file beside it, created with its final mode (0600 for
    keys and secrets, so no other user can ever open it) and O_EXCL|O_NOFOLLOW (nothing
    planted at that name is opened), then renamed over `path`: a link planted after the
    check is replaced, not followed, and no reader ever sees a half-written key."""
    _refuse_symlinks(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if private else 0o644)
    try:
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_tls(out: Path, dns: Sequence[str], ips: Sequence[str], days: int = VALID_DAYS) -> dict[str, Path]:
    """A fresh CA and a SuperLink certificate signed by it, for the given DNS names and IPs."""
    if not dns and not ips:
        raise ValueError("give the SuperLink's DNS names (--dns) and/or IP addresses (--ip): clients check them")
    addresses = [ipaddress.ip_address(ip) for ip in ips]  # ValueError names a malformed address
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("fedgpu federation CA"))
        .issuer_name(_name("fedgpu federation CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(ca_key, hashes.SHA384())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns] + [x509.IPAddress(a) for a in addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(dns[0] if dns else ips[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    paths = {
        "ca_cert": out / "ca.crt",
        "ca_key": out / "ca.key",
        "cert": out / "superlink.crt",
        "key": out / "superlink.key",
    }
    _refuse_symlinks(*paths.values())
    _write(paths["ca_cert"], ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(paths["ca_key"], _pem_key(ca_key), private=True)
    _write(paths["cert"], cert.public_bytes(serialization.Encoding.PEM))
    _write(paths["key"], _pem_key(key), private=True)
    return paths


def make_node_keys(out: Path, names: Sequence[str]) -> list[tuple[Path, Path]]:
    """ECDSA P-384 key pairs in OpenSSH format, one per SuperNode: (private, public) paths."""
    pairs = []
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise ValueError(f"node name {name!r}: use letters, digits, '.', '_' or '-' (it becomes a file name)")
        key = ec.generate_private_key(ec.SECP384R1())
        private = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        priv_path, pub_path = out / name, out / f"{name}.pub"
        _refuse_symlinks(priv_path, pub_path)
        _write(priv_path, private, private=True)
        _write(pub_path, public + f" {name}\n".encode())
        pairs.append((priv_path, pub_path))
    return pairs


def make_ledger_key(out: Path) -> tuple[Path, Path]:
    """An ECDSA P-384 key pair in PEM for signing the contribution ledger's head: `ledger.key`
    (the ServerApp's `ledger.signing_key`) and `ledger.pub` (for `python -m app.ledger verify
    --public-key`, handed to the members)."""
    private_path, public_path = out / "ledger.key", out / "ledger.pub"
    _refuse_symlinks(private_path, public_path)
    key = ec.generate_private_key(ec.SECP384R1())
    _write(private_path, _pem_key(key), private=True)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    _write(public_path, public)
    return private_path, public_path


def make_work_keys(out: Path, names: Sequence[str]) -> list[tuple[Path, Path]]:
    """ECDSA P-384 key pairs in PEM that sites sign their work records with: (`<name>.work.key`,
    `<name>.work.pub`) per name. Separate from the SuperNode's key: that one authenticates the
    node to the SuperLink, this one signs what the site is paid for, and either can be replaced
    without the other."""
    pairs = []
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise ValueError(f"site name {name!r}: use letters, digits, '.', '_' or '-' (it becomes a file name)")
        private_path, public_path = out / f"{name}.work.key", out / f"{name}.work.pub"
        _refuse_symlinks(private_path, public_path)
        key = ec.generate_private_key(ec.SECP384R1())
        _write(private_path, _pem_key(key), private=True)
        public = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        _write(public_path, public)
        pairs.append((private_path, public_path))
    return pairs


def make_superexec_secret(path: Path) -> Path:
    """32 random bytes, hex-encoded (Flower reads the file as raw bytes: any content works,
    text survives copy and paste between hosts), readable by the owner only. An existing
    secret is kept: the SuperLink and its SuperExec must keep agreeing after a re-run. A
    symlink is refused, dangling or not: a secret must not be created or read elsewhere."""
    _refuse_symlinks(path)
    if not path.exists():
        _write(path, secrets.token_hex(32).encode(), private=True)
    return path


def write_flwr_config(name: str, address: str, root_certificates: Path | None, flwr_home: Path) -> Path:
    """Add (or replace) `[superlink.<name>]` in `flwr_home/config.toml`."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"connection name {name!r}: use letters, digits, '_' or '-'")
    if not re.fullmatch(r"\[?[^\s\[\]]+\]?:\d+", address):
        raise ValueError(f"address {address!r}: expected HOST:PORT, e.g. superlink.example.org:9092")
    lines = [f"[superlink.{name}]", f'address = "{address}"']
    if root_certificates is None:
        lines.append("insecure = true")
    else:
        if not root_certificates.is_file():
            raise ValueError(f"root certificates {root_certificates} do not exist")
        lines.append(f'root-certificates = "{root_certificates.resolve()}"')
    entry = "\n".join(lines) + "\n"
    path = flwr_home / "config.toml"
    text = path.read_text() if path.exists() else ""
    # Drop an existing entry of the same name (up to the next table header).
    text = re.sub(rf"(?ms)^\[superlink\.{re.escape(name)}\]\n.*?(?=^\[|\Z)", "", text).rstrip()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((text + "\n\n" if text else "") + entry)
    return path


def refuse_work_tree(out: Path) -> None:
    """ValueError when `out` lies inside a git work tree and git does not ignore it: keys written
    there end up in a commit. An ignored path (docker/creds/, /creds/ here) is fine."""
    out = Path(out).expanduser().absolute()
    top = next((d for d in (out, *out.parents) if (d / ".git").exists()), None)
    if top is None:
        return
    try:  # `out`, or a file in it (a pattern like /creds/ matches only once the directory exists)
        ignored = any(
            subprocess.run(["git", "-C", str(top), "check-ignore", "-q", str(p)], check=False).returncode == 0
            for p in (out, out / "key")
        )
    except OSError:  # no git to ask: assume the worst
        ignored = False
    if not ignored:
        raise ValueError(
            f"--out {out} is inside the git work tree {top} and git does not ignore it: private keys there end "
            "up in a commit. Write them outside the repository, add the path to .gitignore, or pass --allow-in-repo"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    tls = sub.add_parser("tls", help="a CA and the SuperLink's certificate")
    tls.add_argument("--out", type=Path, required=True)
    tls.add_argument("--dns", nargs="*", default=[], help="the SuperLink's DNS names")
    tls.add_argument("--ip", nargs="*", default=[], help="the SuperLink's IP addresses")
    tls.add_argument("--days", type=int, default=VALID_DAYS)
    keys = sub.add_parser("node-keys", help="ECDSA P-384 key pairs for SuperNodes")
    keys.add_argument("--out", type=Path, required=True)
    keys.add_argument("--names", nargs="+", required=True)
    work = sub.add_parser("work-keys", help="ECDSA P-384 key pairs with which sites sign their work records")
    work.add_argument("--out", type=Path, required=True)
    work.add_argument("--names", nargs="+", required=True)
    ledger = sub.add_parser("ledger-key", help="the key pair that signs the contribution ledger")
    ledger.add_argument("--out", type=Path, required=True)
    secret = sub.add_parser("superexec-secret", help="the SuperLink <-> SuperExec shared secret")
    secret.add_argument("--out", type=Path, required=True, help="file to write (kept if it exists)")
    cfg = sub.add_parser("flwr-config", help="a [superlink.<name>] entry for the flwr CLI")
    cfg.add_argument("--name", required=True)
    cfg.add_argument("--address", required=True, help="HOST:PORT of the SuperLink")
    cfg.add_argument("--root-certificates", type=Path, default=None, help="the CA certificate (omit: insecure)")
    cfg.add_argument("--flwr-home", type=Path, default=Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr")))
    for writer in (tls, keys, work, ledger, secret):
        writer.add_argument(
            "--allow-in-repo", action="store_true", help="write into a git work tree even if not ignored"
        )
    args = parser.parse_args(argv)
    try:
        if args.command != "flwr-config" and not args.allow_in_repo:
            refuse_work_tree(args.out)
        if args.command == "tls":
            for what, path in make_tls(args.out, args.dns, args.ip, args.days).items():
                print(f"{what}: {path}")
        elif args.command == "node-keys":
            for private, public in make_node_keys(args.out, args.names):
                print(f"{private} (private: only for that SuperNode)  {public} (register it)")
        elif args.command == "work-keys":
            for private, public in make_work_keys(args.out, args.names):
                print(f"{private} (private: that site's node config work-key)  {public} (into ledger.work_keys)")
        elif args.command == "ledger-key":
            private, public = make_ledger_key(args.out)
            print(f"{private} (private: the ServerApp's ledger.signing_key)  {public} (give it to the members)")
        elif args.command == "superexec-secret":
            print(make_superexec_secret(args.out))
        else:
            print(write_flwr_config(args.name, args.address, args.root_certificates, args.flwr_home))
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()

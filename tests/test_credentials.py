"""scripts/credentials.py: the CA, the SuperLink certificate, SuperNode keys and the CLI entry."""

from __future__ import annotations

import ipaddress
import os
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_ssh_private_key
from cryptography.hazmat.primitives.serialization.ssh import load_ssh_public_key

from tests.helpers import load_script

credentials = load_script("credentials")


def test_superlink_certificate_is_signed_by_the_ca_for_exactly_the_given_names(tmp_path):
    paths = credentials.make_tls(tmp_path, ["superlink.example.org", "localhost"], ["203.0.113.7", "::1"])
    ca = x509.load_pem_x509_certificate(paths["ca_cert"].read_bytes())
    cert = x509.load_pem_x509_certificate(paths["cert"].read_bytes())
    cert.verify_directly_issued_by(ca)  # raises if the signature or issuer is wrong
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["superlink.example.org", "localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("203.0.113.7"),
        ipaddress.ip_address("::1"),
    ]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = load_pem_private_key(paths["key"].read_bytes(), password=None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    assert paths["key"].stat().st_mode & 0o077 == 0 and paths["ca_key"].stat().st_mode & 0o077 == 0


def test_node_keys_are_p384_openssh_pairs_flower_can_load(tmp_path):
    (private, public), _ = credentials.make_node_keys(tmp_path, ["lab-a", "lab-b"])
    key = load_ssh_private_key(private.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    pub = load_ssh_public_key(public.read_bytes())
    assert pub.public_numbers() == key.public_key().public_numbers()
    assert public.read_text().startswith("ecdsa-sha2-nistp384 ") and private.stat().st_mode & 0o077 == 0


def test_superexec_secret_is_private_random_and_kept(tmp_path):
    from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret

    path = credentials.make_superexec_secret(tmp_path / "superexec.secret")
    secret = load_superexec_auth_secret(str(path))  # as the SuperLink and the SuperExec read it
    assert len(secret) == 64 and int(secret, 16) and path.stat().st_mode & 0o777 == 0o600
    credentials.make_superexec_secret(path)  # a re-run keeps it: both sides must still agree
    assert path.read_bytes() == secret
    assert credentials.make_superexec_secret(tmp_path / "other").read_bytes() != secret


def test_flwr_config_entry_is_added_and_replaced(tmp_path):
    ca = credentials.make_tls(tmp_path / "certs", ["localhost"], [])["ca_cert"]
    home = tmp_path / "home"
    (home).mkdir()
    (home / "config.toml").write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    credentials.write_flwr_config("cloud", "old.example.org:9092", None, home)
    path = credentials.write_flwr_config("cloud", "superlink.example.org:9092", ca, home)
    import tomllib

    config = tomllib.loads(path.read_text())
    assert config["superlink"]["local"]["address"] == ":local:"  # other entries untouched
    assert config["superlink"]["cloud"] == {
        "address": "superlink.example.org:9092",
        "root-certificates": str(ca.resolve()),
    }


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p: credentials.make_tls(p, [], []), "DNS names"),
        (lambda p: credentials.make_tls(p, ["x"], ["999.1.1.1"]), "999.1.1.1"),
        (lambda p: credentials.make_node_keys(p, ["../evil"]), "node name"),
        (lambda p: credentials.write_flwr_config("cloud", "no-port", None, p), "HOST:PORT"),
        (lambda p: credentials.write_flwr_config("cloud", "h:1", p / "missing.crt", p), "do not exist"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, call, match):
    with pytest.raises(ValueError, match=match):
        call(tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "write, planted",
    [
        (lambda out: credentials.make_tls(out, ["localhost"], []), "ca.key"),
        (lambda out: credentials.make_node_keys(out, ["lab-a"]), "lab-a"),
        (lambda out: credentials.make_superexec_secret(out / "superexec.secret"), "superexec.secret"),
    ],
    ids=["tls", "node-keys", "superexec-secret"],
)
@pytest.mark.parametrize("target_exists", [True, False], ids=["to-a-file", "dangling"])
def test_a_symlink_where_a_file_goes_is_refused_and_its_target_untouched(tmp_path, write, planted, target_exists):
    """Following a planted link would write a private key wherever it points (or, dangling,
    create a file there); nothing of the set is written."""
    out, target = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    if target_exists:
        target.write_text("precious")
    (out / planted).symlink_to(target)
    with pytest.raises(ValueError, match="is a symbolic link"):
        write(out)
    assert (target.read_text() == "precious") if target_exists else not target.exists()
    assert [p.name for p in out.iterdir()] == [planted]


def test_private_files_are_0600_from_creation(tmp_path, monkeypatch):
    """No moment where another user can open a key: created with mode 0600 and O_EXCL|
    O_NOFOLLOW even under umask 0, and never chmod-ed afterwards (a chmod would mean it was
    readable in between); a re-run replaces the set the same way."""
    created = {}
    real_open = os.open

    def spy_open(path, flags, mode=0o777, *args, **kwargs):
        fd = real_open(path, flags, mode, *args, **kwargs)
        created[os.path.basename(path)] = (flags, stat.S_IMODE(os.fstat(fd).st_mode))
        return fd

    def no_chmod(*args, **kwargs):
        raise AssertionError("chmod after creation: the file was readable in between")

    monkeypatch.setattr(os, "open", spy_open)
    for name in ("chmod", "fchmod", "lchmod"):
        monkeypatch.setattr(os, name, no_chmod, raising=False)
    monkeypatch.setattr(Path, "chmod", no_chmod)
    old_umask = os.umask(0)
    try:
        tls = credentials.make_tls(tmp_path, ["localhost"], [])
        ((node_key, _),) = credentials.make_node_keys(tmp_path, ["lab-a"])
        secret = credentials.make_superexec_secret(tmp_path / "superexec.secret")
        first_key = tls["key"].read_bytes()
        credentials.make_tls(tmp_path, ["localhost"], [])  # replaces the set
    finally:
        os.umask(old_umask)
    exclusive = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    for path in (tls["key"], tls["ca_key"], node_key, secret):
        opened = [v for k, v in created.items() if k.rsplit(".", 2)[0] == f".{path.name}"]  # .<name>.<hex>.tmp
        assert opened and all(flags & exclusive == exclusive and mode == 0o600 for flags, mode in opened), path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert tls["key"].read_bytes() != first_key
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_keys_are_not_written_into_a_git_work_tree_unless_ignored_or_allowed(tmp_path, capsys):
    repo = tmp_path / "checkout"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    with pytest.raises(SystemExit):
        credentials.main(["node-keys", "--out", str(repo / "keys"), "--names", "lab-a"])
    assert "inside the git work tree" in capsys.readouterr().err and not (repo / "keys").exists()
    credentials.main(["node-keys", "--out", str(repo / "keys"), "--names", "lab-a", "--allow-in-repo"])
    assert (repo / "keys" / "lab-a").is_file()
    (repo / ".gitignore").write_text("/creds/\n")
    credentials.main(["tls", "--out", str(repo / "creds"), "--dns", "localhost"])  # ignored: fine
    assert (repo / "creds" / "ca.crt").is_file()
    credentials.main(["ledger-key", "--out", str(tmp_path / "outside")])  # outside any work tree
    assert (tmp_path / "outside" / "ledger.key").is_file()


def test_this_checkout_ignores_what_the_deployment_docs_create():
    root = Path(__file__).resolve().parents[1]
    for path in ("creds/ca.key", "creds/keys/lab-a", "state.db", "state.db-wal", "docker/creds/superlink.key"):
        ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", path], check=False)
        assert ignored.returncode == 0, f"{path} is not git-ignored"

"""A node's side of SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", https://eprint.iacr.org/2020/704): four stages, one message each.

1. `advertise` (query.secagg_keys): two fresh ECDH key pairs (P-384), the public halves sent:
   c for encrypting shares, s for the pairwise masks.
2. `share` (query.secagg_shares): a fresh self-mask seed b; Shamir shares (threshold t) of b
   and of the mask key's scalar s_sk, one per neighbour (and one kept), each encrypted for its
   neighbour; a digest of b and a hash of every share (`share_hash`): the commitments the
   server checks revealed shares against.
3. `mask` (train.secagg): the neighbours' shares decrypted and checked against their owners'
   hashes (which the server forwards); a share that does not open is not kept, and the reply
   names its sender with a proof (`channel_proof`) the server checks. After training, the ring
   vector plus PRG(b) plus, for each neighbour j, +-PRG(ECDH(s_sk, s_pk_j)) (+ when this node's
   id is larger): every pairwise mask cancels in the sum of two nodes that both sent.
4. `reveal` (query.secagg_unmask): for each node the server names as having sent its masked
   input, this node's share of its b; for each named as dropped, its share of its s_sk. Never
   both for one node, and only once per round: a server that asks twice, names a node both
   ways, or names fewer than t could otherwise unmask a single input, so such a request is
   refused (the round then aborts on the server, revealing nothing).

The building blocks are Flower's (`flwr.common.secure_aggregation`: Shamir shares over
pycryptodome, ECDH + HKDF key agreement, Fernet encryption) except the mask generator
(`prg.py`: Flower's folds seeds to 32 bits). Keys, seeds and shares live in the node's Context
state between stages, and are fresh every round.

Every field a stage carries has one type and one size (the constants below), so the server
checks each before use (`ids_field`, `bytes_field`, `bytes_list_field`): a node cannot make it
allocate, parse or combine more than a well-formed reply holds.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from Crypto.PublicKey import ECC
from Crypto.PublicKey.ECC import EccPoint
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.app import ConfigRecord, Context
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)

from app.secagg import prg

STATE = "secagg-state"  # ConfigRecord in context.state: this node's side of the round in progress
# stages, in order: what a node has done last
ADVERTISED, SHARED, MASKED, REVEALED = "advertised", "shared", "masked", "revealed"


def share_bytes(secret: int) -> int:
    """The size of one of Flower's Shamir shares of a `secret`-byte secret: a 4-byte index, then
    16 bytes per block of the PKCS#7-padded secret (`create_shares`)."""
    return 4 + 16 * (secret // 16 + 1)


def fernet_bytes(plain: int) -> int:
    """The size of a Fernet token of `plain` bytes: base64 of version, time, IV, the padded
    AES-CBC blocks and the HMAC."""
    return 4 * -(-(1 + 8 + 16 + 16 * (plain // 16 + 1) + 32) // 3)


SEED_BYTES = 32  # b, the self mask's seed
SCALAR_BYTES = 48  # a P-384 private key's scalar: what is shared of s_sk
DIGEST_BYTES = 32  # sha256: the seed digest and each share's hash
PUBLIC_KEY_BYTES = 215  # a P-384 SubjectPublicKeyInfo in PEM (uncompressed point), the only form taken
SEED_SHARE_BYTES = share_bytes(SEED_BYTES)
KEY_SHARE_BYTES = share_bytes(SCALAR_BYTES)
PLAINTEXT_BYTES = 8 + 8 + 4 + SEED_SHARE_BYTES + KEY_SHARE_BYTES  # share_keys_plaintext_concat
CIPHERTEXT_BYTES = fernet_bytes(PLAINTEXT_BYTES)
POINT_BYTES = 1 + 2 * SCALAR_BYTES  # an uncompressed P-384 point
PROOF_BYTES = POINT_BYTES + 2 * SCALAR_BYTES  # channel_proof: the shared point, the challenge, the response
SEED, KEY = b"seed", b"key"  # what a share is a share of (share_hash)

_ORDER = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFC7634D81F4372DDF581A0DB248B0A77AECEC196ACCC52973  # P-384's n
_GENERATOR = ECC.construct(curve="P-384", d=1).pointQ


class ProtocolError(ValueError):
    """A stage request this node refuses: out of order, inconsistent, or one that would reveal too much;
    on the server, stage data from a node that does not parse or does not check out."""


def ids_field(record: ConfigRecord, key: str, count: int | None = None) -> list[int]:
    """`record[key]`: a list of node ids (of `count` entries when given)."""
    value = record.get(key)
    if type(value) is not list or not all(type(v) is int for v in value):
        raise ProtocolError(f"'{key}' is not a list of node ids")
    if count is not None and len(value) != count:
        raise ProtocolError(f"'{key}' holds {len(value)} ids, not {count}")
    return list(value)


def bytes_field(record: ConfigRecord, key: str, size: int) -> bytes:
    """`record[key]`: bytes of exactly `size` (never an int, which bytes() would allocate)."""
    value = record.get(key)
    if type(value) is not bytes or len(value) != size:
        raise ProtocolError(f"'{key}' is not {size} bytes")
    return value


def bytes_list_field(record: ConfigRecord, key: str, size: int | None, count: int) -> list[bytes]:
    """`record[key]`: a list of `count` bytes values, each of exactly `size` (any size: None)."""
    value = record.get(key)
    if type(value) is not list or len(value) != count:
        raise ProtocolError(f"'{key}' is not a list of {count} values")
    if not all(type(v) is bytes and (size is None or len(v) == size) for v in value):
        raise ProtocolError(f"'{key}' holds a value that is not {size if size is not None else 'any'} bytes")
    return list(value)


def public_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def private_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_private(data: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ProtocolError("not an elliptic-curve private key")
    return key


def load_public(data: bytes) -> ec.EllipticCurvePublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as err:
        raise ProtocolError(f"a malformed public key: {err}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != ec.SECP384R1().name:
        raise ProtocolError("a public key that is not a P-384 key")
    return key


def canonical_public(data: bytes) -> bytes:
    """`data` if it is a P-384 public key in the one encoding nodes send (`public_bytes`'s): another
    encoding of the same point would pass a byte comparison of keys."""
    key = load_public(data)
    if key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo) != data:
        raise ProtocolError("a public key not in its canonical PEM form")
    return data


def scalar_of(private_pem: bytes) -> bytes:
    """The private key's scalar, big-endian, SCALAR_BYTES long: what a node shares of s_sk."""
    return load_private(private_pem).private_numbers().private_value.to_bytes(SCALAR_BYTES, "big")


def private_of(scalar: bytes) -> bytes:
    """The PEM private key of a P-384 `scalar` (ProtocolError unless it is one)."""
    if len(scalar) != SCALAR_BYTES:
        raise ProtocolError(f"a key scalar of {len(scalar)} bytes, not {SCALAR_BYTES}")
    try:
        return private_bytes(ec.derive_private_key(int.from_bytes(scalar, "big"), ec.SECP384R1()))
    except ValueError as err:
        raise ProtocolError(f"not a P-384 scalar: {err}") from None


def channel_key(shared_x: bytes) -> bytes:
    """The Fernet key of an ECDH secret (its x coordinate): HKDF-SHA256 as Flower's `generate_shared_key`."""
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=None).derive(shared_x)
    return base64.urlsafe_b64encode(derived)


def pair_seed(own_private: bytes, their_public: bytes) -> bytes:
    """The key two nodes share (ECDH + HKDF): for the c keys, the key of the shares one sends the
    other; for the s keys, the seed of their pairwise mask."""
    return channel_key(load_private(own_private).exchange(ec.ECDH(), load_public(their_public)))


def seed_digest(seed: bytes) -> bytes:
    """What a node commits to for its self-mask seed (the server checks a reconstruction against it)."""
    return hashlib.sha256(b"fedgpu-secagg-seed\x00" + seed).digest()


def share_hash(kind: bytes, owner: int, holder: int, share: bytes) -> bytes:
    """What `owner` commits to, at the share stage, for the share of its `kind` secret that
    `holder` gets: the holder checks its share against it, the server every share revealed."""
    ids = owner.to_bytes(8, "little") + holder.to_bytes(8, "little")  # node ids are uint64
    return hashlib.sha256(b"fedgpu-secagg-share\x00" + kind + b"\x00" + ids + share).digest()


def open_share(key: bytes, ct: bytes, src: int, dst: int, seed_hash: bytes, key_hash: bytes) -> tuple[bytes, bytes]:
    """The (seed share, key share) `src` encrypted for `dst` under the channel `key`, if the
    ciphertext decrypts, names the pair, has the sizes of the protocol and matches `src`'s hashes.
    One function for the holder and for the server judging a complaint: both reach one verdict."""
    if len(ct) != CIPHERTEXT_BYTES:
        raise ProtocolError(f"a share ciphertext of {len(ct)} bytes, not {CIPHERTEXT_BYTES}")
    try:
        plain = decrypt(key, ct)
    except Exception as err:  # cryptography's InvalidToken and friends: a corrupted or forged ciphertext
        raise ProtocolError(f"a share that does not decrypt ({type(err).__name__})") from None
    if len(plain) != PLAINTEXT_BYTES:
        raise ProtocolError(f"a share plaintext of {len(plain)} bytes, not {PLAINTEXT_BYTES}")
    claimed_src, claimed_dst, seed_share, key_share = share_keys_plaintext_separate(plain)
    if (claimed_src, claimed_dst) != (src, dst) or len(seed_share) != SEED_SHARE_BYTES:
        raise ProtocolError(f"a share made by node {claimed_src} for node {claimed_dst}, or of another size")
    if share_hash(SEED, src, dst, seed_share) != seed_hash or share_hash(KEY, src, dst, key_share) != key_hash:
        raise ProtocolError("a share that does not match its owner's hash")
    return seed_share, key_share


def complaint_context(server_round: int, complainer: int, accused: int) -> bytes:
    """What a complaint's proof is bound to: it cannot be replayed for another pair or round."""
    ids = b"".join(v.to_bytes(8, "little") for v in (server_round, complainer, accused))
    return b"fedgpu-secagg-complaint\x00" + ids


def _encode(point: EccPoint) -> bytes:
    x, y = (int(v) for v in point.xy) if not point.is_point_at_infinity() else (0, 0)
    return b"\x04" + x.to_bytes(SCALAR_BYTES, "big") + y.to_bytes(SCALAR_BYTES, "big")


def _challenge(context: bytes, *points: EccPoint) -> int:
    return int.from_bytes(hashlib.sha384(context + b"".join(_encode(p) for p in points)).digest(), "big") % _ORDER


def channel_proof(own_private: bytes, their_public: bytes, context: bytes) -> bytes:
    """The ECDH point S = a·P of this node's c key a and a neighbour's c key P, with a Chaum-Pedersen
    proof that log_G(A) = log_P(S) (A = a·G, this node's public c key): anyone holding both public
    keys can check that S is the pair's shared secret, and nothing else about a is revealed."""
    a = load_private(own_private).private_numbers().private_value
    p = ECC.import_key(their_public).pointQ
    own, shared = _GENERATOR * a, p * a
    r = secrets.randbelow(_ORDER - 1) + 1
    e = _challenge(context, own, p, shared, _GENERATOR * r, p * r)
    z = (r + e * a) % _ORDER
    return _encode(shared) + e.to_bytes(SCALAR_BYTES, "big") + z.to_bytes(SCALAR_BYTES, "big")


def proven_channel_key(proof: bytes, prover_public: bytes, their_public: bytes, context: bytes) -> bytes | None:
    """The channel key of the pair (prover, them) that `proof` (`channel_proof`) proves, or None."""
    if len(proof) != PROOF_BYTES or proof[0] != 4:
        return None
    x, y = (int.from_bytes(proof[i : i + SCALAR_BYTES], "big") for i in (1, 1 + SCALAR_BYTES))
    e, z = (int.from_bytes(proof[i : i + SCALAR_BYTES], "big") for i in (POINT_BYTES, POINT_BYTES + SCALAR_BYTES))
    try:
        shared = EccPoint(x, y, curve="P-384")
    except ValueError:  # not on the curve
        return None
    if shared.is_point_at_infinity() or (x, y) != tuple(int(v) for v in shared.xy):  # the key is derived from x
        return None
    own, p = ECC.import_key(prover_public).pointQ, ECC.import_key(their_public).pointQ
    if not (0 < e < _ORDER and z < _ORDER):
        return None
    t1, t2 = _GENERATOR * z + own * (_ORDER - e), p * z + shared * (_ORDER - e)
    if _challenge(context, own, p, shared, t1, t2) != e:
        return None
    return channel_key(x.to_bytes(SCALAR_BYTES, "big"))


@dataclass
class NodeState:
    """One round of this node's side of the protocol (kept in Context state between stages)."""

    stage: str = ""
    round: int = -1
    node: int = 0
    threshold: int = 0
    neighbours: list[int] = field(default_factory=list)
    c_sk: bytes = b""  # decrypts the shares addressed to this node
    s_sk: bytes = b""  # the pairwise masks' key: its scalar shared, by Shamir, with the neighbours
    seed: bytes = b""  # b: the self mask's seed
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # node -> (c_pk, s_pk) of this round
    seed_shares: dict[int, bytes] = field(default_factory=dict)  # node -> this node's share of its b
    key_shares: dict[int, bytes] = field(default_factory=dict)  # node -> this node's share of its s_sk
    partners: list[int] = field(default_factory=list)  # the neighbours this node's input is pairwise masked with
    complaints: dict[int, bytes] = field(default_factory=dict)  # node -> proof: its share did not open here

    def to_record(self) -> ConfigRecord:
        ids = list(self.keys)
        return ConfigRecord(
            {
                "stage": self.stage,
                "round": self.round,
                "node": self.node,
                "threshold": self.threshold,
                "neighbours": self.neighbours,
                "c-sk": self.c_sk,
                "s-sk": self.s_sk,
                "seed": self.seed,
                "key-ids": ids,
                "c-pk": [self.keys[i][0] for i in ids],
                "s-pk": [self.keys[i][1] for i in ids],
                "seed-share-ids": list(self.seed_shares),
                "seed-shares": list(self.seed_shares.values()),
                "key-share-ids": list(self.key_shares),
                "key-shares": list(self.key_shares.values()),
                "partners": self.partners,
                "complaint-ids": list(self.complaints),
                "complaint-proofs": list(self.complaints.values()),
            }
        )

    @classmethod
    def from_record(cls, r: ConfigRecord) -> NodeState:
        def listed(key: str) -> list[Any]:
            return list(r[key]) if key in r else []

        def paired(ids: str, values: str) -> dict[Any, Any]:
            return dict(zip(listed(ids), listed(values), strict=True))

        return cls(
            stage=str(r["stage"]),
            round=int(r["round"]),
            node=int(r["node"]),
            threshold=int(r["threshold"]),
            neighbours=listed("neighbours"),
            c_sk=bytes(r["c-sk"]),
            s_sk=bytes(r["s-sk"]),
            seed=bytes(r["seed"]),
            keys=dict(zip(listed("key-ids"), zip(listed("c-pk"), listed("s-pk"), strict=True), strict=True)),
            seed_shares=paired("seed-share-ids", "seed-shares"),
            key_shares=paired("key-share-ids", "key-shares"),
            partners=listed("partners"),
            complaints=paired("complaint-ids", "complaint-proofs"),
        )


def load(context: Context, expect: str, server_round: int) -> NodeState:
    """This node's state for `server_round`, which must have reached stage `expect`."""
    if STATE not in context.state:
        raise ProtocolError(f"round {server_round}: no secure-aggregation state (stage '{expect}' expected)")
    state = NodeState.from_record(context.state[STATE])
    if state.round != server_round or state.stage != expect:
        raise ProtocolError(
            f"round {server_round}: asked for the stage after '{expect}', but this node is at "
            f"'{state.stage}' of round {state.round}"
        )
    return state


def save(context: Context, state: NodeState) -> None:
    context.state[STATE] = state.to_record()


def advertise(config: ConfigRecord, context: Context, node_id: int) -> ConfigRecord:
    """Stage 1: fresh key pairs for this round; the public halves go back."""
    server_round, threshold = int(config["round"]), int(config["threshold"])
    neighbours = ids_field(config, "neighbours")
    if node_id in neighbours or len(set(neighbours)) != len(neighbours):
        raise ProtocolError("the neighbour list names this node or a node twice")
    if not 2 <= threshold <= len(neighbours) + 1:
        raise ProtocolError(f"threshold {threshold} is not within 2..{len(neighbours) + 1} (neighbours + this node)")
    c_sk, s_sk = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    state = NodeState(
        stage=ADVERTISED,
        round=server_round,
        node=node_id,
        threshold=threshold,
        neighbours=neighbours,
        c_sk=private_bytes(c_sk),
        s_sk=private_bytes(s_sk),
    )
    save(context, state)
    return ConfigRecord({"c-pk": public_bytes(c_sk), "s-pk": public_bytes(s_sk)})


def share(config: ConfigRecord, context: Context) -> ConfigRecord:
    """Stage 2: shares of b and of s_sk's scalar, one per node that advertised keys (this one
    included), each encrypted for its holder; a digest of b and the hash of every share, in the
    order of `ids` (what the server checks revealed shares against)."""
    state = load(context, ADVERTISED, int(config["round"]))
    ids = ids_field(config, "ids")
    c_pks = bytes_list_field(config, "c-pk", PUBLIC_KEY_BYTES, len(ids))
    s_pks = bytes_list_field(config, "s-pk", PUBLIC_KEY_BYTES, len(ids))
    if len(set(ids)) != len(ids):
        raise ProtocolError("the key lists name a node twice")
    if not set(ids) <= {*state.neighbours, state.node} or state.node not in ids:
        raise ProtocolError("the keys name a node that is not this node's neighbour, or leave this node out")
    if len(ids) < state.threshold:
        raise ProtocolError(f"{len(ids)} nodes with keys, fewer than the threshold {state.threshold}")
    if len(set(c_pks + s_pks)) != 2 * len(ids):
        raise ProtocolError("two nodes advertised the same public key")
    keys = dict(zip(ids, zip(c_pks, s_pks, strict=True), strict=True))
    own = (public_bytes(load_private(state.c_sk)), public_bytes(load_private(state.s_sk)))
    if keys[state.node] != own:
        raise ProtocolError("the server lists other keys for this node than it advertised")
    state.keys, state.seed = keys, os.urandom(SEED_BYTES)
    seed_shares = create_shares(state.seed, state.threshold, len(ids))
    key_shares = create_shares(scalar_of(state.s_sk), state.threshold, len(ids))
    dsts, cts = [], []
    for i, node in enumerate(ids):
        if node == state.node:
            state.seed_shares[node], state.key_shares[node] = seed_shares[i], key_shares[i]
            continue
        secret = pair_seed(state.c_sk, keys[node][0])
        dsts.append(node)
        cts.append(encrypt(secret, share_keys_plaintext_concat(state.node, node, seed_shares[i], key_shares[i])))
    state.stage = SHARED
    save(context, state)
    return ConfigRecord(
        {
            "dst": dsts,
            "ct": cts,
            "seed-digest": seed_digest(state.seed),
            "seed-hashes": [share_hash(SEED, state.node, h, s) for h, s in zip(ids, seed_shares, strict=True)],
            "key-hashes": [share_hash(KEY, state.node, h, s) for h, s in zip(ids, key_shares, strict=True)],
        }
    )


def receive_shares(config: ConfigRecord, context: Context) -> NodeState:
    """Stage 3, before training: the shares addressed to this node, decrypted and checked against
    their owners' hashes. A share that does not open is not kept: its sender is named in the reply
    (`complaints`) with the proof of the pair's channel key, and this node still masks with it
    (its pairwise mask needs its public key only), so the server decides alone who is left out."""
    state = load(context, SHARED, int(config["round"]))
    srcs = ids_field(config, "src")
    cts = bytes_list_field(config, "ct", None, len(srcs))
    seed_hashes = bytes_list_field(config, "seed-hash", DIGEST_BYTES, len(srcs))
    key_hashes = bytes_list_field(config, "key-hash", DIGEST_BYTES, len(srcs))
    if len(set(srcs)) != len(srcs) or state.node in srcs:
        raise ProtocolError("the share lists name a node twice, or name this node")
    if not set(srcs) <= set(state.keys):
        raise ProtocolError("shares from a node that advertised no keys to this node")
    if len(srcs) + 1 < state.threshold:
        raise ProtocolError(f"shares from {len(srcs)} neighbours: fewer than the threshold {state.threshold} - 1")
    for src, ct, seed_hash, key_hash in zip(srcs, cts, seed_hashes, key_hashes, strict=True):
        c_pk = state.keys[src][0]
        try:
            opened = open_share(pair_seed(state.c_sk, c_pk), ct, src, state.node, seed_hash, key_hash)
        except ProtocolError:
            state.complaints[src] = channel_proof(state.c_sk, c_pk, complaint_context(state.round, state.node, src))
            continue
        state.seed_shares[src], state.key_shares[src] = opened
    state.partners = srcs
    return state


def complaints(state: NodeState) -> ConfigRecord:
    """The masked reply's record: the nodes whose shares did not open here, each with its proof."""
    return ConfigRecord({"accused": list(state.complaints), "proofs": list(state.complaints.values())})


def mask(state: NodeState, vector: np.ndarray, modulus: int, context: Context) -> np.ndarray:
    """Stage 3, after training: the ring vector hidden by the self mask and the pairwise masks
    (arithmetic in the wire word wraps modulo 2^bits, which M divides; reduced mod M once)."""
    word = prg.word_dtype(modulus)
    out = vector.astype(word)  # a copy: masked in place
    np.add(out, prg.mask(state.seed, vector.size, modulus), out=out)
    for other in state.partners:
        pairwise = prg.mask(pair_seed(state.s_sk, state.keys[other][1]), vector.size, modulus)
        (np.add if state.node > other else np.subtract)(out, pairwise, out=out)
    out &= word.type(modulus - 1)
    state.stage = MASKED
    save(context, state)
    return out


def reveal(config: ConfigRecord, context: Context) -> ConfigRecord:
    """Stage 4: this node's shares of the survivors' seeds and of the dropped nodes' mask keys."""
    state = load(context, MASKED, int(config["round"]))
    active, dropped = ids_field(config, "active"), ids_field(config, "dropped")
    if set(active) & set(dropped):
        raise ProtocolError(f"nodes {sorted(set(active) & set(dropped))} named both as survivors and as dropped")
    if state.node not in active:
        raise ProtocolError("this node sent its masked input but is not named a survivor")
    if not set(active) | set(dropped) <= set(state.seed_shares):
        raise ProtocolError("the request names nodes this node holds no shares of")
    if len(active) < state.threshold:
        raise ProtocolError(f"{len(active)} survivors named, fewer than the threshold {state.threshold}")
    state.stage = REVEALED  # once per round: a second request with other lists is refused
    save(context, state)
    return ConfigRecord(
        {
            "seed-ids": active,
            "seed-shares": [state.seed_shares[n] for n in active],
            "key-ids": dropped,
            "key-shares": [state.key_shares[n] for n in dropped],
        }
    )

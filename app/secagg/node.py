"""A node's side of SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", https://eprint.iacr.org/2020/704): four stages, one message each.

1. `advertise` (query.secagg_keys): two fresh ECDH key pairs (P-384), the public halves sent:
   c for encrypting shares, s for the pairwise masks.
2. `share` (query.secagg_shares): a fresh self-mask seed b; Shamir shares (threshold t) of b
   and of the mask key s_sk, one per neighbour (and one kept), each encrypted for its neighbour.
3. `mask` (train.secagg): the neighbours' shares decrypted and kept; after training, the ring
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
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord, Context
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)

from app.secagg import prg

STATE = "secagg-state"  # ConfigRecord in context.state: this node's side of the round in progress
# stages, in order: what a node has done last
ADVERTISED, SHARED, MASKED, REVEALED = "advertised", "shared", "masked", "revealed"


class ProtocolError(ValueError):
    """A stage request this node refuses: out of order, inconsistent, or one that would reveal too much."""


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


def pair_seed(own_private: bytes, their_public: bytes) -> bytes:
    """The seed of the pairwise mask two nodes share (ECDH + HKDF, Flower's `generate_shared_key`)."""
    return generate_shared_key(load_private(own_private), load_public(their_public))


def seed_digest(seed: bytes) -> bytes:
    """What a node commits to for its self-mask seed (the server checks a reconstruction against it)."""
    return hashlib.sha256(b"fedgpu-secagg-seed\x00" + seed).digest()


@dataclass
class NodeState:
    """One round of this node's side of the protocol (kept in Context state between stages)."""

    stage: str = ""
    round: int = -1
    node: int = 0
    threshold: int = 0
    neighbours: list[int] = field(default_factory=list)
    c_sk: bytes = b""  # decrypts the shares addressed to this node
    s_sk: bytes = b""  # the pairwise masks' key: shared, by Shamir, with the neighbours
    seed: bytes = b""  # b: the self mask's seed
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # node -> (c_pk, s_pk) of this round
    seed_shares: dict[int, bytes] = field(default_factory=dict)  # node -> this node's share of its b
    key_shares: dict[int, bytes] = field(default_factory=dict)  # node -> this node's share of its s_sk
    partners: list[int] = field(default_factory=list)  # the neighbours this node's input is pairwise masked with

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
            }
        )

    @classmethod
    def from_record(cls, r: ConfigRecord) -> NodeState:
        def listed(key: str) -> list[Any]:
            return list(r[key]) if key in r else []

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
            seed_shares=dict(zip(listed("seed-share-ids"), listed("seed-shares"), strict=True)),
            key_shares=dict(zip(listed("key-share-ids"), listed("key-shares"), strict=True)),
            partners=listed("partners"),
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


def _ints(config: ConfigRecord, key: str) -> list[int]:
    value = config.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ProtocolError(f"'{key}' must be a list of node ids")
    return [int(v) for v in value]


def _bytes(config: ConfigRecord, key: str) -> list[bytes]:
    value = config.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, bytes) for v in value):
        raise ProtocolError(f"'{key}' must be a list of bytes")
    return list(value)


def advertise(config: ConfigRecord, context: Context, node_id: int) -> ConfigRecord:
    """Stage 1: fresh key pairs for this round; the public halves go back."""
    server_round, threshold = int(config["round"]), int(config["threshold"])
    neighbours = _ints(config, "neighbours")
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
    """Stage 2: shares of b and s_sk, one per node that advertised keys (this one included),
    each encrypted for its holder; and a commitment to b."""
    state = load(context, ADVERTISED, int(config["round"]))
    ids, c_pks, s_pks = _ints(config, "ids"), _bytes(config, "c-pk"), _bytes(config, "s-pk")
    if not len(ids) == len(c_pks) == len(s_pks) or len(set(ids)) != len(ids):
        raise ProtocolError("the key lists differ in length or name a node twice")
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
    state.keys, state.seed = keys, os.urandom(32)
    seed_shares = create_shares(state.seed, state.threshold, len(ids))
    key_shares = create_shares(state.s_sk, state.threshold, len(ids))
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
    return ConfigRecord({"dst": dsts, "ct": cts, "seed-digest": seed_digest(state.seed)})


def receive_shares(config: ConfigRecord, context: Context) -> NodeState:
    """Stage 3, before training: the shares addressed to this node, decrypted and checked."""
    state = load(context, SHARED, int(config["round"]))
    srcs, cts = _ints(config, "src"), _bytes(config, "ct")
    if len(srcs) != len(cts) or len(set(srcs)) != len(srcs) or state.node in srcs:
        raise ProtocolError("the share lists differ in length, name a node twice, or name this node")
    if not set(srcs) <= set(state.keys):
        raise ProtocolError("shares from a node that advertised no keys to this node")
    if len(srcs) + 1 < state.threshold:
        raise ProtocolError(f"shares from {len(srcs)} neighbours: fewer than the threshold {state.threshold} - 1")
    for src, ct in zip(srcs, cts, strict=True):
        try:
            plain = decrypt(pair_seed(state.c_sk, state.keys[src][0]), ct)
        except Exception as err:  # cryptography's InvalidToken and friends: a corrupted or forged ciphertext
            raise ProtocolError(f"the share from node {src} does not decrypt ({type(err).__name__})") from None
        claimed_src, dst, seed_share, key_share = share_keys_plaintext_separate(plain)
        if claimed_src != src or dst != state.node:
            raise ProtocolError(f"the share relayed as node {src}'s was made by node {claimed_src} for node {dst}")
        state.seed_shares[src], state.key_shares[src] = seed_share, key_share
    state.partners = srcs
    return state


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
    active, dropped = _ints(config, "active"), _ints(config, "dropped")
    if set(active) & set(dropped):
        raise ProtocolError(f"nodes {sorted(set(active) & set(dropped))} named both as survivors and as dropped")
    if state.node not in active:
        raise ProtocolError("this node sent its masked input but is not named a survivor")
    if not set(active) | set(dropped) <= {*state.partners, state.node}:
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

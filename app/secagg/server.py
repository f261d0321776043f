"""The server's side of SecAgg+ (Bell et al. 2020) over Flower messages: one round's four stages
with the cohort a strategy sampled, ending in the sum of the survivors' ring vectors, or in an
abort that reveals nothing.

Each stage goes to the nodes still in the round; a node that does not answer within the round
timeout, answers with an error, or answers with malformed data leaves the round at that stage
(named in the log and the outcome). The round goes on while at least t nodes are left at every
stage and every survivor's seed and every dropped partner's key can be rebuilt from t valid
shares; else it aborts before the unmasking stage (nothing is asked) or, if shares come back
short, with no reconstruction used. The server never asks one node for both a seed share and a
key share of the same node, and asks each node to reveal once (the nodes refuse otherwise: node.py).

Nodes may deviate; what one does is attributed to it alone (`Outcome.culprits`), and costs the
round only what a dropout would where the protocol allows it:

- every field of every stage reply has one type and one exact size (node.py), checked before use;
  a reply that does not parse drops its node, as do two equal public keys (its own, or another's);
- at the share stage each node commits to the hash of every share it makes, and the server
  forwards each holder the hashes of its shares: a holder whose share does not open names the
  sender in its masked reply with a proof of their channel key, and the server, opening the
  ciphertext it relayed under that key, blames the sender, or the complainer if the share opens;
- each revealed share is checked against its owner's hash: a wrong one blames its revealer and is
  not used; t valid shares that rebuild no secret matching the owner's commitment blame the owner.

A node proven to deviate before its masked input is summed is left out of the sum; one caught
later stays in it (taking it out would need both of its secrets), and the round aborts if its
seed cannot be rebuilt. The communication graph is the random k-regular graph of SecAgg+ (a
circulant graph on a random order of the cohort, drawn from the OS's CSPRNG): each node shares its
secrets with, and masks against, its k neighbours only, so a node's work grows with k, not with
the cohort.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.secure_aggregation.crypto.shamir import combine_shares

from app.protocol import SECAGG, SECAGG_KEYS, SECAGG_MASKED, SECAGG_SHARES, SECAGG_TRAIN, SECAGG_UNMASK
from app.secagg import prg
from app.secagg.node import (
    CIPHERTEXT_BYTES,
    DIGEST_BYTES,
    KEY,
    KEY_SHARE_BYTES,
    PROOF_BYTES,
    PUBLIC_KEY_BYTES,
    SEED,
    SEED_SHARE_BYTES,
    ProtocolError,
    bytes_field,
    bytes_list_field,
    canonical_public,
    complaint_context,
    ids_field,
    load_private,
    open_share,
    pair_seed,
    private_of,
    proven_channel_key,
    public_bytes,
    seed_digest,
    share_hash,
)
from app.secagg.ring import Ring
from strategies.replies import HEADER_ALLOWANCE, arrays_digest, payload_bytes

log = logging.getLogger("flwr.fedgpu." + __name__)

Exchange = Callable[[list[Message]], Iterable[Message]]  # a stage's replies, as they arrive
HASHES = ("seed-hashes", "key-hashes")  # a share reply's commitments, one hash per holder (node.share)


def default_degree(cohort: int) -> int:
    """k: every other node up to 16 nodes; beyond, about 4 log2 n (SecAgg+ needs O(log n))."""
    return cohort - 1 if cohort <= 16 else min(cohort - 1, 2 * math.ceil(2 * math.log2(cohort)))


def default_threshold(neighbourhood: int) -> int:
    """t for a neighbourhood of m = k + 1 nodes: the smallest integer above 2m/3, floor(2m/3) + 1.
    Fewer than a third of a neighbourhood may drop, and the server with fewer than t of it cannot
    rebuild a secret (ceil(2m/3) + 1 would leave a cohort of 5 no dropout at all)."""
    return min(neighbourhood, 2 * neighbourhood // 3 + 1)


def neighbours(nodes: Sequence[int], degree: int, rng: secrets.SystemRandom | None = None) -> dict[int, list[int]]:
    """A random k-regular graph on `nodes` (k = `degree`, rounded up to even below n - 1): the
    circulant graph joining each node to the k/2 before and after it on a random cycle."""
    order = list(nodes)
    (rng or secrets.SystemRandom()).shuffle(order)
    n = len(order)
    if degree >= n - 1:
        return {v: [u for u in order if u != v] for v in order}
    half = (degree + 1) // 2
    return {v: sorted({order[(i + d) % n] for d in range(-half, half + 1) if d != 0}) for i, v in enumerate(order)}


@dataclass
class Outcome:
    """What one secure round gave the server."""

    total: np.ndarray | None = None  # the survivors' ring vectors summed mod M (None: aborted)
    survivors: list[int] = field(default_factory=list)  # the nodes whose inputs are in `total`
    dropped: dict[int, str] = field(default_factory=dict)  # node -> the stage it left at, and why
    culprits: dict[int, str] = field(default_factory=dict)  # node -> the stage it was proven to deviate at, and how
    aborted: str | None = None
    masked_sum_digest: str | None = None  # sha256 of the masked inputs' sum mod M, before unmasking
    masked: list[Message] = field(default_factory=list)  # the train replies, arrays dropped once summed
    digests: dict[int, str] = field(default_factory=dict)  # node -> sha256 of its masked input (the ledger's)
    clear: dict[int, MetricRecord] = field(default_factory=dict)  # node -> the telemetry it sent in the clear
    sent: list[Message] = field(default_factory=list)  # every stage's messages
    bytes_down: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))  # node -> stage bytes
    bytes_up: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))
    group_digests: dict[str, str | None] = field(default_factory=dict)  # merged groups: each one's masked sum's

    def merge(self, group: int, other: Outcome) -> None:
        """Another secure group's outcome into this one (SecAgg+ inside regions: a group per region,
        app/secagg/strategy.py): its stages, drops, culprits and inputs, and its masked sum's digest
        under its group's key. Survivors, total and abort stay the caller's: it decides what the
        groups add up to."""
        self.dropped.update(other.dropped)
        self.culprits.update(other.culprits)
        self.masked += other.masked
        self.digests.update(other.digests)
        self.clear.update(other.clear)
        self.sent += other.sent
        self.bytes_down.update(other.bytes_down)  # a node is in one group
        self.bytes_up.update(other.bytes_up)
        self.group_digests[str(group)] = other.masked_sum_digest


@dataclass(frozen=True)
class Commitments:
    """What a node committed to at the share stage: its seed's digest, and the hash of the share of
    its seed and of its key that each holder got (`share_hash`)."""

    digest: bytes
    seed: dict[int, bytes]  # holder -> hash
    key: dict[int, bytes]


@dataclass(frozen=True)
class SecureRound:
    """Drives one round's stages through `exchange` (the run's send-and-receive with its timeout)."""

    threshold: int  # t
    degree: int  # k
    ring: Ring
    ttl: float
    name: Callable[[int], str] = str  # how log lines name a node

    def run(
        self, server_round: int, tasks: list[Message], exchange: Exchange, size: int, train_record: dict[str, Any]
    ) -> Outcome:
        """The round: `tasks` are the strategy's training messages (one per sampled node, content
        as for a plain round); `size` the ring vector's length; `train_record` the ring and noise
        settings every training task carries."""
        out = Outcome()
        t = self.threshold
        content = {m.metadata.dst_node_id: m for m in tasks}
        graph = neighbours(list(content), self.degree)
        group = str(server_round)
        if not 2 <= t <= min(self.degree, len(content) - 1) + 1:
            return self.abort(out, f"t = {t} with {len(content)} nodes sampled and k = {self.degree}")

        def send(
            kind: str, records: dict[int, RecordDict], fold: Callable[[int, Message], None] | None = None
        ) -> dict[int, Message]:
            """One stage: the replies by node, or with `fold` each reply handed to it as it arrives
            (the masked inputs: folded into the sum, their arrays dropped, none kept)."""
            messages = [
                Message(content=rd, message_type=kind, dst_node_id=node, ttl=self.ttl, group_id=group)
                for node, rd in records.items()
            ]
            out.sent.extend(messages)
            for m in messages:
                out.bytes_down[m.metadata.dst_node_id] += stage_bytes(m.content)
            got: dict[int, Message] = {}
            by_id: dict[str, int] = {}
            for reply in exchange(messages):
                if not by_id:  # pushing, inside `exchange`, gave the messages their ids
                    by_id = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
                node = by_id.get(reply.metadata.reply_to_message_id)
                if node is None:
                    continue
                if reply.has_error():
                    self.drop(out, node, kind, f"error reply: {reply.error.reason}")
                    continue
                out.bytes_up[node] += stage_bytes(reply.content)
                if fold is not None:
                    fold(node, reply)
                else:
                    got[node] = reply
            answered = set(got) | (set(out.digests) if fold is not None else set())
            for node in records:
                if node not in answered and node not in out.dropped:
                    self.drop(out, node, kind, "no reply within the round timeout")
            return got

        def config(node_config: dict) -> RecordDict:
            return RecordDict({SECAGG: ConfigRecord({"round": server_round, **node_config})})

        # 1. keys
        replies = send(SECAGG_KEYS, {v: config({"threshold": t, "neighbours": graph[v]}) for v in content})
        keys: dict[int, tuple[bytes, bytes]] = {}
        for node, reply in replies.items():
            try:
                keys[node] = parse_keys(stage_record(reply))
            except (KeyError, TypeError, ValueError) as err:
                self.drop(out, node, SECAGG_KEYS, f"malformed keys ({err})", proven=True)
        advertised = Counter(pk for pair in keys.values() for pk in pair)
        for node in sorted(v for v, pair in keys.items() if any(advertised[pk] > 1 for pk in pair)):
            # keys are fresh and no node sees another's before this stage ends: both copied it
            self.drop(out, node, SECAGG_KEYS, "advertised a public key another node advertised too", proven=True)
            del keys[node]
        alive = self.neighbourhoods(out, graph, set(keys), SECAGG_KEYS)
        if (why := self.too_few(alive, "advertised keys")) is not None:
            return self.abort(out, why)

        # 2. shares, and the hashes of the shares
        holders = {v: [u for u in [v, *graph[v]] if u in alive] for v in alive}
        replies = send(
            SECAGG_SHARES,
            {
                v: config({"ids": ids, "c-pk": [keys[u][0] for u in ids], "s-pk": [keys[u][1] for u in ids]})
                for v, ids in holders.items()
            },
        )
        sent: dict[int, dict[int, bytes]] = {}  # node -> holder -> the ciphertext of its shares for that holder
        commits: dict[int, Commitments] = {}
        for node, reply in replies.items():
            try:
                sent[node], commits[node] = parse_shares(stage_record(reply), node, holders[node])
            except (KeyError, TypeError, ValueError) as err:
                self.drop(out, node, SECAGG_SHARES, f"malformed shares ({err})", proven=True)
        shared = set(commits)
        alive = self.neighbourhoods(out, graph, shared, SECAGG_SHARES)
        if (why := self.too_few(alive, "sent their shares")) is not None:
            return self.abort(out, why)

        # 3. train and mask: the strategy's task, with the shares addressed to each node and their hashes
        partners = {v: sorted(u for u in shared if v in sent[u]) for v in alive}
        records = {}
        for v in alive:
            rd = RecordDict(dict(content[v].content.items()))
            src = partners[v]
            rd[SECAGG] = ConfigRecord(
                {
                    **train_record,
                    "round": server_round,
                    "src": src,
                    "ct": [sent[u][v] for u in src],
                    "seed-hash": [commits[u].seed[v] for u in src],
                    "key-hash": [commits[u].key[v] for u in src],
                }
            )
            records[v] = rd
        wire = prg.word_dtype(self.ring.modulus)
        top = wire.type(self.ring.modulus - 1)
        total = np.zeros(size, dtype=wire)  # sums wrap modulo the word's 2^bits, which M divides
        masked: set[int] = set()
        complained: dict[int, set[int]] = {}  # survivor -> the partners whose shares it does not hold

        def fold(node: int, reply: Message) -> None:
            try:
                accusations = parse_complaints(stage_record(reply), partners[node])
                name, record = masked_record(reply, wire, size)
                vector = record[SECAGG_MASKED].numpy()
                if vector.dtype != wire or vector.shape != (size,):
                    raise ProtocolError(f"a masked vector of {vector.dtype} {vector.shape}, not {wire} ({size},)")
            except (KeyError, TypeError, ValueError, EOFError) as err:
                self.drop(out, node, SECAGG_TRAIN, f"malformed masked input ({err})", proven=True)
                return
            for accused, proof in accusations.items():
                self.judge(out, server_round, node, accused, proof, keys, sent[accused][node], commits[accused])
            if node in out.culprits:  # a false complaint in this reply, or accused before it arrived
                self.drop(out, node, SECAGG_TRAIN, "proven to deviate before its masked input was summed")
                return
            np.add(total, vector, out=total)
            out.digests[node] = arrays_digest(record)
            out.clear[node] = next(iter(reply.content.metric_records.values()), MetricRecord())
            del reply.content[name], vector, record  # folded: the reply keeps its metrics, not its arrays
            out.masked.append(reply)
            masked.add(node)
            complained[node] = set(accusations)

        send(SECAGG_TRAIN, records, fold)
        total &= top
        out.masked_sum_digest = hashlib.sha256(total.tobytes()).hexdigest()
        if len(masked) < t:
            return self.abort(out, f"{len(masked)} masked inputs arrived, fewer than the threshold {t}")
        # what each survivor holds valid shares of; one naming fewer than t survivors would refuse to reveal
        held = {v: {v, *partners[v]} - complained[v] for v in masked}
        asked = sorted(v for v in masked if len(held[v] & masked) >= t)
        lost = {u for v in masked for u in partners[v]} - masked  # dropped partners: their pairwise masks stay

        def short(u: int) -> bool:
            return len([v for v in asked if u in held[v]]) < t

        for v in sorted(masked):
            if short(v):
                return self.abort(out, f"fewer than t = {t} of the survivors hold valid shares of {self.name(v)}")
        for d in sorted(lost):
            if short(d):
                return self.abort(out, f"fewer than t = {t} survivors hold valid shares of dropped {self.name(d)}")

        # 4. unmask: each revealed share checked against its owner's hash
        asks = {
            v: (
                [u for u in [v, *partners[v]] if u in held[v] and u in masked],
                [u for u in partners[v] if u in held[v] and u not in masked],
            )
            for v in asked
        }
        replies = send(SECAGG_UNMASK, {v: config({"active": a, "dropped": d}) for v, (a, d) in asks.items()})
        shares: dict[tuple[bytes, int], list[bytes]] = defaultdict(list)  # (SEED | KEY, owner) -> valid shares
        for node, reply in replies.items():
            try:
                revealed = parse_reveal(stage_record(reply), *asks[node])
            except (KeyError, TypeError, ValueError) as err:
                self.drop(out, node, SECAGG_UNMASK, f"malformed shares ({err})", proven=True)
                continue
            wrong = []
            for kind, owner, share in revealed:
                hashes = commits[owner].seed if kind == SEED else commits[owner].key
                if share_hash(kind, owner, node, share) == hashes[node]:
                    shares[kind, owner].append(share)
                else:
                    wrong.append(owner)
            if wrong:
                names = ", ".join(self.name(u) for u in wrong)
                self.blame(out, node, SECAGG_UNMASK, f"revealed shares of {names} other than their owners committed to")
        for v in sorted(masked):
            seed = self.recover(out, v, shares[SEED, v], lambda s, v=v: seed_digest(s) == commits[v].digest)
            if seed is None:
                return self.abort(out, f"the self-mask seed of {self.name(v)} could not be rebuilt from t valid shares")
            np.subtract(total, prg.mask(seed, size, self.ring.modulus), out=total)
        for d in sorted(lost):
            scalar = self.recover(out, d, shares[KEY, d], lambda s, d=d: _is_key_of(s, keys[d][1]))
            if scalar is None:
                return self.abort(
                    out, f"the mask key of dropped {self.name(d)} could not be rebuilt from t valid shares"
                )
            key = private_of(scalar)
            for v in masked:
                if d in partners[v]:
                    pairwise = prg.mask(pair_seed(key, keys[v][1]), size, self.ring.modulus)
                    (np.subtract if v > d else np.add)(total, pairwise, out=total)
        total &= top
        out.total, out.survivors = total, sorted(masked)
        return out

    def rebuild(self, shares: list[bytes], check: Callable[[bytes], bool]) -> bytes | None:
        """The secret behind t of `shares` if it passes `check`. The shares must be of one size, no
        larger than a key share: Flower's `combine_shares` sizes its work by the first share (seconds
        of CPU per MiB), and shares of different sizes rebuild nothing."""
        if len(shares) < self.threshold or len({len(s) for s in shares}) != 1 or len(shares[0]) > KEY_SHARE_BYTES:
            return None
        try:
            secret = combine_shares(shares[: self.threshold])
        except ValueError:
            return None
        return secret if check(secret) else None

    def recover(self, out: Outcome, owner: int, shares: list[bytes], check: Callable[[bytes], bool]) -> bytes | None:
        """`rebuild` from the valid shares of `owner`'s secret: every one of them is the share its
        owner committed to, so t of them that rebuild a secret failing `check` prove the owner
        deviated (inconsistent shares, or a digest of another seed)."""
        if len(shares) < self.threshold:
            return None
        secret = self.rebuild(shares, check)
        if secret is None:
            self.blame(out, owner, SECAGG_SHARES, "its committed shares rebuild no secret matching its commitment")
        return secret

    def judge(
        self,
        out: Outcome,
        server_round: int,
        complainer: int,
        accused: int,
        proof: bytes,
        keys: dict[int, tuple[bytes, bytes]],
        ct: bytes,
        commits: Commitments,
    ) -> None:
        """A complaint that `accused`'s share for `complainer` does not open: the proof gives the
        pair's channel key, under which the server opens the ciphertext it relayed, against the
        hashes `accused` committed to. The accused is blamed if it does not open; the complainer if
        the proof fails or the share opens (it cannot frame an honest node)."""
        context = complaint_context(server_round, complainer, accused)
        channel = proven_channel_key(proof, keys[complainer][0], keys[accused][0], context)
        if channel is None:
            self.blame(out, complainer, SECAGG_TRAIN, f"complained about {self.name(accused)} with a false proof")
            return
        try:
            open_share(channel, ct, accused, complainer, commits.seed[complainer], commits.key[complainer])
        except ProtocolError as err:
            why = f"its share for {self.name(complainer)} does not open ({err}), shown by its holder's complaint"
            self.blame(out, accused, SECAGG_SHARES, why)
            return
        self.blame(out, complainer, SECAGG_TRAIN, f"complained about {self.name(accused)}'s share, which opens")

    def neighbourhoods(self, out: Outcome, graph: dict[int, list[int]], alive: set[int], stage: str) -> set[int]:
        """The nodes of `alive` with at least t - 1 neighbours in it (the rest cannot go on: named)."""
        kept = set(alive)
        for v in sorted(alive):
            if len([u for u in graph[v] if u in alive]) + 1 < self.threshold:
                self.drop(out, v, stage, f"fewer than t - 1 = {self.threshold - 1} of its neighbours are left")
                kept.discard(v)
        return kept

    def too_few(self, alive: set[int], what: str) -> str | None:
        return (
            f"{len(alive)} nodes {what}, fewer than the threshold {self.threshold}"
            if len(alive) < self.threshold
            else None
        )

    def drop(self, out: Outcome, node: int, stage: str, why: str, proven: bool = False) -> None:
        """`node` leaves the round at `stage`; `proven`: its own reply shows it deviated (a culprit)."""
        out.dropped.setdefault(node, f"{stage}: {why}")
        if proven:
            out.culprits.setdefault(node, f"{stage}: {why}")
        log.warning(
            "secure aggregation: %s leaves the round at %s%s: %s",
            self.name(node), stage, " (proven to deviate)" if proven else "", why,
        )  # fmt: skip

    def blame(self, out: Outcome, node: int, stage: str, why: str) -> None:
        """`node` is proven to have deviated at `stage` (where it is in the round does not change)."""
        out.culprits.setdefault(node, f"{stage}: {why}")
        log.warning("secure aggregation: %s deviated from the protocol at %s: %s", self.name(node), stage, why)

    def abort(self, out: Outcome, why: str) -> Outcome:
        out.aborted = why
        log.warning("secure aggregation: round aborted, nothing unmasked: %s", why)
        return out


def stage_record(reply: Message) -> ConfigRecord:
    """A stage reply's ConfigRecord (KeyError when there is none)."""
    return reply.content.config_records[SECAGG]


def parse_keys(record: ConfigRecord) -> tuple[bytes, bytes]:
    """(c_pk, s_pk): two different P-384 keys in their canonical PEM, so equal keys are equal bytes."""
    c_pk, s_pk = (canonical_public(bytes_field(record, k, PUBLIC_KEY_BYTES)) for k in ("c-pk", "s-pk"))
    if c_pk == s_pk:
        raise ProtocolError("its two public keys are equal")
    return c_pk, s_pk


def parse_shares(record: ConfigRecord, node: int, ids: list[int]) -> tuple[dict[int, bytes], Commitments]:
    """The ciphertexts `node` made for each of its neighbours among `ids` (the nodes the server sent
    it keys of, itself first), and its commitments: one hash per node of `ids`, in that order."""
    others = ids[1:]
    dsts = ids_field(record, "dst", len(others))
    if sorted(dsts) != sorted(others):
        raise ProtocolError(f"shares addressed to {sorted(dsts)}, not to its neighbours {sorted(others)}")
    cts = bytes_list_field(record, "ct", CIPHERTEXT_BYTES, len(dsts))
    digest = bytes_field(record, "seed-digest", DIGEST_BYTES)
    seed, key = (dict(zip(ids, bytes_list_field(record, k, DIGEST_BYTES, len(ids)), strict=True)) for k in HASHES)
    return dict(zip(dsts, cts, strict=True)), Commitments(digest, seed, key)


def parse_complaints(record: ConfigRecord, partners: list[int]) -> dict[int, bytes]:
    """accused -> proof: partners whose share the node says did not open, each named once."""
    accused = ids_field(record, "accused")
    if len(accused) > len(partners) or len(set(accused)) != len(accused) or not set(accused) <= set(partners):
        raise ProtocolError("complaints about nodes that sent it no share, or twice about one")
    return dict(zip(accused, bytes_list_field(record, "proofs", PROOF_BYTES, len(accused)), strict=True))


def masked_record(reply: Message, wire: np.dtype, size: int) -> tuple[str, ArrayRecord]:
    """The reply's one ArrayRecord, holding the masked vector alone and no larger than `size` words
    (checked before its payload is parsed)."""
    arrays = reply.content.array_records
    if len(arrays) != 1:
        raise ProtocolError("a reply that is not one masked vector")
    ((name, record),) = arrays.items()
    if (
        list(record.keys()) != [SECAGG_MASKED]
        or len(record[SECAGG_MASKED].data) > size * wire.itemsize + HEADER_ALLOWANCE
    ):
        raise ProtocolError("a reply that is not one masked vector of the round's size")
    return name, record


def parse_reveal(record: ConfigRecord, active: list[int], dropped: list[int]) -> list[tuple[bytes, int, bytes]]:
    """(SEED, owner, share) for each survivor in `active`, (KEY, owner, share) for each node in
    `dropped`: the node's shares, each of its exact size, for exactly the nodes it was asked about."""
    if ids_field(record, "seed-ids", len(active)) != active or ids_field(record, "key-ids", len(dropped)) != dropped:
        raise ProtocolError("shares for other nodes than asked")
    seeds = bytes_list_field(record, "seed-shares", SEED_SHARE_BYTES, len(active))
    keys = bytes_list_field(record, "key-shares", KEY_SHARE_BYTES, len(dropped))
    return [(SEED, u, s) for u, s in zip(active, seeds, strict=True)] + [
        (KEY, u, s) for u, s in zip(dropped, keys, strict=True)
    ]


def stage_bytes(content: RecordDict) -> int:
    """A stage message's arrays and the keys, shares and ciphertexts its ConfigRecords carry."""
    carried = 0
    for record in content.config_records.values():
        for value in record.values():
            carried += sum(len(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, bytes))
    return payload_bytes(content) + carried


def _is_key_of(scalar: bytes, public_pem: bytes) -> bool:
    try:
        return public_bytes(load_private(private_of(scalar))) == public_pem
    except ProtocolError:
        return False

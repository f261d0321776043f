"""The server's side of SecAgg+ (Bell et al. 2020) over Flower messages: one round's four stages
with the cohort a strategy sampled, ending in the sum of the survivors' ring vectors, or in an
abort that reveals nothing.

Each stage goes to the nodes still in the round; a node that does not answer within the round
timeout, answers with an error, or answers with malformed data leaves the round at that stage
(named in the log and the outcome). The round goes on while at least t nodes are left at every
stage and every survivor's seed and every dropped partner's key can be rebuilt from t shares; else
it aborts before the unmasking stage (nothing is asked) or, if shares come back short, with no
reconstruction used. The server never asks one node for both a seed share and a key share of the
same node, and asks each node to reveal once (the nodes refuse otherwise: node.py).

The communication graph is the random k-regular graph of SecAgg+ (a circulant graph on a random
order of the cohort, drawn from the OS's CSPRNG): each node shares its secrets with, and masks
against, its k neighbours only, so a node's work grows with k, not with the cohort.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.secure_aggregation.crypto.shamir import combine_shares

from app.protocol import SECAGG, SECAGG_KEYS, SECAGG_MASKED, SECAGG_SHARES, SECAGG_TRAIN, SECAGG_UNMASK
from app.secagg import prg
from app.secagg.node import ProtocolError, load_private, load_public, pair_seed, public_bytes, seed_digest
from app.secagg.ring import Ring
from strategies.replies import arrays_digest, payload_bytes

log = logging.getLogger("flwr.fedgpu." + __name__)

Exchange = Callable[[list[Message]], Iterable[Message]]  # a stage's replies, as they arrive


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
        app/secagg/strategy.py): its stages, drops and inputs, and its masked sum's digest under its
        group's key. Survivors, total and abort stay the caller's: it decides what the groups add up to."""
        self.dropped.update(other.dropped)
        self.masked += other.masked
        self.digests.update(other.digests)
        self.clear.update(other.clear)
        self.sent += other.sent
        self.bytes_down.update(other.bytes_down)  # a node is in one group
        self.bytes_up.update(other.bytes_up)
        self.group_digests[str(group)] = other.masked_sum_digest


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
        content = {m.metadata.dst_node_id: m for m in tasks}
        graph = neighbours(list(content), self.degree)
        group = str(server_round)
        if not 2 <= self.threshold <= min(self.degree, len(content) - 1) + 1:
            return self.abort(out, f"t = {self.threshold} with {len(content)} nodes sampled and k = {self.degree}")

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
        replies = send(SECAGG_KEYS, {v: config({"threshold": self.threshold, "neighbours": graph[v]}) for v in content})
        keys: dict[int, tuple[bytes, bytes]] = {}
        for node, reply in replies.items():
            try:
                rec = reply.content[SECAGG]
                keys[node] = (bytes(rec["c-pk"]), bytes(rec["s-pk"]))
                for pk in keys[node]:
                    load_public(pk)
            except (KeyError, TypeError, ProtocolError) as err:
                keys.pop(node, None)
                self.drop(out, node, SECAGG_KEYS, f"malformed keys ({err})")
        if len({k for pair in keys.values() for k in pair}) != 2 * len(keys):
            return self.abort(out, "two nodes advertised the same public key")
        alive = self.neighbourhoods(out, graph, set(keys), SECAGG_KEYS)
        if (why := self.too_few(alive, "advertised keys")) is not None:
            return self.abort(out, why)

        # 2. shares
        records = {}
        for v in alive:
            ids = [u for u in [v, *graph[v]] if u in alive]
            records[v] = config({"ids": ids, "c-pk": [keys[u][0] for u in ids], "s-pk": [keys[u][1] for u in ids]})
        replies = send(SECAGG_SHARES, records)
        inbox: dict[int, dict[int, bytes]] = {v: {} for v in replies}
        digests: dict[int, bytes] = {}
        for node, reply in replies.items():
            try:
                rec = reply.content[SECAGG]
                dsts, cts = list(rec["dst"]), list(rec["ct"])
                expected = {u for u in graph[node] if u in alive}
                if sorted(dsts) != sorted(expected) or len(cts) != len(dsts):
                    raise ProtocolError(f"shares addressed to {sorted(dsts)}, not to its neighbours {sorted(expected)}")
                digests[node] = bytes(rec["seed-digest"])
                for dst, ct in zip(dsts, cts, strict=True):
                    if dst in inbox:
                        inbox[dst][node] = bytes(ct)
            except (KeyError, TypeError, ProtocolError) as err:
                self.drop(out, node, SECAGG_SHARES, f"malformed shares ({err})")
        shared = set(digests)
        for v in inbox:
            inbox[v] = {u: ct for u, ct in inbox[v].items() if u in shared}
        alive = self.neighbourhoods(out, graph, shared, SECAGG_SHARES)
        if (why := self.too_few(alive, "sent their shares")) is not None:
            return self.abort(out, why)

        # 3. train and mask: the strategy's task, with the shares addressed to each node
        partners = {v: sorted(inbox[v]) for v in alive}
        records = {}
        for v in alive:
            rd = RecordDict(dict(content[v].content.items()))
            rd[SECAGG] = ConfigRecord(
                {**train_record, "round": server_round, "src": partners[v], "ct": [inbox[v][u] for u in partners[v]]}
            )
            records[v] = rd
        wire = prg.word_dtype(self.ring.modulus)
        top = wire.type(self.ring.modulus - 1)
        total = np.zeros(size, dtype=wire)  # sums wrap modulo the word's 2^bits, which M divides
        masked: set[int] = set()

        def fold(node: int, reply: Message) -> None:
            try:
                arrays = reply.content.array_records
                if len(arrays) != 1 or list(next(iter(arrays.values())).keys()) != [SECAGG_MASKED]:
                    raise ProtocolError("a reply that is not one masked vector")
                ((name, record),) = arrays.items()
                vector = record[SECAGG_MASKED].numpy()
                if vector.dtype != wire or vector.shape != (size,):
                    raise ProtocolError(f"a masked vector of {vector.dtype} {vector.shape}, not {wire} ({size},)")
            except (KeyError, TypeError, ValueError, ProtocolError) as err:
                self.drop(out, node, SECAGG_TRAIN, f"malformed masked input ({err})")
                return
            np.add(total, vector, out=total)
            out.digests[node] = arrays_digest(record)
            out.clear[node] = next(iter(reply.content.metric_records.values()), MetricRecord())
            del reply.content[name], vector, record  # folded: the reply keeps its metrics, not its arrays
            out.masked.append(reply)
            masked.add(node)

        send(SECAGG_TRAIN, records, fold)
        total &= top
        out.masked_sum_digest = hashlib.sha256(total.tobytes()).hexdigest()
        if len(masked) < self.threshold:
            return self.abort(out, f"{len(masked)} masked inputs arrived, fewer than the threshold {self.threshold}")
        # every survivor's seed, and every dropped partner's key, needs t live holders
        for v in masked:
            if len([u for u in [v, *partners[v]] if u in masked]) < self.threshold:
                return self.abort(out, f"fewer than t = {self.threshold} of {self.name(v)}'s neighbours are left")
        for d in {u for v in masked for u in partners[v] if u not in masked}:
            if len([v for v in masked if d in partners[v]]) < self.threshold:
                return self.abort(out, f"fewer than t = {self.threshold} nodes hold shares of dropped {self.name(d)}")

        # 4. unmask
        records = {
            v: config(
                {
                    "active": [u for u in [v, *partners[v]] if u in masked],
                    "dropped": [u for u in partners[v] if u not in masked],
                }
            )
            for v in masked
        }
        replies = send(SECAGG_UNMASK, records)
        seed_shares: dict[int, list[bytes]] = {}
        key_shares: dict[int, list[bytes]] = {}
        for node, reply in replies.items():
            try:
                rec = reply.content[SECAGG]
                got = (list(rec["seed-ids"]), list(rec["key-ids"]))
                asked = (list(records[node][SECAGG]["active"]), list(records[node][SECAGG]["dropped"]))
                if got != asked or len(rec["seed-shares"]) != len(got[0]) or len(rec["key-shares"]) != len(got[1]):
                    raise ProtocolError("shares for other nodes than asked")
                for u, s in zip(got[0], rec["seed-shares"], strict=True):
                    seed_shares.setdefault(u, []).append(bytes(s))
                for u, s in zip(got[1], rec["key-shares"], strict=True):
                    key_shares.setdefault(u, []).append(bytes(s))
            except (KeyError, TypeError, ProtocolError) as err:
                self.drop(out, node, SECAGG_UNMASK, f"malformed shares ({err})")
        for v in masked:
            seed = self.rebuild(seed_shares.get(v, []), lambda s, v=v: seed_digest(s) == digests[v])
            if seed is None:
                return self.abort(out, f"the self-mask seed of {self.name(v)} could not be rebuilt from t shares")
            np.subtract(total, prg.mask(seed, size, self.ring.modulus), out=total)
        for d in {u for v in masked for u in partners[v] if u not in masked}:
            key = self.rebuild(key_shares.get(d, []), lambda s, d=d: _is_key_of(s, keys[d][1]))
            if key is None:
                return self.abort(out, f"the mask key of dropped {self.name(d)} could not be rebuilt from t shares")
            for v in masked:
                if d in partners[v]:
                    pairwise = prg.mask(pair_seed(key, keys[v][1]), size, self.ring.modulus)
                    (np.subtract if v > d else np.add)(total, pairwise, out=total)
        total &= top
        out.total, out.survivors = total, sorted(masked)
        return out

    def rebuild(self, shares: list[bytes], check: Callable[[bytes], bool]) -> bytes | None:
        """The secret behind `shares` if at least t of them rebuild one that passes `check`."""
        if len(shares) < self.threshold:
            return None
        try:
            secret = combine_shares(shares[: self.threshold])
        except ValueError:
            return None
        return secret if check(secret) else None

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

    def drop(self, out: Outcome, node: int, stage: str, why: str) -> None:
        out.dropped.setdefault(node, f"{stage}: {why}")
        log.warning("secure aggregation: %s leaves the round at %s: %s", self.name(node), stage, why)

    def abort(self, out: Outcome, why: str) -> Outcome:
        out.aborted = why
        log.warning("secure aggregation: round aborted, nothing unmasked: %s", why)
        return out


def stage_bytes(content: RecordDict) -> int:
    """A stage message's arrays and the keys, shares and ciphertexts its ConfigRecords carry."""
    carried = 0
    for record in content.config_records.values():
        for value in record.values():
            carried += sum(len(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, bytes))
    return payload_bytes(content) + carried


def _is_key_of(private_pem: bytes, public_pem: bytes) -> bool:
    try:
        return public_bytes(load_private(private_pem)) == public_pem
    except (ValueError, ProtocolError):
        return False

"""SecAgg+ (app/secagg/) against one misbehaving node (issue 48, findings 3 and 4): every stage
field is checked for its type and exact size before use, a deviation drops (never aborts on) the
node where the protocol can still finish, and the round's `culprits` names the node that deviated,
never an honest one. Nodes run the real stages of node.py (tests/test_secagg.py's `Nodes`); the
deviations are rewrites of one node's replies, as the audit's reproductions make them."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from app.protocol import SECAGG, SECAGG_KEYS, SECAGG_SHARES, SECAGG_TRAIN, SECAGG_UNMASK
from app.secagg import node as secagg_node
from app.secagg import server as secagg_server
from app.secagg.server import Outcome, SecureRound
from app.secagg.strategy import SecAggSettings, SecureFedAvg
from app.simulation.local_grid import InProcessGrid
from strategies.settings import Sampling
from strategies.tensor_ops import record_to_tensors
from tests.test_secagg import RING, Nodes, _fedavg, _masked_node, _models, _round

N = 10  # one bad node among 10: complete graph, k = 9, t = 7
BAD = 1000
EXAMPLES = [100 + 10 * i for i in range(N)]


class Evil(Nodes):
    """`Nodes` where node `BAD` (and `also`, for deviations that need two) rewrites its replies with
    `deviate(node, kind, reply, context)` after running the honest stage."""

    def __init__(self, models: list, deviate: Callable[[int, str, Message, Context], None], also: int = 0) -> None:
        super().__init__(models, EXAMPLES[: len(models)])
        self.deviate, self.bad = deviate, {BAD, also} - {0}

    def __call__(self, msg: Message, context: Context) -> Message:
        reply = super().__call__(msg, context)
        node = msg.metadata.dst_node_id
        if node in self.bad and not reply.has_error():
            self.deviate(node, msg.metadata.message_type, reply, context)
        return reply


def _run(
    deviate: Callable[[int, str, Message, Context], None], also: int = 0, n: int = N
) -> tuple[Outcome, ArrayRecord | None, list, object]:
    base, models = _models(n, seed=11)
    _, new, _, outcome, grid = _round(Evil(models, deviate, also), base, n)
    return outcome, new, models, grid


def _is_fedavg_of(new: ArrayRecord | None, models: list, survivors: list[int]) -> None:
    """The applied model is FedAvg over exactly `survivors`, within the ring's rounding."""
    assert new is not None
    weights = [EXAMPLES[v - 1000] for v in survivors]
    want = _fedavg([models[v - 1000] for v in survivors], weights)
    bound = len(survivors) * RING.step / (sum(weights) / 1000.0)
    for k, v in record_to_tensors(new).items():
        assert torch.allclose(v.double(), want[k], atol=bound, rtol=0), k


def _rec(reply: Message) -> ConfigRecord:
    return reply.content[SECAGG]


def _same_key(node: int, kind: str, reply: Message, context: Context) -> None:
    if kind == SECAGG_KEYS:
        _rec(reply)["s-pk"] = _rec(reply)["c-pk"]  # its two public keys equal


def _bad_ciphertext_for_one(node: int, kind: str, reply: Message, context: Context) -> None:
    if kind == SECAGG_SHARES:
        cts = list(_rec(reply)["ct"])
        cts[0] = b"A" * len(cts[0])  # well sized, undecryptable, for its first neighbour only
        _rec(reply)["ct"] = cts


def _bad_ciphertext_for_all(node: int, kind: str, reply: Message, context: Context) -> None:
    if kind == SECAGG_SHARES:
        _rec(reply)["ct"] = [b"A" * len(ct) for ct in _rec(reply)["ct"]]


def _bad_hash_for_one(node: int, kind: str, reply: Message, context: Context) -> None:
    if kind == SECAGG_SHARES:
        hashes = list(_rec(reply)["seed-hashes"])
        hashes[1] = bytes(32)  # ids[0] is itself: its first neighbour's share no longer matches
        _rec(reply)["seed-hashes"] = hashes


def _bad_digest(node: int, kind: str, reply: Message, context: Context) -> None:
    if kind == SECAGG_SHARES:
        _rec(reply)["seed-digest"] = bytes(32)


def _bad_shares_of_others(node: int, kind: str, reply: Message, context: Context) -> None:
    """Well formed, wrong: its revealed shares of the other survivors' seeds (its own stays right)."""
    if kind == SECAGG_UNMASK:
        rec = _rec(reply)
        rec["seed-shares"] = [
            s if u == node else bytes(len(s)) for u, s in zip(rec["seed-ids"], rec["seed-shares"], strict=True)
        ]


def _oversized_shares(node: int, kind: str, reply: Message, context: Context) -> None:
    """One MiB shares of the others' seeds (about 5 s of server CPU each before the cap)."""
    if kind == SECAGG_UNMASK:
        rec = _rec(reply)
        big = (1).to_bytes(4, "little") + os.urandom(2**20)
        rec["seed-shares"] = [s if u == node else big for u, s in zip(rec["seed-ids"], rec["seed-shares"], strict=True)]


def _false_complaint(node: int, kind: str, reply: Message, context: Context) -> None:
    """It names an honest neighbour whose share opened fine, with a valid proof of their channel key."""
    if kind == SECAGG_TRAIN:
        state = secagg_node.NodeState.from_record(context.state[secagg_node.STATE])
        accused = next(u for u in state.partners if u != node)
        proof = secagg_node.channel_proof(
            state.c_sk, state.keys[accused][0], secagg_node.complaint_context(state.round, node, accused)
        )
        reply.content[SECAGG] = ConfigRecord({"accused": [accused], "proofs": [proof]})


def _forged_complaint(node: int, kind: str, reply: Message, context: Context) -> None:
    """It names an honest neighbour with a proof it cannot have (random bytes of the right size)."""
    if kind == SECAGG_TRAIN:
        state = secagg_node.NodeState.from_record(context.state[secagg_node.STATE])
        accused = next(u for u in state.partners if u != node)
        reply.content[SECAGG] = ConfigRecord({"accused": [accused], "proofs": [os.urandom(secagg_node.PROOF_BYTES)]})


@pytest.mark.parametrize(
    ("deviate", "stage"),
    [
        (_same_key, SECAGG_KEYS),
        (_bad_ciphertext_for_one, SECAGG_SHARES),
        (_bad_hash_for_one, SECAGG_SHARES),
        (_bad_shares_of_others, SECAGG_UNMASK),
        (_oversized_shares, SECAGG_UNMASK),
    ],
    ids=["same-key", "bad-ciphertext", "bad-share-hash", "bad-share", "oversized-share"],
)
def test_one_deviating_node_among_ten_is_named_and_the_round_still_applies(
    deviate: Callable[[int, str, Message, Context], None], stage: str
) -> None:
    """The round applies FedAvg over its survivors (every honest node among them); `culprits` names
    the bad node alone, at the stage of its deviation. A node caught before its masked input is
    summed is left out of the sum; one caught later (at unmasking) stays in it."""
    outcome, new, models, _ = _run(deviate)
    assert outcome.aborted is None, outcome.aborted
    assert list(outcome.culprits) == [BAD] and outcome.culprits[BAD].startswith(stage), outcome.culprits
    honest = [v for v in range(1000, 1000 + N) if v != BAD]
    assert set(honest) <= set(outcome.survivors), outcome.survivors
    if stage == SECAGG_KEYS:
        assert BAD not in outcome.survivors
    _is_fedavg_of(new, models, outcome.survivors)


@pytest.mark.parametrize("deviate", [_false_complaint, _forged_complaint], ids=["valid-proof", "forged-proof"])
def test_a_false_complaint_blames_the_complainer_never_the_accused(
    deviate: Callable[[int, str, Message, Context], None],
) -> None:
    """A node that names an honest neighbour's share as bad is shown wrong by its own proof (the
    share opens under the proven key) or by a proof that does not verify: it is the culprit, left
    out of the sum, and the accused stays in."""
    outcome, new, models, _ = _run(deviate)
    assert outcome.aborted is None, outcome.aborted
    assert list(outcome.culprits) == [BAD] and "complain" in outcome.culprits[BAD], outcome.culprits
    assert outcome.survivors == [v for v in range(1000, 1000 + N) if v != BAD]
    _is_fedavg_of(new, models, outcome.survivors)


def test_two_nodes_advertising_one_key_are_both_dropped_and_named() -> None:
    """Keys are fresh each round and no node sees another's before the key stage ends: two nodes
    with one key copied it together. Both leave, named; the round goes on without them."""
    shared: dict[str, bytes] = {}

    def copy(node: int, kind: str, reply: Message, context: Context) -> None:
        if kind == SECAGG_KEYS:
            shared.setdefault("c", _rec(reply)["c-pk"])
            _rec(reply)["c-pk"] = shared["c"]

    outcome, new, models, _ = _run(copy, also=1005)
    assert outcome.aborted is None, outcome.aborted
    assert sorted(outcome.culprits) == [BAD, 1005]
    assert outcome.survivors == [v for v in range(1000, 1000 + N) if v not in (BAD, 1005)]
    _is_fedavg_of(new, models, outcome.survivors)


@pytest.mark.parametrize(
    ("deviate", "before_unmasking"),
    [(_bad_ciphertext_for_all, True), (_bad_digest, False)],
    ids=["bad-ciphertext-for-all", "bad-digest"],
)
def test_a_node_whose_input_cannot_be_unmasked_aborts_one_round_named_then_the_next_applies_without_it(
    deviate: Callable[[int, str, Message, Context], None], before_unmasking: bool
) -> None:
    """Undecryptable shares for every neighbour, or a seed digest its own shares contradict: its
    masked input is in the sum (it can answer first) and its seed cannot be rebuilt, so the round
    aborts; before any share is asked for when the complaints already show it. It is the one
    culprit, and a round without it (what the run's exclusion gives) applies."""
    outcome, new, _, grid = _run(deviate)
    assert new is None and outcome.aborted is not None and "1000" in outcome.aborted
    assert list(outcome.culprits) == [BAD], outcome.culprits
    asked = SECAGG_UNMASK in {m.metadata.message_type for m in grid.pushed}
    assert asked is not before_unmasking
    base, models = _models(N - 1, seed=12)
    _, new, _, outcome, _ = _round(Nodes(models, EXAMPLES[: N - 1]), base, N - 1)
    assert outcome.aborted is None and outcome.culprits == {}


@pytest.mark.parametrize(
    ("stage", "key"),
    [
        (SECAGG_KEYS, "c-pk"),
        (SECAGG_KEYS, "s-pk"),
        (SECAGG_SHARES, "seed-digest"),
        (SECAGG_SHARES, "ct"),
        (SECAGG_SHARES, "seed-hashes"),
        (SECAGG_SHARES, "dst"),
        (SECAGG_UNMASK, "seed-shares"),
        (SECAGG_UNMASK, "seed-ids"),
    ],
)
@pytest.mark.parametrize("value", [2**62, [2**62], b"x" * 5000], ids=["int", "list-of-int", "long-bytes"])
def test_a_stage_field_of_another_type_or_size_drops_the_node_and_allocates_nothing(
    stage: str, key: str, value: object
) -> None:
    """An int where bytes are expected (bytes(2**62) would allocate 4 EiB), a list of them, or bytes
    of another size: the node leaves the round at that stage, named as the culprit; the round
    goes on (at unmasking, its input is already summed and stays)."""

    def tamper(node: int, kind: str, reply: Message, context: Context) -> None:
        if kind == stage:
            _rec(reply)[key] = value

    outcome, new, models, _ = _run(tamper, n=6)
    assert outcome.aborted is None, outcome.aborted
    assert list(outcome.culprits) == [BAD] and outcome.culprits[BAD].startswith(stage), outcome.culprits
    assert BAD in outcome.dropped
    _is_fedavg_of(new, models, outcome.survivors)
    assert (BAD in outcome.survivors) is (stage == SECAGG_UNMASK)


def test_the_server_never_combines_a_share_longer_than_the_protocols(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's `combine_shares` sizes its work by the first share's length (about 5 s of CPU per
    MiB): nothing longer than a key share ever reaches it, whatever a node reveals or `rebuild` is
    handed."""
    lengths: list[int] = []
    real = secagg_server.combine_shares

    def spy(shares: list[bytes]) -> bytes:
        lengths.extend(len(s) for s in shares)
        return real(shares)

    monkeypatch.setattr(secagg_server, "combine_shares", spy)
    outcome, new, _, _ = _run(_oversized_shares)
    assert outcome.aborted is None and lengths and max(lengths) <= secagg_node.KEY_SHARE_BYTES
    good = secagg_node.create_shares(os.urandom(32), 4, 6)
    evil = (1).to_bytes(4, "little") + os.urandom(2**20)
    assert SecureRound(4, 5, RING, 60.0).rebuild([evil, *good[1:4]], lambda s: True) is None
    assert max(lengths) <= secagg_node.KEY_SHARE_BYTES


def test_every_stage_field_has_the_size_the_protocol_fixes() -> None:
    """The sizes the server holds replies to are those honest nodes produce."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat

    key = ec.generate_private_key(ec.SECP384R1())
    assert len(secagg_node.public_bytes(key)) == secagg_node.PUBLIC_KEY_BYTES
    seed_share = secagg_node.create_shares(os.urandom(32), 3, 5)[0]
    key_share = secagg_node.create_shares(secagg_node.scalar_of(secagg_node.private_bytes(key)), 3, 5)[0]
    assert (len(seed_share), len(key_share)) == (secagg_node.SEED_SHARE_BYTES, secagg_node.KEY_SHARE_BYTES)
    plain = share_keys_plaintext_concat(2**64 - 1, 7, seed_share, key_share)
    assert len(plain) == secagg_node.PLAINTEXT_BYTES
    channel = secagg_node.pair_seed(secagg_node.private_bytes(key), secagg_node.public_bytes(key))
    assert len(encrypt(channel, plain)) == secagg_node.CIPHERTEXT_BYTES


def test_a_complaint_proof_proves_the_pairs_channel_key_and_nothing_else_passes() -> None:
    """Chaum-Pedersen over P-384: the proof gives the key both nodes derive (Flower's
    `generate_shared_key`), and fails for another context, another pair or a changed byte."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key

    a, b, c = (ec.generate_private_key(ec.SECP384R1()) for _ in range(3))
    pem = secagg_node.private_bytes
    pub = secagg_node.public_bytes
    context = secagg_node.complaint_context(3, 1001, 1002)
    proof = secagg_node.channel_proof(pem(a), pub(b), context)
    assert len(proof) == secagg_node.PROOF_BYTES
    key = secagg_node.proven_channel_key(proof, pub(a), pub(b), context)
    assert key == generate_shared_key(b, a.public_key()) == secagg_node.pair_seed(pem(b), pub(a))
    assert secagg_node.proven_channel_key(proof, pub(a), pub(b), secagg_node.complaint_context(4, 1001, 1002)) is None
    assert secagg_node.proven_channel_key(proof, pub(a), pub(c), context) is None
    assert secagg_node.proven_channel_key(proof, pub(c), pub(b), context) is None
    flipped = bytearray(proof)
    flipped[-1] ^= 1
    assert secagg_node.proven_channel_key(bytes(flipped), pub(a), pub(b), context) is None
    infinity = b"\x04" + bytes(secagg_node.POINT_BYTES - 1) + proof[secagg_node.POINT_BYTES :]
    assert secagg_node.proven_channel_key(infinity, pub(a), pub(b), context) is None


def test_a_node_reveals_no_share_of_a_node_whose_share_did_not_open() -> None:
    """A holder that complained about a sender keeps none of its shares, and refuses to be asked
    for them (the server does not ask)."""
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    state = _masked_node(context)
    del state.seed_shares[3], state.key_shares[3]
    state.complaints[3] = b"p"
    secagg_node.save(context, state)
    with pytest.raises(secagg_node.ProtocolError, match="holds no shares"):
        secagg_node.reveal(ConfigRecord({"round": 1, "active": [1, 2, 3], "dropped": []}), context)
    assert (
        len(secagg_node.reveal(ConfigRecord({"round": 1, "active": [1, 2], "dropped": []}), context)["seed-shares"])
        == 2
    )


@pytest.mark.parametrize(
    "deviate",
    [_same_key, _bad_ciphertext_for_all, _bad_digest, _bad_shares_of_others, _oversized_shares, _false_complaint],
    ids=["same-key", "bad-ciphertext-for-all", "bad-digest", "bad-share", "oversized-share", "false-complaint"],
)
def test_with_one_such_node_among_ten_at_least_four_of_five_rounds_apply_and_it_alone_is_excluded(
    deviate: Callable[[int, str, Message, Context], None],
) -> None:
    """The audit's goal, through SecureFedAvg: its `culprits` feed the run's exclusion (strategy.py),
    so the bad node costs at most the round that caught it; every applied round is FedAvg over
    that round's survivors, and no honest node is ever excluded."""
    base, models = _models(N, seed=11)
    grid = InProcessGrid(Evil(models, deviate), N)
    strategy = SecureFedAvg(
        secagg=SecAggSettings(RING, 0, 0, max_weight=1000.0, on_too_few="skip"),
        sampling=Sampling(min_train_nodes=N, min_available_nodes=N),
    )
    arrays = ArrayRecord({k: Array(v.numpy()) for k, v in base.items()})
    applied = 0
    for rnd in range(1, 6):
        messages = list(strategy.configure_train(rnd, arrays, ConfigRecord({}), grid))
        new, _, outcome = strategy.secure_train(rnd, messages, lambda stage: list(grid.send_and_receive(stage)))
        assert set(outcome.culprits) <= {BAD}, outcome.culprits
        if new is not None:
            _is_fedavg_of(new, models, outcome.survivors)  # a node's update: its fixed model - the global
            applied, arrays = applied + 1, new
    assert applied >= 4 and list(strategy.excluded) == [BAD], (applied, strategy.excluded)

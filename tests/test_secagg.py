"""SecAgg+ (app/secagg/) on the real node stages and the real server protocol, with nodes whose
trained models are fixed tensors (no training): the sum equals FedAvg's, what the server holds of
a node is uniform in the ring, dropouts are recovered or abort without any unmasking, a node
refuses requests that would reveal one input, and bad configurations are refused."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from scipy import stats

from app.config.compose import load_config
from app.config.schema import ConfigError
from app.privacy.skellam import Release, epsilon, sensitivity
from app.protocol import (
    ARRAYS,
    SECAGG,
    SECAGG_KEYS,
    SECAGG_MASKED,
    SECAGG_MODULUS,
    SECAGG_SHARES,
    SECAGG_TRAIN,
    SECAGG_UNMASK,
)
from app.secagg import node as secagg_node
from app.secagg import prg
from app.secagg.dp import DistributedDP
from app.secagg.encode import node_vector
from app.secagg.ring import Layout, Ring
from app.secagg.server import SecureRound, default_threshold, neighbours
from app.secagg.strategy import SecAggSettings, SecureFedAvg
from app.simulation.local_grid import InProcessGrid
from strategies.regional import RegionalCombine
from strategies.settings import Sampling
from strategies.tensor_ops import record_to_tensors

RING = Ring(8.0, 2**22, 2**32)


class Seen:
    """What an instrumented exchange saw of each reply before the server folded it: its sender, its
    arrays (copied: the server drops a masked input's arrays once summed) and its metric keys."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, dict[str, dict[str, np.ndarray]], set[str]]] = []

    def __call__(self, reply: Message) -> None:
        if reply.has_error():
            return
        arrays = {n: {k: a.numpy().copy() for k, a in r.items()} for n, r in reply.content.array_records.items()}
        metrics = {k for m in reply.content.metric_records.values() for k in m}
        self.replies.append((reply.metadata.src_node_id, arrays, metrics))


class Nodes:
    """A ClientApp running the real stages of node.py on fixed trained models: node i's model is
    `models[i]`, its example count `examples[i]`. `fail[(node, message type)]` raises there (a node
    that crashes at that stage); `plain` keeps each node's ring vector before masking."""

    def __init__(self, models: list[dict[str, torch.Tensor]], examples: list[int]) -> None:
        self.models, self.examples = models, examples
        self.fail: set[tuple[int, str]] = set()
        self.plain: dict[int, np.ndarray] = {}

    def __call__(self, msg: Message, context: Context) -> Message:
        node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
        if (node, kind) in self.fail:
            raise RuntimeError(f"node {node} crashed at {kind}")
        record = msg.content[SECAGG]
        if kind == SECAGG_KEYS:
            out = secagg_node.advertise(record, context, node)
        elif kind == SECAGG_SHARES:
            out = secagg_node.share(record, context)
        elif kind == SECAGG_UNMASK:
            out = secagg_node.reveal(record, context)
        else:
            assert kind == SECAGG_TRAIN
            state = secagg_node.receive_shares(record, context)
            i = node - 1000
            received = msg.content[ARRAYS].to_torch_state_dict()
            gen = torch.Generator().manual_seed(i)
            vector = node_vector(self.models[i], received, self.examples[i], 0.5 + i, (0.1 * i) % 1.0, record, gen)
            self.plain[node] = vector
            masked = secagg_node.mask(state, vector, int(record[SECAGG_MODULUS]), context)
            content = RecordDict(
                {
                    ARRAYS: ArrayRecord({SECAGG_MASKED: Array(masked)}),
                    "metrics": MetricRecord({}),
                    SECAGG: secagg_node.complaints(state),
                }
            )
            return Message(content=content, reply_to=msg)
        return Message(content=RecordDict({SECAGG: out}), reply_to=msg)


def _models(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[dict, list[dict]]:
    g = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(6, 5, generator=g).to(dtype), "b": torch.randn(5, generator=g).to(dtype)}
    models = [{k: v + 0.05 * torch.randn(v.shape, generator=g).to(dtype) for k, v in base.items()} for _ in range(n)]
    return base, models


def _round(
    nodes: Nodes,
    base: dict[str, torch.Tensor],
    n: int,
    *,
    threshold: int = 0,
    degree: int = 0,
    dp: DistributedDP | None = None,
    ring: Ring = RING,
    seen: Callable[[Message], None] | None = None,
    on_too_few: str = "skip",
    regions: RegionalCombine | None = None,
) -> tuple[SecureFedAvg, ArrayRecord | None, MetricRecord | None, object, InProcessGrid]:
    grid = InProcessGrid(nodes, n)
    strategy = SecureFedAvg(
        secagg=SecAggSettings(ring, threshold, degree, max_weight=1000.0, on_too_few=on_too_few),
        dp=dp,
        sampling=Sampling(min_train_nodes=n, min_available_nodes=n),
        regions=regions,
    )
    arrays = ArrayRecord({k: Array(v.numpy()) for k, v in base.items()})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))

    def exchange(stage: list[Message]) -> list[Message]:
        replies = list(grid.send_and_receive(stage))
        for reply in replies:
            if seen is not None:
                seen(reply)
        return replies

    new, metrics, outcome = strategy.secure_train(1, messages, exchange)
    return strategy, new, metrics, outcome, grid


def _fedavg(models: list[dict], weights: list[int]) -> dict[str, torch.Tensor]:
    total = sum(weights)
    return {k: sum(m[k].double() * w for m, w in zip(models, weights, strict=True)) / total for k in models[0]}


@pytest.mark.parametrize(("n", "dtype"), [(3, torch.float32), (7, torch.float64), (12, torch.float32)])
def test_the_secure_sum_is_fedavg_within_the_quantization_error(n: int, dtype: torch.dtype) -> None:
    base, models = _models(n, dtype, seed=n)
    examples = [10 * (i + 1) + i * i for i in range(n)]  # unequal weights
    _, new, metrics, outcome, _ = _round(Nodes(models, examples), base, n)
    assert outcome.aborted is None and len(outcome.survivors) == n
    got = record_to_tensors(new)
    want = _fedavg(models, examples)
    # each node's rounding error is below one step of its weighted coordinate; divided by the weight sum
    bound = n * RING.step / (sum(examples) / 1000.0)
    for k in want:
        assert got[k].dtype == dtype
        assert torch.allclose(got[k].double(), want[k], atol=bound, rtol=0), k
    loss = sum((0.5 + i) * e for i, e in enumerate(examples)) / sum(examples)
    assert metrics["train-loss"] == pytest.approx(loss, abs=64 * n * RING.step * 1000 / sum(examples))


def test_the_secure_mean_matches_flowers_fedavg_on_the_same_replies() -> None:
    """Flower's own FedAvg (sample-weighted mean of the models) on the replies in the clear."""
    n = 5
    base, models = _models(n, seed=3)
    examples = [30, 10, 50, 20, 40]
    _, new, _, _, _ = _round(Nodes(models, examples), base, n)
    replies = [
        RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v.numpy()) for k, v in m.items()}),
                "metrics": MetricRecord({"num-examples": e}),
            }
        )
        for m, e in zip(models, examples, strict=True)
    ]
    flower = FlowerFedAvg(weighted_by_key="num-examples")
    arrays, _ = flower.aggregate_train(1, [Message(content=r, dst_node_id=1, message_type="train") for r in replies])
    for k, v in record_to_tensors(arrays).items():
        assert torch.allclose(record_to_tensors(new)[k], v, atol=1e-4), k


def test_every_reply_the_server_receives_is_masked_and_uniform_in_the_ring() -> None:
    """An instrumented exchange sees every reply: none carries a model tensor or a count, each
    masked vector is statistically independent of the node's plain vector and uniform."""
    n = 6
    base, models = _models(n, seed=1)
    nodes = Nodes(models, [100] * n)
    seen = Seen()
    _round(nodes, base, n, seen=seen)
    masked = {}
    for src, arrays, metrics in seen.replies:
        for name, record in arrays.items():
            assert list(record) == [SECAGG_MASKED], f"a reply carries {name}: {list(record)}"
            masked[src] = record[SECAGG_MASKED].astype(np.uint64)
        assert "num-examples" not in metrics
    assert set(masked) == set(nodes.plain)
    for node, vector in masked.items():
        plain = nodes.plain[node]
        assert not np.array_equal(vector, plain)
        # the top 4 bits of a plain small update are all 0 or 15 (two's complement); masked: uniform
        top = (vector >> np.uint64(28)).astype(np.int64)
        counts = np.bincount(top, minlength=16)
        assert stats.chisquare(counts).pvalue > 1e-4, counts
        assert np.bincount((plain >> np.uint64(28)).astype(np.int64), minlength=16)[1:15].sum() == 0


def test_what_the_server_holds_of_one_node_is_uniform_over_many_rounds() -> None:
    """One coordinate of one node's masked input over 400 rounds (fresh keys and seeds each time):
    uniform in Z_M (chi-square on 16 bins), though the node sends the same update every round."""
    ring = Ring(8.0, 2**10, 2**16)
    base, models = _models(3, seed=2)
    values = []
    for _ in range(400):
        nodes = Nodes(models, [10, 20, 30])
        seen = Seen()
        _round(nodes, base, 3, ring=ring, seen=seen)
        first = next(arrays for src, arrays, _ in seen.replies if arrays and src == 1000)
        values.append(int(first[ARRAYS][SECAGG_MASKED][0]))
    counts = np.bincount(np.array(values) >> 12, minlength=16)
    assert stats.chisquare(counts).pvalue > 1e-4, counts


def test_fewer_than_t_shares_rebuild_nothing_and_t_rebuild_the_secret() -> None:
    secret = bytes(range(32))
    shares = create_shares(secret, 4, 6)
    protocol = SecureRound(4, 5, RING, 60.0)
    assert protocol.rebuild(shares[:3], lambda s: s == secret) is None
    assert protocol.rebuild(shares[2:6], lambda s: s == secret) == secret


def test_a_node_that_drops_after_sending_its_masked_input_is_recovered() -> None:
    n = 6
    base, models = _models(n, seed=4)
    examples = [10, 20, 30, 40, 50, 60]
    nodes = Nodes(models, examples)
    nodes.fail = {(1002, SECAGG_UNMASK)}
    _, new, _, outcome, _ = _round(nodes, base, n)
    assert outcome.aborted is None and 1002 in outcome.survivors and "query.secagg_unmask" in outcome.dropped[1002]
    want = _fedavg(models, examples)
    for k, v in record_to_tensors(new).items():
        assert torch.allclose(v.double(), want[k], atol=1e-4)


def test_a_node_that_drops_before_its_masked_input_leaves_the_sum_of_the_others() -> None:
    n = 6
    base, models = _models(n, seed=5)
    examples = [10, 20, 30, 40, 50, 60]
    nodes = Nodes(models, examples)
    nodes.fail = {(1004, SECAGG_TRAIN)}
    _, new, _, outcome, _ = _round(nodes, base, n)
    assert outcome.aborted is None and 1004 not in outcome.survivors and 1004 in outcome.dropped
    keep = [i for i in range(n) if i != 4]
    want = _fedavg([models[i] for i in keep], [examples[i] for i in keep])
    for k, v in record_to_tensors(new).items():
        assert torch.allclose(v.double(), want[k], atol=1e-4)


def test_n_minus_t_plus_one_dropouts_abort_before_anything_is_unmasked() -> None:
    n = 7
    t = default_threshold(n)  # complete graph: k + 1 = n
    base, models = _models(n, seed=6)
    nodes = Nodes(models, [10] * n)
    nodes.fail = {(1000 + i, SECAGG_TRAIN) for i in range(n - t + 1)}
    strategy, new, metrics, outcome, grid = _round(nodes, base, n)
    assert new is None and metrics is None and outcome.aborted and "fewer than the threshold" in outcome.aborted
    assert outcome.total is None
    assert SECAGG_UNMASK not in {m.metadata.message_type for m in grid.pushed}, "a share request went out"
    assert strategy.train_report.policy.startswith("aborted")
    with pytest.raises(RuntimeError, match="aborted"):
        _round(nodes, base, n, on_too_few="stop")


def test_a_node_with_malformed_keys_is_dropped_named_and_the_round_goes_on() -> None:
    n = 5
    base, models = _models(n, seed=7)
    nodes = Nodes(models, [10, 20, 30, 40, 50])

    def tamper(node: int, reply: Message) -> Message:
        if node == 1001 and reply.metadata.message_type == SECAGG_KEYS and not reply.has_error():
            reply.content[SECAGG]["s-pk"] = b"not a key"
        return reply

    grid = InProcessGrid(nodes, n, tamper=tamper)
    strategy = SecureFedAvg(
        secagg=SecAggSettings(RING, 3, 0, 1000.0), sampling=Sampling(min_train_nodes=n, min_available_nodes=n)
    )
    arrays = ArrayRecord({k: Array(v.numpy()) for k, v in base.items()})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))
    new, _, outcome = strategy.secure_train(1, messages, lambda m: list(grid.send_and_receive(m)))
    assert "malformed keys" in outcome.dropped[1001] and 1001 not in outcome.survivors
    want = _fedavg([models[i] for i in (0, 2, 3, 4)], [10, 30, 40, 50])
    for k, v in record_to_tensors(new).items():
        assert torch.allclose(v.double(), want[k], atol=1e-4)


def _masked_node(context: Context, node: int = 1, others: tuple[int, ...] = (2, 3)) -> secagg_node.NodeState:
    """A node that has gone through stages 1-3 with neighbours `others` (their keys made here)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    secagg_node.advertise(ConfigRecord({"round": 1, "threshold": 2, "neighbours": list(others)}), context, node)
    mine = secagg_node.NodeState.from_record(context.state[secagg_node.STATE])
    keys = {o: [ec.generate_private_key(ec.SECP384R1()) for _ in range(2)] for o in others}
    ids = [node, *others]
    c_pk = [secagg_node.public_bytes(secagg_node.load_private(mine.c_sk))] + [
        secagg_node.public_bytes(keys[o][0]) for o in others
    ]
    s_pk = [secagg_node.public_bytes(secagg_node.load_private(mine.s_sk))] + [
        secagg_node.public_bytes(keys[o][1]) for o in others
    ]
    secagg_node.share(ConfigRecord({"round": 1, "ids": ids, "c-pk": c_pk, "s-pk": s_pk}), context)
    state = secagg_node.NodeState.from_record(context.state[secagg_node.STATE])
    state.partners = list(others)
    for o in others:
        state.seed_shares[o], state.key_shares[o] = b"s" * 20, b"k" * 20
    secagg_node.mask(state, np.zeros(4, dtype=np.uint64), 2**16, context)
    return state


def test_a_node_refuses_to_reveal_both_secrets_of_one_node_or_to_reveal_twice() -> None:
    """Flower's legacy mod answers an unmask request that names a node both as survivor and as
    dropped (both its seed and its key: its input in the clear); ours refuses, and answers once."""
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    _masked_node(context)
    both = ConfigRecord({"round": 1, "active": [1, 2], "dropped": [2]})
    with pytest.raises(secagg_node.ProtocolError, match="both"):
        secagg_node.reveal(both, context)
    ok = ConfigRecord({"round": 1, "active": [1, 2], "dropped": [3]})
    assert len(secagg_node.reveal(ok, context)["seed-shares"]) == 2
    with pytest.raises(secagg_node.ProtocolError, match="revealed"):
        secagg_node.reveal(ConfigRecord({"round": 1, "active": [1, 3], "dropped": [2]}), context)


def test_a_node_refuses_stages_out_of_order_and_a_threshold_of_one() -> None:
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(secagg_node.ProtocolError, match="no secure-aggregation state"):
        secagg_node.share(ConfigRecord({"round": 1, "ids": [], "c-pk": [], "s-pk": []}), context)
    with pytest.raises(secagg_node.ProtocolError, match="threshold"):
        secagg_node.advertise(ConfigRecord({"round": 1, "threshold": 1, "neighbours": [2, 3]}), context, 1)


def test_flowers_mask_generator_folds_seeds_to_32_bits_and_ours_does_not() -> None:
    """Two seeds whose 4-byte words XOR to the same value give Flower's `pseudo_rand_gen` the same
    mask (a 2^32 search finds any mask); AES-CTR masks of the two differ."""
    a = bytes(range(32))
    b = a[4:8] + a[0:4] + a[8:]  # the same words in another order: the same XOR fold
    assert np.array_equal(pseudo_rand_gen(a, 2**32, [(64,)])[0], pseudo_rand_gen(b, 2**32, [(64,)])[0])
    assert not np.array_equal(prg.mask(a, 64, 2**32), prg.mask(b, 64, 2**32))
    words = prg.mask(a, 200_000, 2**16)
    assert words.max() < 2**16 and stats.chisquare(np.bincount(words >> np.uint64(12), minlength=16)).pvalue > 1e-4


def test_the_graph_is_k_regular_and_complete_for_small_cohorts() -> None:
    nodes = list(range(50))
    graph = neighbours(nodes, 12)
    assert all(len(v) == 12 for v in graph.values())
    assert all(u in graph[v] for u in graph for v in graph[u])  # symmetric
    assert all(len(v) == 9 for v in neighbours(list(range(10)), 20).values())


def test_distributed_dp_charges_the_noise_the_survivors_added() -> None:
    """A round where one of 6 nodes drops before its masked input: the accountant charges 5/6 of the
    planned variance, and epsilon equals the Skellam accountant's on that release alone; the noise
    in the released sum has that variance (zero updates, many coordinates)."""
    n, dim = 6, 2000
    base = {"w": torch.zeros(dim)}
    models = [{"w": torch.zeros(dim)} for _ in range(n)]
    ring = Ring(1.0, 2**16, 2**40)
    dp = DistributedDP(noise_multiplier=1.0, clip_norm=0.5, delta=1e-5, ring=ring, dim=dim)
    nodes = Nodes(models, [10] * n)
    nodes.fail = {(1003, SECAGG_TRAIN)}
    strategy, new, _, outcome, _ = _round(nodes, base, n, dp=dp, ring=ring, threshold=3)
    assert len(outcome.survivors) == 5
    per_node = dp.plan(n)[0]
    assert dp.releases[0].mu == pytest.approx(per_node * 5)
    l1, l2 = sensitivity(0.5, 1 / ring.step, dim)
    assert dp.epsilon() == pytest.approx(epsilon([Release(per_node * 5, l1, l2)], 1e-5)[0])
    full = DistributedDP(noise_multiplier=1.0, clip_norm=0.5, delta=1e-5, ring=ring, dim=dim)
    full.account(n, n, None)
    assert dp.epsilon() > full.epsilon()  # the dropped node's noise is missing
    released = record_to_tensors(new)["w"].double() * n  # the noised sum, float units
    variance = float(released.var())
    expected = per_node * 5 * ring.step**2
    assert variance == pytest.approx(expected, rel=5 * math.sqrt(2 / dim))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ("secagg=plus strategy=krum", "strategy.name"),
        ("secagg=plus strategy=fedbuff", "strategy.name"),
        ("secagg=plus privacy=central", "privacy.name"),
        ("secagg=plus ledger.contribution=loo", "ledger.contribution"),
        ("secagg=plus compression=topk", "compression"),
        ("secagg=plus compression=int8 privacy=distributed", "compression"),
        ("secagg=plus compression.downlink=fp16", "compression"),
        ("secagg=plus secagg.threshold=1", "secagg.threshold"),
        ("secagg=plus secagg.modulus_range=1000", "secagg.modulus_range"),
        ("privacy=distributed", "privacy.name"),
        ("secagg=plus privacy=distributed privacy.clip_norm=20", "privacy.clip_norm"),
    ],
)
def test_what_needs_an_update_in_the_clear_is_refused_with_the_reason(overrides: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert key in str(err.value), str(err.value)


def test_a_ring_too_small_for_the_cohort_is_refused_before_a_round() -> None:
    strategy = SecureFedAvg(
        secagg=SecAggSettings(Ring(8.0, 2**22, 2**24), 0, 0, 1000.0), sampling=Sampling(min_train_nodes=10)
    )
    problem = strategy.node_count_problem(10)
    assert problem is not None and "modulus_range" in problem


def test_the_layout_round_trips_tensors_and_extras() -> None:
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "n": torch.tensor(3), "b": torch.ones(2)}
    layout = Layout.of(tensors, ["weight", "loss"])
    assert layout.keys == ("a", "b") and layout.size == 10
    vec = layout.flatten(tensors, {"weight": 0.5, "loss": 32.0}).numpy()
    back, extras = layout.split(vec)
    assert torch.equal(back["a"], tensors["a"].double()) and extras == {"weight": 0.5, "loss": 32.0}
    ring = Ring(8.0, 2**22, 2**32)
    assert np.allclose(ring.decode(ring.encode(torch.tensor([-7.5, 0.0, 3.25]), None)), [-7.5, 0.0, 3.25])


def test_compression_int8_quantizes_once_into_a_two_byte_ring() -> None:
    """compression=int8: Z_2^16 with 2^13 steps for 5 nodes (5 x 2^13 < 2^16), 2 bytes a coordinate
    on the wire, and the mean still FedAvg's within the coarser step."""
    n = 5
    settings = SecAggSettings(Ring(1.0, 2**22, 2**32), max_weight=1000.0, compact=True)
    ring = settings.ring_for(n)
    assert (ring.modulus, ring.quantization_range) == (2**16, 2**13) and ring.room(n) is None
    assert settings.ring_for(50).quantization_range == 2**10
    base, models = _models(n, seed=8)
    examples = [100, 200, 300, 400, 500]
    seen = Seen()
    grid = InProcessGrid(Nodes(models, examples), n)
    strategy = SecureFedAvg(secagg=settings, sampling=Sampling(min_train_nodes=n, min_available_nodes=n))
    arrays = ArrayRecord({k: Array(v.numpy()) for k, v in base.items()})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))

    def exchange(stage: list[Message]) -> list[Message]:
        replies = list(grid.send_and_receive(stage))
        for reply in replies:
            seen(reply)
        return replies

    new, _, outcome = strategy.secure_train(1, messages, exchange)
    masked = [arrays[ARRAYS][SECAGG_MASKED] for _, arrays, _ in seen.replies if arrays]
    assert len(masked) == n and all(m.dtype == np.uint16 for m in masked)
    want = _fedavg(models, examples)
    bound = n * ring.step / (sum(examples) / 1000.0)
    for k, v in record_to_tensors(new).items():
        assert torch.allclose(v.double(), want[k], atol=bound, rtol=0), k


def test_a_secure_federation_with_the_real_clientapp_records_sums_not_updates(tmp_path) -> None:  # noqa: ANN001
    """The real ClientApp and ServerApp loop in process: the model learns; each row names the
    survivors and the sums' hashes; the ledger verifies and records each node's masked input's hash
    and no weight; no reply metric reveals a count, a loss or an accuracy of one node."""
    import json

    from app.client_app import app as client_app
    from app.ledger.verify import verify_run
    from app.tools.in_process import run_in_process

    carried: list[set[str]] = []  # every reply's array names, as the grid hands it to the server

    def instrument(node: int, reply: Message) -> Message:
        if not reply.has_error():
            carried.append({k for record in reply.content.array_records.values() for k in record})
        return reply

    summary, grid = run_in_process(
        "secagg=plus federation.rounds=2 federation.min_train_nodes=4 federation.min_available_nodes=4 "
        "tracking.tensorboard=false name=secure",
        tmp_path,
        grid=InProcessGrid(client_app, 4, tamper=instrument),
    )
    assert carried and all(keys <= {SECAGG_MASKED} for keys in carried), carried
    assert sum(keys == {SECAGG_MASKED} for keys in carried) == 2 * 4  # one masked input per node and round
    run = tmp_path / "secure"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and rows[-1]["accuracy"] > 0.3, rows[-1]
    entries = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    for row, entry in zip(rows, entries, strict=True):
        assert row["num_missing"] == 0 and row["num_clients"] == 4 and row["secagg"]["aborted"] is None
        assert entry["secagg"] == {k: row["secagg"][k] for k in ("survivors", "masked_sum_sha256", "sum_sha256")}
        for node in entry["nodes"]:
            assert node["outcome"] == "applied" and len(node["reply_sha256"]) == 64
            assert "weight" not in node and "reported_examples" not in node
    assert verify_run(run) == []
    kinds = {msg.metadata.message_type for msg in grid.pushed}
    assert "train" not in kinds and {SECAGG_KEYS, SECAGG_SHARES, SECAGG_TRAIN, SECAGG_UNMASK} <= kinds, kinds

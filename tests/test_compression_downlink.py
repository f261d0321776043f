"""The global model on the downlink (app/compression/downlink.py): the server's per-node copies
match what the nodes rebuild, a delta's remainder is carried forward, and a node that lost its
copy gets the whole model again."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from app.compression.downlink import Downlink, receive
from app.config.schema import CompressionConfig
from app.protocol import DOWNLINK
from app.run.results import read_rows
from app.tools.in_process import run_in_process
from strategies.replies import payload_bytes

# a constant lr: three short rounds that must learn
FAST = "federation.rounds=3 train.epochs=1 seed=3 train.lr_schedule=constant "


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(16, 8, 3, 3, generator=g),
        "fc.bias": torch.randn(10, generator=g),
        "bn.num_batches_tracked": torch.tensor(seed),
    }


def _like() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _model(0).items()}


def _send(down: Downlink, node: int, model: dict, state: RecordDict, cfg: CompressionConfig) -> dict:
    arrays, entries = down.task(node, model, ArrayRecord(model))
    return receive(arrays, ConfigRecord(entries), state, _like(), cfg), arrays, entries


def test_fp16_downlink_sends_the_model_in_half_precision():
    cfg = CompressionConfig(downlink="fp16")
    down, model = Downlink(cfg), _model(1)
    got, arrays, entries = _send(down, 7, model, RecordDict(), cfg)
    assert entries == {DOWNLINK: "fp16"}
    assert payload_bytes(RecordDict({"a": arrays})) < payload_bytes(RecordDict({"a": ArrayRecord(model)})) / 1.9
    for k, t in model.items():
        expected = t.half().float() if t.is_floating_point() else t
        assert got[k].dtype == t.dtype and torch.equal(got[k], expected), k


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_delta_copies_match_and_track_the_global_model(codec):
    """Over rounds the node's copy is exactly the server's record of it, and its distance to the
    global model stays at one step's remainder: the delta carries what it left out last time."""
    cfg = CompressionConfig(name=codec, ratio=0.2, downlink="delta")
    down, state, model = Downlink(cfg, seed=1), RecordDict(), _model(0)
    got, _, entries = _send(down, 3, model, state, cfg)
    assert entries[DOWNLINK] == "full" and all(torch.equal(got[k], model[k]) for k in model)
    down.settle(3, True)
    drift = torch.zeros_like(model["conv.weight"])
    for step in range(1, 30):
        change = 0.01 * _model(100 + step)["conv.weight"]
        drift += change
        model = {**model, "conv.weight": model["conv.weight"] + change, "bn.num_batches_tracked": torch.tensor(step)}
        got, arrays, entries = _send(down, 3, model, state, cfg)
        assert entries[DOWNLINK] == "delta"
        held = down._pending[3][1]
        assert all(torch.equal(got[k], held[k]) for k in model)  # the server knows exactly what the node has
        assert torch.equal(got["bn.num_batches_tracked"], torch.tensor(step))
        down.settle(3, True)
    gap = (model["conv.weight"] - got["conv.weight"]).norm()
    assert gap < 0.25 * drift.norm(), (gap, drift.norm())  # without carrying the remainder it would grow with it
    assert payload_bytes(RecordDict({"a": arrays})) < payload_bytes(RecordDict({"a": ArrayRecord(model)})) / 3


def test_delta_falls_back_to_the_whole_model_after_a_failed_task_or_eviction():
    cfg = CompressionConfig(name="int8", downlink="delta", downlink_nodes=2)
    down, model = Downlink(cfg), _model(0)
    kinds = {}
    for node in (1, 2, 3):  # three new nodes: the first one is evicted (only two copies kept)
        kinds[node] = down.task(node, model, ArrayRecord(model))[1][DOWNLINK]
        down.settle(node, True)
    assert set(kinds.values()) == {"full"} and down.nodes_held == 2
    assert down.task(1, model, ArrayRecord(model))[1][DOWNLINK] == "full"  # evicted
    down.settle(1, False)  # an error reply: the server cannot know which copy node 1 holds
    assert down.task(1, model, ArrayRecord(model))[1][DOWNLINK] == "full"
    assert down.task(3, model, ArrayRecord(model))[1][DOWNLINK] == "delta"


def test_a_node_without_the_deltas_base_refuses_it_with_a_clear_error():
    cfg = CompressionConfig(name="int8", downlink="delta")
    down, state, model = Downlink(cfg), RecordDict(), _model(0)
    _send(down, 5, model, state, cfg)
    down.settle(5, True)
    arrays, entries = down.task(5, _model(1), ArrayRecord(_model(1)))
    with pytest.raises(ValueError, match="holds no copy.*restarted"):
        receive(arrays, ConfigRecord(entries), RecordDict(), _like(), cfg)


def test_a_delta_needs_a_codec():
    with pytest.raises(ValueError, match="compression.name"):
        Downlink(CompressionConfig(downlink="delta"))


def _wipe_after_first_task(grid_ref: dict):  # noqa: ANN202
    """Node 1000 loses its Context state after its first task, as a restarted SuperNode does."""
    seen = []

    def tamper(node_id: int, reply: Message) -> Message:
        if node_id == 1000 and not seen:
            seen.append(True)
            grid_ref["grid"].contexts[1000].state = RecordDict()
        return reply

    return tamper


@pytest.mark.parametrize("downlink", ["compression.downlink=fp16", "compression=int8 compression.downlink=delta"])
def test_a_federation_with_a_compressed_downlink_trains(tmp_path, downlink):
    summary, _ = run_in_process(FAST + downlink, tmp_path, nodes=3)
    rows = read_rows(summary["run_dir"])
    assert summary["status"] == "completed" and all(r["num_rejected"] == 0 for r in rows)
    full = rows[0]["bytes_up"] * (4 if "int8" in downlink else 1)  # int8 replies are a quarter of the model
    assert all(r["bytes_down"] < full / 1.9 for r in rows[1:]), [r["bytes_down"] for r in rows]
    assert rows[-1]["accuracy"] > 0.5


def test_a_restarted_node_gets_the_whole_model_and_trains_again(tmp_path):
    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid

    ref: dict = {}
    grid = ref["grid"] = InProcessGrid(client_app, 3, tamper=_wipe_after_first_task(ref))
    summary, _ = run_in_process(FAST + "compression=int8 compression.downlink=delta", tmp_path, grid=grid)
    rows = read_rows(summary["run_dir"])
    assert summary["status"] == "completed"
    assert rows[0]["num_clients"] == 3
    (failed,) = rows[1]["rejected"]  # round 2: a delta from a copy node 1000 no longer has
    assert failed["node_id"] == 1000 and "restarted" in failed["reason"], failed
    assert rows[2]["num_clients"] == 3 and rows[2]["num_rejected"] == 0  # round 3: whole model, trains again


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        "compression=topk compression.ratio=0.1 compression.downlink=delta strategy=fedbuff strategy.buffer_size=2",
        "compression=int8 compression.downlink=delta strategy=krum strategy.num_byzantine=0",
        "compression.downlink=fp16 strategy=median strategy.num_byzantine=0",
        "compression=int8 compression.downlink=delta privacy=central privacy.noise_multiplier=0.1",
        "compression.downlink=fp16 privacy=local privacy.noise_multiplier=0.5",
    ],
)
def test_every_strategy_and_privacy_mode_runs_with_a_compressed_downlink(tmp_path, overrides):
    summary, _ = run_in_process(FAST + overrides, tmp_path, nodes=3)
    rows = read_rows(summary["run_dir"])
    assert summary["status"] == "completed", summary
    assert all(r.get("num_rejected", 0) == 0 and r.get("num_failed", 0) == 0 for r in rows), rows

"""A compressed uplink end to end: the real ClientApp encodes, the server decodes before screening,
and every strategy and privacy mode aggregates ordinary models (app/compression/packing.py)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import message_to_proto

from app.client_app import app as client_app
from app.compression.codecs import decode, encode, unbundle
from app.compression.packing import PAYLOAD, RESIDUAL, pack, residual_file, unpack, update_of
from app.config.compose import load_config
from app.config.schema import CompressionConfig
from app.run.results import read_rows
from app.simulation.local_grid import InProcessGrid
from app.tools.in_process import run_in_process
from strategies.fedavg import FedAvg
from strategies.replies import Screened, ValidReply
from strategies.tensor_ops import weighted_mean
from tests.helpers import reply_to_same_task

FAST = "federation.rounds=2 train.epochs=1 seed=3 "


def _run(overrides: str, tmp_path, nodes: int = 3, **kw):  # noqa: ANN003, ANN202
    summary, grid = run_in_process(FAST + overrides, tmp_path, nodes=nodes, **kw)
    return summary, read_rows(summary["run_dir"]), grid


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        "compression=fp16",
        "compression=bf16",
        "compression=int8",
        "compression=topk compression.ratio=0.1",
        "compression=topk compression.quantize_values=true compression.error_feedback=false",
        "compression=int8 strategy=krum strategy.num_byzantine=0",
        "compression=topk strategy=multikrum strategy.num_byzantine=0 strategy.num_selected=2",
        "compression=int8 strategy=median strategy.num_byzantine=0",
        "compression=topk strategy=trimmed_mean strategy.num_byzantine=0 strategy.trim_ratio=0.2",
        "compression=int8 strategy=fedbuff strategy.buffer_size=2 federation.rounds=3",
        "compression=topk strategy=fedbuff strategy.buffer_size=2 strategy.buffer_aggregator=median "
        "strategy.num_byzantine=0 federation.rounds=3",
        "compression=int8 privacy=central privacy.noise_multiplier=0.1",
        "compression=topk privacy=local privacy.noise_multiplier=0.5",
    ],
)
def test_every_strategy_and_privacy_mode_runs_with_a_compressed_uplink(tmp_path, overrides):
    summary, rows, _ = _run(overrides, tmp_path)
    assert summary["status"] == "completed", summary
    assert all(r.get("num_rejected", 0) == 0 for r in rows), [
        r.get("rejected") for r in rows
    ]  # central DP: not reported
    sizes = [
        (r["bytes_up"], r["bytes_down"]) for r in rows if r["bytes_down"] is not None
    ]  # FedBuff: a step may send none
    assert sizes and all(up < down / 1.9 for up, down in sizes), sizes
    if "train" in rows[-1]:  # central DP leaves clients' metrics out of the rows
        assert rows[-1]["train"]["encode-s"] > 0
    assert all(r["unpack_s"] > 0 for r in rows if r.get("num_clients")), rows  # the server's side of the cost


def test_the_server_aggregates_what_the_nodes_sent(tmp_path):
    """One node, fp16: the new global model is the received model plus the node's update in
    half precision, which no uncompressed run gives (the error is there, and it is fp16's)."""
    summary, rows, grid = _run(
        "compression=fp16 federation.min_train_nodes=1 federation.min_available_nodes=1", tmp_path, nodes=1
    )
    final = torch.load(f"{summary['run_dir']}/model_final.pt", weights_only=True)
    sent = [m for m in grid.pushed if m.metadata.message_type == "train"][-1]
    received = sent.content["arrays"].to_torch_state_dict()
    delta = {k: final[k] - received[k] for k in received}
    halves = {k: d.half().float() for k, d in delta.items()}
    for k in received:  # the decoded update is exactly an fp16 value (added to an fp32 model)
        torch.testing.assert_close(delta[k], halves[k], rtol=1e-3, atol=1e-6)
    assert rows[-1]["bytes_up"] < rows[-1]["bytes_down"] / 1.9


def _corrupt(kind: str, overrides: str):  # noqa: ANN202
    """A grid whose node 1000 sends a malformed payload of `kind` (built from its real reply)."""
    cfg = load_config(overrides)[0].compression
    settings = {"ratio": cfg.ratio, "quantize_values": cfg.quantize_values}

    def tamper(node_id: int, reply: Message) -> Message:
        if node_id != 1000:
            return reply
        task = next(m for m in grid.pushed if m.metadata.message_id == reply.metadata.reply_to_message_id)
        like = task.content["arrays"].to_torch_state_dict()
        payload = torch.from_numpy(reply.content["arrays"][PAYLOAD].numpy().copy())
        parts = unbundle(payload, like, cfg.name, **settings)  # views into payload: edits land there
        arrays = {PAYLOAD: payload}
        if kind == "index_out_of_range":
            idx = next(t for k, t in parts.items() if k.endswith("/idx"))
            idx[-1] = torch.iinfo(idx.dtype).max if idx.dtype != torch.uint16 else 65535
        elif kind == "nan_scale":
            next(t for k, t in parts.items() if k.endswith("/scale"))[0] = float("nan")
        elif kind == "wrong_size":
            arrays[PAYLOAD] = payload[:-1]
        elif kind == "extra_array":
            arrays["more"] = payload[:8]
        record = ArrayRecord({k: Array(v.numpy()) for k, v in arrays.items()})
        return Message(
            RecordDict({"arrays": record, "metrics": reply.content["metrics"]}), reply_to=reply_to_same_task(reply)
        )

    grid = InProcessGrid(client_app, 3, tamper=tamper)
    return grid


@pytest.mark.parametrize(
    ("kind", "mode", "words"),
    [
        ("index_out_of_range", "compression=topk compression.ratio=0.05", "out of range"),
        ("nan_scale", "compression=int8", "scale"),
        ("wrong_size", "compression=int8", "bytes, expected"),
        ("extra_array", "compression=topk compression.quantize_values=true", "expected one array"),
    ],
)
def test_a_malformed_compressed_reply_is_rejected_with_its_node_and_the_round_goes_on(tmp_path, kind, mode, words):
    summary, rows, _ = _run(mode, tmp_path, grid=_corrupt(kind, FAST + mode))
    assert summary["status"] == "completed"
    for row in rows:
        assert row["num_clients"] == 2 and row["num_rejected"] == 1 and row["model_updated"]
        (rejection,) = row["rejected"]
        assert rejection["node_id"] == 1000 and "compressed update" in rejection["reason"], rejection
        assert words in rejection["reason"], rejection


def test_bytes_up_is_the_serialised_reply_less_the_message_overhead(tmp_path):
    replies = []

    def keep(node_id: int, reply: Message) -> Message:
        replies.append(reply)
        return reply

    _, rows, _ = _run("compression=int8 federation.rounds=1", tmp_path, tamper=keep)
    serialised = [message_to_proto(r).ByteSize() for r in replies]
    overhead = [s - rows[0]["bytes_up"] for s in serialised]
    assert all(0 < o < 4096 for o in overhead), (serialised, rows[0]["bytes_up"])  # metadata and metrics


def test_error_feedback_keeps_the_residual_in_the_node_state_and_sends_it_later():
    """pack/unpack over rounds: the server's sum of decoded updates plus the node's residual is the
    sum of the true updates (topk 5%), and the residual lives in the node's state."""
    cfg = CompressionConfig(name="topk", ratio=0.05)
    gen = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(40, 30, generator=gen), "steps": torch.tensor(3)}
    state, total_true, total_sent = RecordDict(), torch.zeros(40, 30), torch.zeros(40, 30)
    for _ in range(6):
        trained = {"w": base["w"] + 0.01 * torch.randn(40, 30, generator=gen), "steps": base["steps"] + 1}
        total_true += trained["w"] - base["w"]
        model = unpack(pack(trained, base, cfg, state), base, cfg)
        assert torch.equal(model["steps"], trained["steps"])  # integer buffers: exact, not an update
        total_sent += model["w"] - base["w"]
        base = model
    residual = state[RESIDUAL].to_torch_state_dict()
    torch.testing.assert_close(total_sent + residual["w"], total_true, rtol=0, atol=1e-5)
    assert residual["w"].abs().sum() > 0  # topk left something for later


def test_the_residual_survives_a_restart_with_a_state_directory(tmp_path):
    """A node that restarts (a new, empty Context state) picks its residual up from its state
    directory, so the sum of what it sent still equals the sum of its true updates; without a
    directory it starts again from zero and that remainder is lost."""
    cfg = CompressionConfig(name="topk", ratio=0.05)
    gen = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(40, 30, generator=gen)}
    saved = residual_file(str(tmp_path / "state"), run_id=7)
    totals = {}
    for directory in (saved, None):
        state, total_true, total_sent = RecordDict(), torch.zeros(40, 30), torch.zeros(40, 30)
        g = torch.Generator().manual_seed(2)
        for step in range(6):
            if step == 3:
                state = RecordDict()  # the SuperNode restarted: its Context state is new
            trained = {"w": base["w"] + 0.01 * torch.randn(40, 30, generator=g)}
            total_true += trained["w"] - base["w"]
            total_sent += unpack(pack(trained, base, cfg, state, saved=directory), base, cfg)["w"] - base["w"]
        totals[directory] = (total_true - total_sent - state[RESIDUAL].to_torch_state_dict()["w"]).abs().max()
    assert totals[saved] < 1e-5  # nothing lost across the restart
    assert totals[None] > 1e-3  # the remainder before the restart is gone
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]  # no temporary file left behind


@pytest.mark.parametrize("name", ["topk", "int8"])
def test_fedavg_adds_compressed_updates_into_its_mean_without_a_dense_copy_per_reply(name):
    """FedAvg's mean of compressed replies equals the weighted mean of the dense models, and a
    topk or int8 reply is never turned into a dense model on the way."""
    cfg = CompressionConfig(name=name, ratio=0.05)
    gen = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(64, 80, generator=gen), "b": torch.randn(80, generator=gen), "n": torch.tensor(4)}
    replies = []
    for i, weight in enumerate((10.0, 30.0, 5.0)):
        trained = {"w": base["w"] + 0.1 * torch.randn(64, 80, generator=gen), "b": base["b"], "n": torch.tensor(4 + i)}
        model = unpack(pack(trained, base, cfg, RecordDict(), torch.Generator().manual_seed(i)), base, cfg)
        replies.append(
            ValidReply(node_id=i, weight=weight, metrics=MetricRecord({"num-examples": weight}), arrays=model)
        )
    strategy = FedAvg()
    strategy._global = base
    out = strategy.aggregate_models(1, Screened(valid=replies))
    assert all("w" not in r.arrays._dense for r in replies)  # never built densely
    dense = [{k: r.arrays[k] for k in base} for r in replies]  # now build them: the reference mean
    expected = weighted_mean(dense, [r.weight for r in replies], torch.device("cpu"))
    for k in base:
        torch.testing.assert_close(out[k], expected[k], rtol=1e-5, atol=1e-6)
    assert out["n"].dtype == torch.int64 and int(out["n"]) == round((10 * 4 + 30 * 5 + 5 * 6) / 45)


def test_update_of_is_the_difference_for_floats_and_the_value_otherwise():
    trained = {"w": torch.tensor([1.5, 2.0]), "n": torch.tensor(7)}
    received = {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(5)}
    out = update_of(trained, received)
    assert torch.equal(out["w"], torch.tensor([0.5, 1.0])) and int(out["n"]) == 7
    parts = encode(out, "fp16")
    assert torch.equal(decode(parts, received, "fp16")["n"], torch.tensor(7))

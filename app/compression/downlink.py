"""The global model on the downlink: what a training task carries (`Downlink`, on the server) and
the model a node rebuilds from it (`receive`, in the ClientApp).

`compression.downlink`:

- `none`: the model itself, fp32 (every strategy's default).
- `fp16`: the model in half precision (floating-point tensors; the rest exactly), half the bytes.
- `delta`: the difference between the global model and the copy the node holds from its last task,
  encoded with the uplink's codec (`compression.name`, `ratio`, `quantize_values`). The server
  keeps, per node, the copy that node holds (the sum of everything it was sent, which the server
  knows exactly because it decodes its own payloads): a lossy delta's remainder stays in the next
  delta instead of being lost, as error feedback does on the uplink. A node the server holds no
  copy for (new, evicted from the `downlink_nodes` most recently served, after a failed task or a
  resume) gets the whole model.

Whatever the node rebuilds, it trains from it and sends its update against it; the server adds
that update to the global model the task was meant to carry, so the server's model stays fp32 and
the downlink's rounding never enters it.

A copy is the node's once the server sees a reply to the task that carried it (one task per node
is in flight, so there is one candidate at a time); after an error reply or a lost task, the
server forgets the node, since it cannot know which copy the node holds. A node asked to apply a
delta to a copy it does not hold (a restarted SuperNode, whose Context is new) fails that task
with a message saying so, and the server sends the whole model next time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from app.compression.codecs import MalformedPayload, bundle, decode, encode, unbundle
from app.compression.packing import PAYLOAD
from app.config.schema import CompressionConfig
from app.protocol import DOWNLINK, DOWNLINK_BASE, DOWNLINK_ID

TensorDict = dict[str, torch.Tensor]

COPY = "downlink-copy"  # ArrayRecord in the node's Context state: the model it last received
COPY_ID = "downlink-copy-id"  # ConfigRecord in the node's Context state: {"id": that copy's id}


def _settings(cfg: CompressionConfig) -> dict[str, Any]:
    return {"ratio": cfg.ratio, "quantize_values": cfg.quantize_values}


def _on_cpu(model: TensorDict) -> TensorDict:
    """The model in host memory (no copy for tensors already there: a CPU server)."""
    return {k: t.detach().cpu() for k, t in model.items()}


class Downlink:
    """Server side: each training task's arrays and config keys, and the copies nodes hold."""

    def __init__(self, cfg: CompressionConfig, seed: int = 0) -> None:
        if cfg.downlink == "delta" and cfg.name == "none":
            raise ValueError("compression.downlink=delta encodes with compression.name: choose a codec")
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(seed)  # int8's stochastic rounding
        self._held: OrderedDict[int, tuple[int, TensorDict]] = OrderedDict()  # node -> (id, copy), newest last
        self._pending: dict[int, tuple[int, TensorDict]] = {}  # node -> the copy its task in flight carries
        self._next_id = 1
        self._half: tuple[TensorDict, ArrayRecord] | None = None  # (model, its fp16 record): one per model

    def task(self, node: int, model: TensorDict, record: ArrayRecord) -> tuple[ArrayRecord, dict[str, Any]]:
        """(the arrays, the ConfigRecord entries) of a training task for `node` carrying `model`.

        `record` is `model` as an ArrayRecord (what `none` sends; `delta` sends it to a new node).
        """
        mode = self.cfg.downlink
        if mode == "none":
            return record, {}
        if mode == "fp16":
            if self._half is None or self._half[0] is not model:  # once per global model
                host = _on_cpu(model)
                self._half = (model, ArrayRecord({PAYLOAD: bundle(encode(host, "fp16"), host, "fp16")}))
            return self._half[1], {DOWNLINK: mode}
        model = _on_cpu(model)  # copies are kept in host memory; the generator is a CPU one
        copy_id, self._next_id = self._next_id, self._next_id + 1
        held = self._held.get(node)
        if held is None:
            self._pending[node] = (copy_id, model)
            return record, {DOWNLINK: "full", DOWNLINK_ID: copy_id}
        base_id, base = held
        delta = {k: t - base[k] if t.dtype.is_floating_point else t for k, t in model.items()}
        settings = _settings(self.cfg)
        parts = encode(delta, self.cfg.name, generator=self.generator, **settings)
        sent = decode(parts, delta, self.cfg.name, **settings)
        copy = {k: base[k] + d if d.dtype.is_floating_point else d for k, d in sent.items()}
        self._pending[node] = (copy_id, copy)
        payload = bundle(parts, delta, self.cfg.name, **settings)
        return ArrayRecord({PAYLOAD: payload}), {DOWNLINK: mode, DOWNLINK_BASE: base_id, DOWNLINK_ID: copy_id}

    def settle(self, node: int, replied: bool) -> None:
        """The node's task is over: with a reply it holds the task's copy; otherwise who knows."""
        pending = self._pending.pop(node, None)
        self._held.pop(node, None)
        if replied and pending is not None:
            self._held[node] = pending
            while len(self._held) > self.cfg.downlink_nodes:
                self._held.popitem(last=False)

    @property
    def nodes_held(self) -> int:
        return len(self._held)


def receive(
    record: ArrayRecord, config: ConfigRecord, state: RecordDict, like: TensorDict, cfg: CompressionConfig
) -> TensorDict:
    """ClientApp side: the model a task carries, rebuilt as `Downlink.task` encoded it.

    `like` holds the model's tensors as the node built it (names, shapes, dtypes); `state` is the
    node's Context state, which keeps the copy a delta applies to. Raises ValueError for a delta
    whose base this node does not hold.
    """
    mode = str(config.get(DOWNLINK, "none"))
    if mode in ("none", "full"):
        model = record.to_torch_state_dict()
    else:
        payload = torch.from_numpy(record[PAYLOAD].numpy())
        if mode == "fp16":
            model = decode(unbundle(payload, like, "fp16"), like, "fp16")
        else:
            held = int(state[COPY_ID]["id"]) if COPY_ID in state else None
            if held != config[DOWNLINK_BASE]:
                raise ValueError(
                    f"the task is a model delta from copy {config[DOWNLINK_BASE]}, but this node holds "
                    f"{'no copy' if held is None else f'copy {held}'} (restarted?); the server sends "
                    "the whole model next time"
                )
            base = state[COPY].to_torch_state_dict()
            settings = _settings(cfg)
            try:
                sent = decode(unbundle(payload, base, cfg.name, **settings), base, cfg.name, **settings)
            except MalformedPayload as err:
                raise ValueError(f"the task's model delta cannot be decoded: {err}") from None
            model = {k: base[k] + d if d.dtype.is_floating_point else d for k, d in sent.items()}
    if mode in ("full", "delta"):
        state[COPY] = ArrayRecord({k: v.detach().cpu() for k, v in model.items()})
        state[COPY_ID] = ConfigRecord({"id": int(config[DOWNLINK_ID])})
    return model

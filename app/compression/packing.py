"""A training reply with a compressed uplink: what the node sends (`pack`, in the ClientApp) and
the model the server gets back (`unpack`, before any screening or aggregation).

What crosses the link is the update, the trained model minus the model the node received,
never the raw model: its entries are small and centred on zero, which is what int8 scales and
topk's largest-magnitude selection are good at. Tensors that are not floating point (integer
buffers) are sent as they are, exactly. The server adds the decoded update to the model it sent,
so every strategy, robust rule and central-DP clip sees an ordinary dense model.

Error feedback keeps what a lossy encoding did not carry (the residual) in the node's Context
state and adds it to the node's next update. The state lives as long as the node process keeps
the run's Context. A node with a state directory (node config `state-dir`) also writes the
residual there after every update, so a restarted SuperNode picks it up again; without one, a
restarted node starts again from a zero residual (the updates it sent stay correct; only the
not-yet-sent remainder is lost).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from flwr.app import ArrayRecord, RecordDict

from app.compression.codecs import MalformedPayload, Piece, bundle, check_parts, encode, unbundle, with_error_feedback
from app.config.schema import CompressionConfig
from app.task.kept import load_kept, save_kept

PAYLOAD = "compressed"  # the one array of an encoded reply or task: all its parts (codecs.bundle)
RESIDUAL = "compression-residual"  # ArrayRecord in the node's Context state: what error feedback carries over

TensorDict = dict[str, torch.Tensor]

log = logging.getLogger("flwr.fedgpu." + __name__)


def residual_file(state_dir: str, run_id: int) -> Path:
    """Where a node with a state directory keeps its residual for run `run_id`."""
    return Path(state_dir) / f"compression-residual-run{run_id}.pt"


def update_of(trained: TensorDict, received: TensorDict) -> TensorDict:
    """trained - received for floating-point tensors (on trained's device); the rest as trained."""
    return {
        k: t - received[k].to(device=t.device, dtype=t.dtype) if t.dtype.is_floating_point else t
        for k, t in trained.items()
    }


def pack(
    trained: TensorDict,
    received: TensorDict,
    cfg: CompressionConfig,
    state: RecordDict,
    generator: torch.Generator | None = None,
    saved: Path | None = None,
) -> ArrayRecord:
    """The reply's arrays: the encoded update (on the CPU), with error feedback through `state`
    (and the file `saved`, when the node has a state directory: `residual_file`).

    Encoding runs where `trained` lives (the GPU when the node trains there); `generator` (on that
    device) drives int8's stochastic rounding.
    """
    update = update_of(trained, received)
    settings = {"ratio": cfg.ratio, "quantize_values": cfg.quantize_values}
    if cfg.error_feedback and cfg.name != "none":  # none (an update for a compressed downlink) is exact
        if RESIDUAL in state:
            residual = state[RESIDUAL].to_torch_state_dict()
        else:  # a new Context: the first update, or a restarted node
            residual = load_kept(saved) if saved is not None else None
        if residual is not None and residual.keys() != {k for k, t in update.items() if t.dtype.is_floating_point}:
            residual = None  # another model (model.trainable changed): the old remainder does not apply
        parts, residual = with_error_feedback(update, residual, cfg.name, generator=generator, **settings)
        state[RESIDUAL] = ArrayRecord({k: v.detach().cpu() for k, v in residual.items()})
        if saved is not None:
            save_kept(saved, residual)
    else:
        parts = encode(update, cfg.name, generator=generator, **settings)
    return ArrayRecord({PAYLOAD: bundle(parts, update, cfg.name, **settings).cpu()})


class NodeModel(Mapping[str, torch.Tensor]):
    """A node's model: the model it was sent (`base`) plus its checked, still encoded update.

    Reading a key builds that tensor (and keeps it), so every strategy sees an ordinary dense
    model; FedAvg instead adds the updates straight into its aggregate (`add_update_to`): a topk
    update then never becomes a dense tensor, and no reply costs a model-sized copy.
    """

    def __init__(self, base: TensorDict, pieces: dict[str, Piece]) -> None:
        self.base, self._pieces, self._dense = base, pieces, {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._dense:
            ref = self.base[key]
            update = self._pieces[key].dense(ref)
            self._dense[key] = ref + update if update.dtype.is_floating_point else update
        return self._dense[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def add_update_to(self, acc: TensorDict, alpha: float) -> None:
        """acc[k] += alpha * (this model - base)[k] for acc's keys (floating-point tensors only)."""
        for key, t in acc.items():
            self._pieces[key].add_to(t, alpha)


def unpack(record: ArrayRecord, base: TensorDict, cfg: CompressionConfig) -> NodeModel:
    """The node's model: `base` (the model it was sent) plus its update, on base's device.

    Every check happens here, before anything is aggregated: raises MalformedPayload (a ValueError)
    naming the part and the problem for anything that is not a well-formed encoding of an update of
    `base`'s shapes: the bytes come from an untrusted node.
    """
    if list(record.keys()) != [PAYLOAD]:
        raise MalformedPayload(f"expected one array named {PAYLOAD!r}, got {sorted(record.keys())[:5]}")
    try:
        payload = torch.from_numpy(record[PAYLOAD].numpy())
    except Exception as err:  # noqa: BLE001 - whatever a hostile .npy makes numpy raise, it is malformed
        raise MalformedPayload(f"{PAYLOAD}: not an array ({err})") from None
    settings = {"ratio": cfg.ratio, "quantize_values": cfg.quantize_values}
    return NodeModel(base, check_parts(unbundle(payload, base, cfg.name, **settings), base, cfg.name, **settings))

"""A training reply with a compressed uplink: what the node sends (`pack`, in the ClientApp) and
the model the server gets back (`unpack`, before any screening or aggregation).

What crosses the link is the update, the trained model minus the model the node received,
never the raw model: its entries are small and centred on zero, which is what int8 scales and
topk's largest-magnitude selection are good at. Tensors that are not floating point (integer
buffers) are sent as they are, exactly. The server adds the decoded update to the model it sent,
so every strategy, robust rule and central-DP clip sees an ordinary dense model.

Error feedback keeps what a lossy encoding did not carry (the residual) in the node's Context
state and adds it to the node's next update. The state lives as long as the node process keeps
the run's Context: a restarted SuperNode, or a simulation node whose Context was dropped, starts
again from a zero residual (the updates it sent stay correct; only the not-yet-sent remainder is
lost).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, RecordDict

from app.compression.codecs import MalformedPayload, bundle, decode, encode, unbundle, with_error_feedback
from app.config.schema import CompressionConfig

PAYLOAD = "compressed"  # the one array of an encoded reply or task: all its parts (codecs.bundle)
RESIDUAL = "compression-residual"  # ArrayRecord in the node's Context state: what error feedback carries over

TensorDict = dict[str, torch.Tensor]


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
) -> ArrayRecord:
    """The reply's arrays: the encoded update (on the CPU), with error feedback through `state`.

    Encoding runs where `trained` lives (the GPU when the node trains there); `generator` (on that
    device) drives int8's stochastic rounding.
    """
    update = update_of(trained, received)
    settings = {"ratio": cfg.ratio, "quantize_values": cfg.quantize_values}
    if cfg.error_feedback and cfg.name != "none":  # none (an update for a compressed downlink) is exact
        residual = state[RESIDUAL].to_torch_state_dict() if RESIDUAL in state else None
        if residual is not None and residual.keys() != {k for k, t in update.items() if t.dtype.is_floating_point}:
            residual = None  # another model (model.trainable changed): the old remainder does not apply
        parts, residual = with_error_feedback(update, residual, cfg.name, generator=generator, **settings)
        state[RESIDUAL] = ArrayRecord({k: v.detach().cpu() for k, v in residual.items()})
    else:
        parts = encode(update, cfg.name, generator=generator, **settings)
    return ArrayRecord({PAYLOAD: bundle(parts, update, cfg.name, **settings).cpu()})


def unpack(record: ArrayRecord, base: TensorDict, cfg: CompressionConfig) -> TensorDict:
    """The node's model: `base` (the model it was sent) plus its decoded update, on base's device.

    Raises MalformedPayload (a ValueError) naming the part and the problem for anything that is not
    a well-formed encoding of an update of `base`'s shapes: the bytes come from an untrusted node.
    """
    if list(record.keys()) != [PAYLOAD]:
        raise MalformedPayload(f"expected one array named {PAYLOAD!r}, got {sorted(record.keys())[:5]}")
    try:
        payload = torch.from_numpy(record[PAYLOAD].numpy())
    except Exception as err:  # noqa: BLE001 - whatever a hostile .npy makes numpy raise, it is malformed
        raise MalformedPayload(f"{PAYLOAD}: not an array ({err})") from None
    settings = {"ratio": cfg.ratio, "quantize_values": cfg.quantize_values}
    update = decode(unbundle(payload, base, cfg.name, **settings), base, cfg.name, **settings)
    return {k: base[k] + u if u.dtype.is_floating_point else u for k, u in update.items()}

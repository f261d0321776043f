"""The server's memory for replies, decided before round 1: whether training replies are
streamed (folded as they arrive, `strategies/streaming.py`) or gathered, and whether what the
strategy must hold fits `federation.server_memory_gb`.

`federation.aggregation=auto` gathers unless the cohort's replies would take more than
`STREAM_ABOVE_BYTES` (or the cap): gathered replies are summed in send order, so a run is bit for
bit the same whatever the arrival order, which streaming (float64, arrival order) promises only to
~1e-7 relative. Every small run (the default digits run, the tests, the recorded figures) keeps it.
"""

from __future__ import annotations

import logging

from app.config.schema import Config, ConfigError
from strategies.interface import ServerStrategy

log = logging.getLogger("flwr.fedgpu." + __name__)

# Above 1 GiB of gathered replies (5 replies of a 50 M-parameter float32 model) memory outweighs
# bit-identity across arrival orders: stream. Below it, gathering costs less than the model copies
# Flower and torch already hold on any server that trains such a model.
STREAM_ABOVE_BYTES = 2**30
GIB = 2**30


def streams(cfg: Config, strategy: ServerStrategy, num_nodes: int, model_bytes: int) -> bool:
    """Whether the rounds stream their training replies, after checking that the replies the
    strategy holds at once fit `federation.server_memory_gb`; ConfigError naming the numbers when not.
    `model_bytes`: one reply's trainable tensors (what a reply carries uncompressed)."""
    f = cfg.federation
    cap = f.server_memory_gb * GIB
    can_stream = bool(getattr(strategy, "streams", False))  # FedBuff: its mean buffer (`UpdateFold`)
    contributions = cfg.ledger.contribution != "none"  # scores need every reply: validate refuses stream
    gathered = strategy.held_replies(num_nodes, streamed=False) * model_bytes
    chosen = f.aggregation == "stream" or (
        f.aggregation == "auto"
        and can_stream
        and not contributions
        and (gathered > STREAM_ABOVE_BYTES or bool(cap and gathered > cap))
    )
    held = strategy.held_replies(num_nodes, streamed=chosen)
    if cap and held * model_bytes > cap:
        why = (
            "with federation.aggregation=gather"
            if can_stream
            else f"{strategy.name} must hold them all (docs/strategies.md#server-memory)"
        )
        raise ConfigError(
            f"federation.server_memory_gb={f.server_memory_gb:g}: {held} replies of {model_bytes / GIB:.3g} GiB "
            f"(the model's trainable tensors) take {held * model_bytes / GIB:.3g} GiB, {why}; {num_nodes} nodes "
            "connected. Sample fewer nodes (federation.fraction_train), train fewer tensors (model.trainable), "
            + ("stream (federation.aggregation=auto or stream), " if can_stream and not contributions else "")
            + "or raise the cap"
        )
    log.info(
        "server memory: replies %s, %d of %.3g GiB held at once%s",
        "streamed (each folded as it arrives)" if chosen else "gathered",
        held,
        model_bytes / GIB,
        f" (cap {f.server_memory_gb:g} GiB)" if cap else "",
    )
    return chosen

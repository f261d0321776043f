"""Validation of client replies before anything is aggregated.

A federation is open to broken and malicious nodes: every reply is checked against
the global model it was trained from (keys, byte size, shapes, dtypes, finite values)
and for a usable example count. Bad replies are rejected with the node (its id, and its
partition or name: strategies/node_names.py) and the reason; the rest are aggregated.

A reply's `num-examples` is a claim, never trusted as it stands: the weight it earns
is capped (`WeightCap`: the node's real partition size in simulation,
`federation.max_examples_per_node` in deployment) and in any case at `MAX_WEIGHT`, so
no claim outweighs the honest nodes without bound and a sum of weights is always
finite.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from flwr.app import ArrayRecord, Error, Message, MessageType, MetricRecord, RecordDict

from strategies.keys import NUM_EXAMPLES, PARTITION_ID
from strategies.node_names import NodeNames, label
from strategies.node_text import is_plain, printable
from strategies.tensor_ops import TensorDict, array_view, is_finite

log = logging.getLogger("flwr.fedgpu." + __name__)


# The largest weight any reply earns, whatever it claims: counts up to 2^53 are exact in
# float64, and a sum of n such weights stays finite for any n below 1e292.
MAX_WEIGHT = 2.0**53

# An Array's .npy header beyond the global model's own (NumPy pads headers to 64 bytes;
# a few hundred cover any shape): more than this is a reply padded with junk.
HEADER_ALLOWANCE = 1024

Unpack = Callable[[ArrayRecord, TensorDict], Mapping]
"""(a reply's compressed arrays, the model the node was sent) -> the node's model (a dict, or an
`EncodedModel` that reads as one) in the global model's keys, shapes and dtypes; raises ValueError
when the payload is malformed. Set by the app for a compressed uplink (app/compression/packing.py);
None: replies carry the model itself."""


@runtime_checkable
class EncodedModel(Protocol):
    """What `Unpack` may return besides a plain dict: a model that reads as a dense Mapping and can
    also add its update (model - base) into an aggregate without a dense copy (FedAvg uses it)."""

    base: TensorDict

    def add_update_to(self, acc: TensorDict, alpha: float) -> None: ...


class Downlink(Protocol):
    """How a training task carries the global model (set by the app: app/compression/downlink.py;
    None: the model itself)."""

    def task(self, node: int, model: dict[str, Any], record: ArrayRecord) -> tuple[ArrayRecord, dict[str, Any]]:
        """(the task's arrays, entries for its ConfigRecord) for `node`; `record` is `model` as sent plain."""
        ...

    def settle(self, node: int, replied: bool) -> None:
        """`node`'s task is over: `replied` when a reply (not an error) came back."""
        ...


WeightCap = Callable[[int, MetricRecord, str], float]
# (the training reply, the node its task went to) -> None, or InvalidReply: a run's own check of a reply
# beyond its shape and counts (signed work records: app/run/work.py), before anything of it is used
ReplyCheck = Callable[[Message, int], None]
"""(node id, the reply's metrics, MessageType.TRAIN or .EVALUATE) -> the most examples
that reply may count for. It may raise InvalidReply (a contradictory partition claim)."""


# A reason quotes what the node sent (keys, values, its error text): escaped and bounded, so that
# it can be logged and stored as it stands (strategies/node_text.py).
MAX_REASON = 2000
MAX_METRIC_NAME = 100


class InvalidReply(ValueError):
    """Why one reply cannot be used."""

    def __init__(self, reason: str) -> None:
        super().__init__(printable(reason, MAX_REASON))


def error_text(error: Error) -> str:
    """An error reply as one safe line: its code, and its reason as `printable` makes it."""
    return f"error reply (code {error.code}): {printable(error.reason)}"


@dataclass(frozen=True)
class ArraySpec:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int  # the global model's serialised size of this array, header included


def specs_of(record: ArrayRecord) -> dict[str, ArraySpec]:
    """Key -> (shape, dtype, byte size) of the global model, the yardstick for replies."""
    return {k: ArraySpec(tuple(a.shape), a.dtype, len(a.data)) for k, a in record.items()}


@dataclass
class ValidReply:
    node_id: int
    weight: float  # the capped example count (times s(τ) in FedBuff): what a weighted mean uses
    metrics: MetricRecord  # as received: metrics[NUM_EXAMPLES] is the claimed count
    arrays: TensorDict = field(default_factory=dict)
    base: TensorDict | None = None  # the model it trained from, when not this round's global (async)
    staleness: int = 0  # versions the global model moved on while it trained (async)
    scale: float = 1.0  # FedBuff's staleness factor s(τ): the weight of rules that ignore counts


@dataclass
class Rejection:
    node_id: int
    reason: str

    def __post_init__(self) -> None:
        self.reason = printable(self.reason, MAX_REASON)


@dataclass
class Screened:
    """The outcome of screening one round's replies, and how its log lines name their nodes."""

    valid: list[ValidReply] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    names: NodeNames | None = None


def warn_rejected(node: int, reason: str, names: NodeNames | None) -> None:
    """The log line of every rejected reply."""
    log.warning("rejected reply from %s: %s", label(node, names), reason)


def _only_record(records: dict, kind: str) -> object:  # noqa: ANN401
    if len(records) != 1:
        raise InvalidReply(f"expected exactly one {kind}, got {len(records)}")
    return next(iter(records.values()))


R = TypeVar("R", ArrayRecord, MetricRecord)


def records_of(content: RecordDict, kind: type[R]) -> dict[str, R]:
    """`content`'s records of one kind. Flower's `content.array_records` (and `metric_records`) builds a
    view in a reference cycle, which keeps the reply's arrays alive until Python's cyclic collector
    runs: a streamed round, which frees each reply as soon as it is folded, reads them through here."""
    return {k: r for k, r in content.items() if isinstance(r, kind)}


def payload_bytes(content: RecordDict) -> int:
    """The bytes of every array a message carries (serialised, .npy headers included): what
    crosses the link for the model, whatever the transport adds."""
    return sum(len(a.data) for record in records_of(content, ArrayRecord).values() for a in record.values())


def arrays_digest(record: ArrayRecord) -> str:
    """sha256 of a record's arrays as they cross the wire (keys sorted; each key, then its bytes):
    what the contribution ledger records of each reply."""
    h = hashlib.sha256()
    for key in sorted(record.keys()):
        h.update(f"{key}\0".encode())
        h.update(record[key].data)
    return h.hexdigest()


def reply_weight(metrics: MetricRecord, weight_key: str = NUM_EXAMPLES) -> float:
    if weight_key not in metrics:
        raise InvalidReply(f"missing {weight_key!r} in its MetricRecord")
    value = metrics[weight_key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidReply(f"{weight_key!r} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidReply(f"{weight_key!r}={value} must be a finite number > 0")
    return float(value)


def check_arrays(
    record: ArrayRecord,
    specs: dict[str, ArraySpec],
    check_finite: bool = True,
    unpack: Unpack | None = None,
    base: TensorDict | None = None,
) -> TensorDict:
    """Zero-copy tensors of a reply's arrays, or InvalidReply naming the first problem.

    The byte size is checked before any payload is parsed or viewed: a reply larger
    than the global model (plus `HEADER_ALLOWANCE` per array) is refused outright.
    `check_finite=False` leaves the NaN/Inf check to an aggregator that gets it for
    free from its own pass over the data (FedAvg's output, Krum's Gram diagonal).
    With `unpack` (a compressed uplink) the arrays are an encoded update of `base`,
    decoded into the node's model first; then the same checks apply.
    """
    size = sum(len(a.data) for a in record.values())
    # A compressed payload is smaller than the model, except topk's bitmap at ratio 1 (n/8 bytes more).
    limit = sum((spec.nbytes * 9 // 8 if unpack else spec.nbytes) + HEADER_ALLOWANCE for spec in specs.values())
    if size > limit:
        raise InvalidReply(f"arrays hold {size} bytes, more than the global model's {limit} (headers included)")
    if unpack is not None:
        if base is None:
            raise ValueError("unpack needs the model the node was sent (base)")
        try:
            tensors = unpack(record, base)
        except ValueError as err:
            raise InvalidReply(f"compressed update: {err}") from err
    else:
        missing, extra = specs.keys() - record.keys(), record.keys() - specs.keys()
        if missing or extra:
            raise InvalidReply(
                f"array keys differ from the global model (missing {sorted(missing)}, unexpected {sorted(extra)})"
            )
        tensors = {}
        for key, arr in record.items():
            spec = specs[key]
            if tuple(arr.shape) != spec.shape or arr.dtype != spec.dtype:
                raise InvalidReply(f"{key}: {arr.dtype}{list(arr.shape)} != global {spec.dtype}{list(spec.shape)}")
            try:
                tensors[key] = array_view(arr)
            except ValueError as err:
                raise InvalidReply(f"{key}: {err}") from err
    if check_finite:
        for key in specs:
            if not is_finite(tensors[key]):
                raise InvalidReply(f"{key}: non-finite values (NaN or Inf)")
    return tensors


def capped_weight(
    claimed: float, node: int, metrics: MetricRecord, kind: str, cap: WeightCap | None, names: NodeNames | None = None
) -> float:
    """The weight a claimed count earns: min(claim, the node's cap, MAX_WEIGHT)."""
    limit = MAX_WEIGHT if cap is None else min(cap(node, metrics, kind), MAX_WEIGHT)
    if not limit > 0:  # also NaN
        raise InvalidReply(f"claims {claimed:g} examples, but its data holds none the server knows of")
    if claimed > limit:
        log.info("%s claims %g examples; counted as %g", label(node, names), claimed, limit)
    return min(claimed, limit)


def screen_reply(
    msg: Message,
    specs: dict[str, ArraySpec] | None,
    weight_key: str = NUM_EXAMPLES,
    check_finite: bool = True,
    *,
    node: int | None = None,
    weight_cap: WeightCap | None = None,
    unpack: Unpack | None = None,
    base: TensorDict | None = None,
    names: NodeNames | None = None,
    check: ReplyCheck | None = None,
) -> ValidReply:
    """Validate one reply; `specs=None` checks metrics only (evaluation replies).

    `node` is the node the task was sent to (default: the reply's sender); its
    `weight_cap` bounds the claimed example count. `unpack` and `base`: see check_arrays.
    `names` keeps the name the reply claims for its node, whatever the screening finds (its
    `wire.NODE` record is read for that alone: a reply's ConfigRecords are otherwise ignored, but
    by `check`, which sees the whole reply first).

    Any other exception a check raises (one that did not foresee what a node can send: a decoder's
    IndexError, a parser's RecursionError) becomes this reply's InvalidReply, naming the exception's
    type and message, and its traceback is logged: one node's input never ends the run, and the
    check that should have named the problem itself is not hidden.
    """
    node = msg.metadata.src_node_id if node is None else node
    try:
        return _screen(msg, specs, weight_key, check_finite, node, weight_cap, unpack, base, names, check)
    except InvalidReply:
        raise
    except Exception as err:  # noqa: BLE001 - any check's failure on one reply is that reply's rejection
        log.warning(
            "checking the reply from %s raised %s: the reply is rejected (a check should have named why)",
            label(node, names),
            type(err).__name__,
            exc_info=True,
        )
        raise InvalidReply(f"checking it raised {type(err).__name__}: {err}") from err


def _screen(
    msg: Message,
    specs: dict[str, ArraySpec] | None,
    weight_key: str,
    check_finite: bool,
    node: int,
    weight_cap: WeightCap | None,
    unpack: Unpack | None,
    base: TensorDict | None,
    names: NodeNames | None,
    check: ReplyCheck | None,
) -> ValidReply:
    """`screen_reply`'s checks, in order; InvalidReply for the first that fails."""
    if msg.has_error():
        raise InvalidReply(error_text(msg.error))
    if check is not None:
        check(msg, node)
    content = msg.content
    if names is not None:
        names.hear(node, content)
    metrics = _only_record(records_of(content, MetricRecord), "MetricRecord")
    for key in metrics:  # a metric's name becomes a column in metrics.jsonl, TensorBoard and MLflow
        if len(key) > MAX_METRIC_NAME or not is_plain(key):
            raise InvalidReply(
                f"metric name '{printable(key, 40)}' is over {MAX_METRIC_NAME} characters or holds control characters"
            )
    kind = MessageType.TRAIN if specs is not None else MessageType.EVALUATE
    weight = capped_weight(reply_weight(metrics, weight_key), node, metrics, kind, weight_cap, names)
    arrays = (
        check_arrays(_only_record(records_of(content, ArrayRecord), "ArrayRecord"), specs, check_finite, unpack, base)
        if specs is not None
        else {}
    )
    return ValidReply(node_id=node, weight=weight, metrics=metrics, arrays=arrays)


def screen_each(
    replies: Iterable[Message],
    specs: dict[str, ArraySpec] | None,
    out: Screened,
    weight_key: str = NUM_EXAMPLES,
    check_finite: bool = True,
    sent: Mapping[str, int] | None = None,
    weight_cap: WeightCap | None = None,
    unpack: Unpack | None = None,
    base: TensorDict | None = None,
    check: ReplyCheck | None = None,
) -> Iterator[ValidReply]:
    """Screen replies one at a time as they come: each valid one is added to `out.valid` and
    yielded, each rejection logged into `out.rejected`. A streamed aggregate folds each yielded
    reply before the next is read (`strategies/streaming.py`); `screen_replies` gathers them.

    `sent` (message id -> destination node) names the node a reply is about: an error
    the SuperLink answers for a vanished node (NODE_UNAVAILABLE) comes from the SuperLink's
    own node id, not from the node the task was for. `out.names`: see screen_reply.
    """
    for msg in replies:
        node = (sent or {}).get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
        try:
            reply = screen_reply(
                msg,
                specs,
                weight_key,
                check_finite,
                node=node,
                weight_cap=weight_cap,
                unpack=unpack,
                base=base,
                names=out.names,
                check=check,
            )
        except InvalidReply as err:
            out.rejected.append(Rejection(node, str(err)))
            warn_rejected(node, str(err), out.names)
            continue
        finally:
            del msg  # not held while the next reply is fetched
        out.valid.append(reply)
        yield reply


def screen_replies(
    replies: Iterable[Message],
    specs: dict[str, ArraySpec] | None,
    weight_key: str = NUM_EXAMPLES,
    check_finite: bool = True,
    sent: Mapping[str, int] | None = None,
    weight_cap: WeightCap | None = None,
    unpack: Unpack | None = None,
    base: TensorDict | None = None,
    names: NodeNames | None = None,
    check: ReplyCheck | None = None,
) -> Screened:
    """Split replies into valid ones and logged rejections (`screen_each`, all gathered)."""
    out = Screened(names=names)
    for _ in screen_each(replies, specs, out, weight_key, check_finite, sent, weight_cap, unpack, base, check):
        pass
    return out


def reject(screened: Screened, reply: ValidReply, reason: str) -> None:
    """Move a reply that passed screening to the rejections (found bad while aggregating)."""
    screened.valid.remove(reply)
    screened.rejected.append(Rejection(reply.node_id, reason))
    warn_rejected(reply.node_id, reason, screened.names)


# Reply metrics that describe a node rather than its training: not averaged.
IDENTITY_KEYS = (PARTITION_ID,)


def weighted_metrics(valid: list[ValidReply], weight_key: str = NUM_EXAMPLES) -> MetricRecord:
    """Per key, the weight-averaged value over the replies that report it.

    Unlike Flower's `aggregate_metricrecords`, nodes may report different keys (a GPU
    node sends telemetry, a CPU node does not). Non-finite values are skipped.
    """
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for reply in valid:
        for key, value in reply.metrics.items():
            if key == weight_key or key in IDENTITY_KEYS or isinstance(value, list) or not math.isfinite(value):
                continue
            sums[key] = sums.get(key, 0.0) + reply.weight * float(value)
            weights[key] = weights.get(key, 0.0) + reply.weight
    record = MetricRecord({k: sums[k] / weights[k] for k in sorted(sums)})
    record[weight_key] = sum(r.weight for r in valid)
    return record

"""Tensor maths shared by our strategies: zero-copy views of Flower Arrays, the
weighted mean, and flatten/unflatten for strategies that work on one vector per client.

Flower's `aggregate_arrayrecords` deserialises every Array with `np.load` (a copy),
multiplies it into a new array (another copy) and adds. Here a received Array is
viewed in place (`torch.frombuffer` over its .npy payload) and accumulated with one
fused `add_(x, alpha=w)` per tensor, on the server's device. On another device than
the replies' (a GPU server), `stage` first uploads each reply once, in one transfer.
"""

from __future__ import annotations

import functools
import io
import math
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

TensorDict = dict[str, torch.Tensor]
T = TypeVar("T")


@functools.cache
def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


_NPY_MAGIC = b"\x93NUMPY"
_HEADER_CACHE_MAX_BYTES = 1024  # longer (odd) headers are parsed every time


@dataclass(frozen=True)
class _NpyHeader:
    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype
    dtype_str: str
    supported: bool  # plain C-order numeric
    offset: int  # where the values start
    nbytes: int  # size the values must have


def _header_prefix(data: bytes) -> bytes:
    """The .npy magic + header of `data` (all of `data` when it is too short or malformed)."""
    if len(data) >= 12 and data[:6] == _NPY_MAGIC:
        if data[6:8] == b"\x01\x00":  # format 1.0: 2-byte header length; anything else is read as 2.0
            return data[: 10 + int.from_bytes(data[8:10], "little")]
        return data[: 12 + int.from_bytes(data[8:12], "little")]
    return data[:12]


def _parse_header(prefix: bytes) -> _NpyHeader:
    """NumPy's own .npy header parser (its errors included), on the header bytes only."""
    buf = io.BytesIO(prefix)
    version = np.lib.format.read_magic(buf)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf)
    supported = not (fortran or dtype.hasobject or not dtype.isnative or dtype.kind not in "biuf")
    shape = tuple(shape)
    return _NpyHeader(shape, fortran, dtype, str(dtype), supported, buf.tell(), math.prod(shape) * dtype.itemsize)


# Every client's reply carries the same few headers (one per model tensor): parsing one
# with NumPy (ast.literal_eval) costs ~15 us, more than viewing the tensor itself.
_parse_header_cached = functools.lru_cache(maxsize=4096)(_parse_header)

_frombuffer_warned = False  # torch warns once per process that the bytes are read-only


def array_view(array: Array) -> torch.Tensor:
    """Read-only CPU tensor over an Array's .npy bytes, without copying.

    Raises ValueError when the payload is not a plain C-order numeric .npy array or
    disagrees with the Array's declared shape and dtype (a malformed or lying reply).
    """
    global _frombuffer_warned
    data = array.data
    prefix = _header_prefix(data)
    header = (_parse_header_cached if len(prefix) <= _HEADER_CACHE_MAX_BYTES else _parse_header)(prefix)
    shape, dtype = header.shape, header.dtype
    if not header.supported:
        raise ValueError(f"unsupported array payload (dtype {dtype}, fortran_order={header.fortran})")
    if shape != tuple(array.shape) or header.dtype_str != array.dtype:
        raise ValueError(f"payload is {dtype}{list(shape)} but declares {array.dtype}{list(array.shape)}")
    offset = header.offset
    if len(data) - offset != header.nbytes:
        raise ValueError(f"payload has {len(data) - offset} bytes, expected {header.nbytes}")
    if header.nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    count = header.nbytes // dtype.itemsize
    if _frombuffer_warned:
        flat = torch.frombuffer(data, dtype=torch_dtype(dtype), count=count, offset=offset)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # bytes are read-only; we never write
            flat = torch.frombuffer(data, dtype=torch_dtype(dtype), count=count, offset=offset)
        _frombuffer_warned = True
    return flat if len(shape) == 1 else flat.view(shape)


def record_to_tensors(record: ArrayRecord) -> TensorDict:
    """Zero-copy views of every Array in a record."""
    return {key: array_view(arr) for key, arr in record.items()}


def numpy_to_array(a: np.ndarray) -> Array:
    """`Array(a)`, the same .npy bytes, with one copy of the values instead of three.

    `Array(ndarray)` runs `np.save` into a BytesIO (a chunked `tobytes`, the stream's
    growth, `getvalue`); here the header is NumPy's and the values are copied once,
    straight into the final bytes object. Arrays that are not C-contiguous, or whose
    header needs format 2.0, take Flower's path.
    """
    if not a.flags.c_contiguous or a.dtype.hasobject:
        return Array(a)
    head = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(a))
    except ValueError:
        return Array(a)
    data = b"".join((head.getvalue(), a.reshape(-1).view(np.uint8)))
    return Array(dtype=str(a.dtype), shape=tuple(a.shape), stype=SType.NUMPY, data=data)


def tensors_to_record(tensors: dict[str, torch.Tensor], consume: bool = False) -> ArrayRecord:
    """Serialise tensors into an ArrayRecord; `consume=True` frees each tensor once it is
    copied, so a model-sized result and its record never coexist in full."""
    record = ArrayRecord()
    for key in list(tensors):
        t = tensors.pop(key) if consume else tensors[key]
        record[key] = numpy_to_array(t.detach().cpu().numpy())
        del t
    return record


def is_finite(t: torch.Tensor) -> bool:
    """All values finite, checked through one reduction (no n-sized boolean mask) in the common case.

    A finite sum implies finite elements; NaN or Inf anywhere makes the sum non-finite. Large
    but finite values can overflow the sum too, so a non-finite sum is confirmed element by
    element: the answer is exact, and the extra pass is only paid by a suspicious tensor.
    Half types are summed in float32.
    """
    if not t.is_floating_point():
        return True
    total = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
    return bool(torch.isfinite(total)) or bool(torch.isfinite(t).all())


def non_finite_keys(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The keys of the floating-point tensors holding NaN or Inf."""
    return [k for k, t in tensors.items() if not is_finite(t)]


# --- the model a strategy applies is finite ------------------------------------------------------
NON_FINITE_STEP = "the step would make the model non-finite"

Part = tuple[object, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor] | None, float]
"""One contribution to a step: (its owner, a model, the model it moved from or None, its scale),
the step moving by about scale * (model - base) (scale * model when base is None)."""


def _pushes(new: Mapping[str, torch.Tensor], bad: Sequence[str], parts: Sequence[Part]) -> list[float]:
    """How far each part pushes the step where `new` holds NaN or Inf: max |scale * (model - base)|
    there, in float64 (no float32 overflow); NaN or Inf in a part's own values counts as inf."""
    pushes = [0.0] * len(parts)
    for key in bad:
        where = ~torch.isfinite(new[key])
        for i, (_, model, base, scale) in enumerate(parts):
            t = model[key]
            x = t.reshape(where.shape)[where.to(t.device)].to(where.device, torch.float64)
            if base is not None:
                b = base[key]
                x = x - b.reshape(where.shape)[where.to(b.device)].to(where.device, torch.float64)
            if x.numel():
                push = float((x.abs() * abs(scale)).nan_to_num(nan=math.inf).max())
                pushes[i] = max(pushes[i], push)
    return pushes


def finite_step(
    items: Sequence[T], step: Callable[[list[T]], tuple[TensorDict | None, Sequence[Part]]]
) -> tuple[TensorDict | None, list[tuple[T, str]]]:
    """`step(kept)` until the model it returns is finite: the one check every strategy makes on the
    model it is about to apply.

    `step` builds the model from the items kept (replies, FedBuff's momentum) and says how each
    of them moved it (`Part`s; their owners are items). When the model holds NaN or Inf, the
    items pushing hardest there (`_pushes`, ties included) are dropped and the step is redone:
    the rest of a round still counts, and the culprits are named. A step that stays non-finite
    once every item is gone, or that nobody pushed there, is refused (None): the caller keeps
    its model. Returns the model (None: no step) and each dropped item with the reason.
    The common case costs one finiteness check of the new model.
    """
    kept, dropped = list(items), []
    while True:
        new, parts = step(kept)
        if new is None or not (bad := non_finite_keys(new)):
            return new, dropped
        pushes = _pushes(new, bad, parts)
        top = max(pushes, default=0.0)
        if not top > 0:  # nobody moved the model there: the whole step is refused
            culprits = [(owner, f"{NON_FINITE_STEP} (NaN or Inf in {bad})") for owner, *_ in parts]
        elif math.isinf(top):
            culprits = [
                (p[0], "non-finite values (NaN or Inf)") for p, x in zip(parts, pushes, strict=True) if x == top
            ]
        else:
            culprits = [
                (p[0], f"{NON_FINITE_STEP}: it moves {bad} by up to {x:.3g} where the result would be NaN or Inf")
                for p, x in zip(parts, pushes, strict=True)
                if x == top
            ]
        gone = {id(owner) for owner, _ in culprits}
        dropped += [(owner, reason) for owner, reason in culprits if any(owner is k for k in kept)]
        remaining = [k for k in kept if id(k) not in gone]
        if len(remaining) == len(kept) or not remaining:
            # nothing left to drop (or nothing left): refuse; every item still kept is named
            dropped += [(k, f"{NON_FINITE_STEP} (NaN or Inf in {bad})") for k in remaining]
            return None, dropped
        kept = remaining


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float32, torch.float64):
        return dtype
    return torch.float32 if dtype.is_floating_point else torch.float64


STAGE_ALIGN = 64  # bytes: where each tensor of a packed upload starts (vectorised kernels want >= 16)
STAGE_IN_FLIGHT = 2  # pinned buffers whose copies may still run: packing one dict overlaps copying the last


def _resident(t: torch.Tensor, device: torch.device) -> bool:
    return t.device == device


def _packed(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of buf's bytes from `offset` with `like`'s dtype and shape."""
    return buf[offset : offset + like.numel() * like.element_size()].view(like.dtype).view(like.shape)


def upload(tensors: Mapping[str, torch.Tensor], device: torch.device) -> tuple[TensorDict, torch.Tensor]:
    """`tensors` on `device` in ONE host-to-device transfer, and the host buffer it came from.

    The tensors are packed into one host buffer (pinned for CUDA, so the copy is an
    asynchronous DMA) and viewed per key on the device. The caller keeps the buffer
    alive until the copy is done (`stage`).
    """
    offsets, total = [], 0
    for t in tensors.values():
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // STAGE_ALIGN) * STAGE_ALIGN
    cuda = device.type == "cuda"
    host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    for t, offset in zip(tensors.values(), offsets, strict=True):
        _packed(host, offset, t).copy_(t)
    dev = host.to(device, non_blocking=cuda)
    return {k: _packed(dev, offset, t) for (k, t), offset in zip(tensors.items(), offsets, strict=True)}, host


def stage(dicts: Sequence[Mapping[str, torch.Tensor]], device: torch.device | str) -> list[TensorDict]:
    """`dicts` on `device`, each distinct dict (by identity) uploaded once, in one transfer.

    The rules read each reply and its base several times (Krum: Gram matrix, then mean;
    the coordinate-wise rules: block by block), and a synchronous round passes the same
    global model as every reply's base. Slice-by-slice copies from pageable memory
    would make thousands of small synchronous transfers and re-upload the base once per
    reply; staged, a round costs one upload per reply plus one per distinct base.
    Dicts already on `device` (all of them on a CPU server) come back as the very same
    objects: nothing is copied. Every tensor a rule moves to its device goes through here.
    """
    device = torch.device(device)
    if device.type == "cpu":  # tensors report "cpu", never "cpu:0"
        device = torch.device("cpu")
    elif device.type == "cuda" and device.index is None:  # tensors report their index
        device = torch.device("cuda", torch.cuda.current_device())
    staged: dict[int, Mapping[str, torch.Tensor]] = {}
    in_flight: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()  # (copy done, its pinned source)
    for d in dicts:
        if id(d) in staged:
            continue
        if all(_resident(t, device) for t in d.values()):
            staged[id(d)] = d
            continue
        staged[id(d)], host = upload(d, device)
        if device.type == "cuda":  # a pinned source must outlive its asynchronous copy
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            in_flight.append((done, host))
            if len(in_flight) > STAGE_IN_FLIGHT:
                in_flight.popleft()[0].synchronize()
    for done, _ in in_flight:
        done.synchronize()
    return [cast(TensorDict, staged[id(d)]) for d in dicts]


SMALL_TENSOR = 32768  # values; torch's parallel grain size, below which per-call overhead dominates


def weighted_mean(
    clients: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], device: torch.device
) -> TensorDict:
    """Σ wᵢ xᵢ / Σ wᵢ per key, accumulated in place on `device` (replies `stage`d there
    first); dtypes are preserved.

    Half-precision tensors accumulate in float32 and integer tensors (e.g. BatchNorm's
    num_batches_tracked) in float64, rounded back. One fused `add_(x, alpha=w)` per
    client and tensor: each reply is read once while one tensor's accumulator (at most
    a few MiB) stays in cache. Cutting tensors into L2-sized chunks across clients was
    measured slower: it multiplies the calls, each with its own fork/join.
    """
    if not clients or len(clients) != len(weights):
        raise ValueError("weighted_mean needs one weight per client and at least one client")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {total}")
    alphas = [w / total for w in weights]
    clients = stage(clients, device)
    first = clients[0]
    # Small tensors (biases, norms: most keys, little data) go through one foreach call per
    # client instead of one call per tensor and client: the per-call overhead dominates them.
    small = [k for k, t in first.items() if t.numel() < SMALL_TENSOR and _accumulator_dtype(t.dtype) == t.dtype]
    small_out: TensorDict = {}
    if small:
        accs = torch._foreach_mul([first[k] for k in small], alphas[0])
        for tensors, alpha in zip(clients[1:], alphas[1:], strict=True):
            torch._foreach_add_(accs, [tensors[k] for k in small], alpha=alpha)
        small_out = dict(zip(small, accs, strict=True))
    out: TensorDict = {}
    for key, ref in first.items():
        if key in small_out:
            out[key] = small_out[key]
            continue
        acc_dtype = _accumulator_dtype(ref.dtype)
        if acc_dtype == ref.dtype:  # the first client initialises the accumulator: no zero-fill pass
            acc = torch.mul(ref, alphas[0])
            rest = zip(clients[1:], alphas[1:], strict=True)
        else:  # widened (half, integer): every client is added in the accumulator's precision
            acc = torch.zeros(ref.shape, dtype=acc_dtype, device=device)
            rest = zip(clients, alphas, strict=True)
        for tensors, alpha in rest:
            acc.add_(tensors[key], alpha=alpha)
        if acc.dtype != ref.dtype:
            acc = (acc if ref.is_floating_point() else acc.round()).to(ref.dtype)
        out[key] = acc
    return out


def flatten(tensors: Mapping[str, torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Concatenate the floating-point tensors (in key order) into one float32 vector."""
    parts = [t.reshape(-1).to(device=device, dtype=torch.float32) for t in tensors.values() if t.is_floating_point()]
    return torch.cat(parts) if parts else torch.empty(0, device=device)


def unflatten(vector: torch.Tensor, like: Mapping[str, torch.Tensor]) -> TensorDict:
    """Inverse of `flatten`: floating-point tensors are cut from `vector`, the rest copied from `like`."""
    needed = sum(t.numel() for t in like.values() if t.is_floating_point())
    if needed != vector.numel():
        raise ValueError(f"vector has {vector.numel()} values, the model needs {needed}")
    out: TensorDict = {}
    offset = 0
    for key, ref in like.items():
        if ref.is_floating_point():
            n = ref.numel()
            out[key] = vector[offset : offset + n].view(ref.shape).to(ref.dtype)
            offset += n
        else:
            out[key] = ref.clone()
    return out

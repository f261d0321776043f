"""Codecs for a model update ("compressed uplink with error feedback"; the downlink's deltas use them
too): `encode` / `decode` between an update (named tensors) and named parts of numpy dtypes, `bundle` /
`unbundle` into one byte array, and error feedback. The parts per mode: docs/compression.md#the-payload-layout

Which parts a tensor has depends only on the reference model `like`, the mode and the settings
(`_plan`, shared by both sides). The bytes come from untrusted nodes: `decode` raises `MalformedPayload`
(naming the part and the problem) for every payload that does not match, never another exception type,
and values must be finite and representable in like's dtype in every mode (`none` included), so a
decoded update holds no NaN or inf. Everything runs in torch on the update's device, with no Python
loop over elements.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from app.config.schema import COMPRESSIONS

MODES = COMPRESSIONS  # the config's compression.name values

# Per-channel int8 scales for weight matrices and kernels with at least this many elements: their
# output channels' ranges differ by orders of magnitude, and the (C,) scales cost C * 4 bytes, under
# 1/8 of the payload here even with one scale per 32 elements. Smaller tensors (biases, norms) get one.
PER_CHANNEL_MIN_NUMEL = 4096

# topk on tensors this large first narrows the candidates with a threshold estimated from a strided
# sample (`_topk_positions`); smaller ones call torch.topk on the whole tensor. Measured on the 2-core
# CPU (one torch thread; another job on the cores), k = 1%, ms for topk(abs) + sort of the positions /
# kthvalue(abs) + mask / sample: n = 65536: 0.5 / 0.9 / 0.9; 262144: 2.6 / 2.3 / 1.8;
# 589824: 7.4 / 11.8 / 3.1; 2359296: 57 / 58 / 12; 11M: 370 / 320 / 48.
TOPK_SAMPLE_MIN_NUMEL = 1 << 18
_TOPK_SAMPLE_SIZE = 1 << 16

# Symmetric int8: q in [-127, 127] (-128 is never produced). Scales map max|x| to slightly less than 127
# so that stochastic rounding cannot reach 128 through float rounding (see `_quantize`).
_INT8_SPAN = 127 * (1 - 2**-20)
_FLOAT32_TINY = torch.finfo(torch.float32).tiny
_WIRE_FLOATS = (torch.float16, torch.float32, torch.float64)  # float dtypes numpy has
_BITS = (1, 2, 4, 8, 16, 32, 64, 128)

Update = dict[str, torch.Tensor]


class MalformedPayload(ValueError):
    """A compressed reply that cannot be decoded (the message says which part and what is wrong)."""


def topk_count(numel: int, ratio: float) -> int:
    """How many entries topk keeps of a tensor with `numel` elements: round(ratio * numel), at least 1."""
    return max(1, min(numel, round(ratio * numel)))


def check_settings(mode: str, ratio: float = 0.01) -> None:
    """Raise ValueError for an unknown mode or a ratio outside (0, 1] (both sides call this first)."""
    if mode not in MODES:
        raise ValueError(f"unknown compression mode {mode!r}; allowed: {', '.join(MODES)}")
    if not (isinstance(ratio, int | float) and 0.0 < ratio <= 1.0):  # also refuses NaN
        raise ValueError(f"topk ratio must be in (0, 1], got {ratio!r}")


def payload_nbytes(parts: Mapping[str, torch.Tensor]) -> int:
    """The bytes of the parts' data (an ArrayRecord adds a header of about 128 bytes per part)."""
    return sum(t.numel() * t.element_size() for t in parts.values())


# ---------------------------------------------------------------------------------------------
# The layout: which parts each tensor has, from its shape and dtype alone.


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor travels as when sent exactly: its own, or raw bits for floats numpy lacks."""
    if dtype.is_floating_point and dtype not in _WIRE_FLOATS:
        return {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
    return dtype


def _kind(t: torch.Tensor, mode: str) -> str:
    if not t.dtype.is_floating_point or t.numel() == 0 or mode == "none":
        return "exact"
    return mode


def _per_channel(shape: torch.Size) -> bool:
    return len(shape) >= 2 and math.prod(shape) >= PER_CHANNEL_MIN_NUMEL


def _uses_mask(numel: int, k: int) -> bool:
    index_bytes = k * (2 if numel <= 65536 else 4)
    return (numel + 7) // 8 < index_bytes


def _plan(key: str, t: torch.Tensor, mode: str, ratio: float, quantize_values: bool) -> dict[str, tuple]:
    """{part name: (dtype, shape)} that `encode` produces for tensor `t` named `key`."""
    kind, shape, n = _kind(t, mode), tuple(t.shape), t.numel()
    if kind == "exact":
        return {key: (_wire_dtype(t.dtype), shape)}
    if kind == "fp16":
        return {key: (torch.float16, shape)}
    if kind == "bf16":
        return {key: (torch.int16, shape)}
    if kind == "int8":
        return {
            f"{key}/q": (torch.int8, shape),
            f"{key}/scale": (torch.float32, (shape[0] if _per_channel(t.shape) else 1,)),
        }
    k = topk_count(n, ratio)
    plan = {f"{key}/val": (torch.int8 if quantize_values else torch.float32, (k,))}
    if quantize_values:
        plan[f"{key}/scale"] = (torch.float32, (1,))
    if _uses_mask(n, k):
        plan[f"{key}/mask"] = (torch.uint8, ((n + 7) // 8,))
    else:
        plan[f"{key}/idx"] = (torch.uint16 if n <= 65536 else torch.int32, (k,))
    return plan


def _layout(tensors: Mapping[str, torch.Tensor], mode: str, ratio: float, quantize_values: bool) -> dict[str, dict]:
    """Every key's plan; refuses keys whose part names would collide (e.g. "w/q" next to an int8 "w")."""
    layout, owner = {}, {}
    for key, t in tensors.items():
        layout[key] = _plan(key, t, mode, ratio, quantize_values)
        for name in layout[key]:
            if name in owner:
                raise ValueError(f"part name {name!r} of {key!r} collides with a part of {owner[name]!r}")
            owner[name] = key
    return layout


# ---------------------------------------------------------------------------------------------
# int8: symmetric scale, stochastic rounding.


class _Uniform:
    """U(0, 1) float32 noise for stochastic rounding, drawn from the caller's generator, one per encode.

    On a GPU: torch's generator (Philox, parallel), 24-bit resolution. On the CPU torch's generator
    is a Mersenne Twister that fills one element at a time on one thread (58-75 ms for 11M floats on
    the 2-core CPU) and numpy's float32 fill is not much better (28-52 ms); so CPU noise is 16 random
    bits per element, (b + 1/2) / 2^16 for b uniform in [0, 2^16), from the raw output of a PCG64
    seeded by one draw from the generator: 11 ms of random bits plus three vectorised passes.
    Rounding then stays unbiased to within 2^-17 of a step, far below what any tensor's step
    resolves. Reproducible from a seeded generator, and it advances the generator as any other use
    would. The noise is written into one scratch buffer per device, reused for every tensor (a fresh
    44 MB buffer costs ~25 ms of page faults on this VM).
    """

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator
        self._cpu: np.random.Generator | None = None
        self._scratch: dict[torch.device, torch.Tensor] = {}

    def __call__(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Noise of `shape` on `device`, valid until the next call (it lives in the scratch buffer)."""
        numel = math.prod(shape)
        scratch = self._scratch.get(device)
        if scratch is None or scratch.numel() < numel:
            scratch = self._scratch[device] = torch.empty(numel, dtype=torch.float32, device=device)
        out = scratch[:numel].view(shape)
        if device.type != "cpu":
            return out.uniform_(0.0, 1.0, generator=self.generator)
        if self._cpu is None:
            seed = torch.randint(0, 2**63 - 1, (), generator=self.generator, dtype=torch.int64)
            self._cpu = np.random.PCG64(int(seed))
        bits = torch.from_numpy(self._cpu.random_raw((numel + 3) // 4).view(np.int16)[:numel])
        # int16 b' = b - 2^15: u = (b' + 2^15 + 1/2) / 2^16, in [2^-17, 1 - 2^-17].
        return out.view(-1).copy_(bits).mul_(2.0**-16).add_(0.5 + 2.0**-17).view(shape)


def _quantize(x: torch.Tensor, per_channel: bool, uniform: _Uniform) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 scales of `x`: symmetric, q = floor(x / scale + u), u ~ U[0, 1).

    Symmetric (scale = max|x| / 127, no zero point) rather than affine: a zero stays exactly zero
    (stochastic rounding of an integer is that integer), so entries a round did not change and the
    rows of a sparse update carry no noise; there is one parameter per group to send and to check
    (finite, > 0); and updates (and topk's values, large of both signs) are centred on zero, where
    affine's range [min, max] is no narrower than [-max|x|, max|x|]. The cost is at most a twice
    coarser step on a one-sided tensor.

    Stochastic rounding makes the code unbiased: with u uniform, P(q = floor(y) + 1) = y - floor(y),
    so E[q * scale] = x (up to float rounding and the noise's resolution, `_Uniform`), and the error
    of the sum over rounds and nodes averages out instead of accumulating like round-to-nearest's.
    |error| < one step (scale) per element. A constant or all-zero group works: scale is clamped to
    the smallest normal float32, so nothing divides by zero and zeros decode to zero.
    """
    xf = x.float()
    groups = xf.reshape(x.shape[0], -1) if per_channel else xf.reshape(1, -1)
    # amax and amin: two passes without a buffer, 5x faster on a CPU than aminmax(dim=1) or abs().amax().
    # NaN propagates into the scale, which decode refuses.
    scale = torch.maximum(groups.amax(dim=1), groups.amin(dim=1).neg_()).div_(_INT8_SPAN).clamp_min_(_FLOAT32_TINY)
    work = uniform(tuple(groups.shape), x.device)
    work.addcmul_(groups, scale.reciprocal().unsqueeze(1))  # u + x / scale, in place: no extra buffer
    # scale is max|x| / (127 (1 - 2^-20)): |x / scale| <= 127 - 1.2e-4 (+ a few float32 ulps of 7.6e-6),
    # so u + x / scale rounds into [-127, 128) and floor lands in [-127, 127] without a clamp pass.
    return work.floor_().to(torch.int8).reshape(x.shape), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    out.copy_(q)  # int8 -> float32, then an in-place multiply: no promoted temporary
    out.reshape(scale.numel(), -1).mul_(scale.unsqueeze(1))
    return out


# ---------------------------------------------------------------------------------------------
# topk: selection and the packing of positions.


def _topk_positions(flat: torch.Tensor, k: int, sample_min_numel: int = TOPK_SAMPLE_MIN_NUMEL) -> torch.Tensor:
    """The positions (int64, increasing) of the k largest |flat| entries; NaN counts as largest.

    torch.topk over |x| is exact and fine for small tensors, but its cost grows faster than linearly
    on a CPU (see the numbers at TOPK_SAMPLE_MIN_NUMEL). On a large tensor a strided sample of 65536
    elements gives a threshold a few standard errors below the k-th largest magnitude; the entries not
    below it (a few percent more than k, found with two comparisons and no |x| buffer) are the
    candidates, and topk over them picks exactly k. If the sample misled (fewer than k candidates) it
    falls back to topk over the whole tensor, so the result is always the exact top k.
    """
    n = flat.numel()
    if n >= sample_min_numel and 8 * k <= n:
        sample = flat[:: max(1, n // _TOPK_SAMPLE_SIZE)].abs()
        expected = k * sample.numel() / n
        ks = math.ceil(expected + 4 * math.sqrt(expected) + 8)
        if ks < sample.numel():
            threshold = torch.topk(sample, ks, sorted=False).values.min()
            below = torch.lt(flat, threshold).logical_and_(torch.gt(flat, -threshold))
            candidates = below.logical_not_().nonzero().squeeze(1)  # NaN is never "below": it stays in
            if candidates.numel() >= k:
                chosen = torch.topk(flat[candidates].abs(), k, sorted=False).indices
                return candidates[chosen.sort().values]  # candidates are increasing
    return torch.topk(flat.abs(), k, sorted=False).indices.sort().values


def _pack_mask(positions: torch.Tensor, numel: int) -> torch.Tensor:
    bits = torch.zeros((numel + 7) // 8 * 8, dtype=torch.bool, device=positions.device)
    bits[positions] = True
    weights = torch.tensor(_BITS, dtype=torch.uint8, device=positions.device)
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_mask(mask: torch.Tensor) -> torch.Tensor:
    weights = torch.tensor(_BITS, dtype=torch.uint8, device=mask.device)
    return mask.unsqueeze(1).bitwise_and(weights).ne_(0).reshape(-1)


# ---------------------------------------------------------------------------------------------
# encode


def encode(
    update: Mapping[str, torch.Tensor],
    mode: str,
    *,
    ratio: float = 0.01,
    quantize_values: bool = False,
    generator: torch.Generator | None = None,
) -> Update:
    """The parts for `update` in `mode` (layout: docs/compression.md#the-payload-layout), on its device.

    `ratio` (topk) and `quantize_values` (topk: int8 values) must be the ones `decode` is given.
    `generator` drives int8's stochastic rounding (on the update's device; None: torch's default):
    pass a seeded one for reproducible payloads. The update itself is never modified.
    """
    check_settings(mode, ratio)
    layout = _layout(update, mode, ratio, quantize_values)
    uniform = _Uniform(generator)
    parts: Update = {}
    for key, x in update.items():
        kind = _kind(x, mode)
        if kind == "exact":
            wire = _wire_dtype(x.dtype)
            parts[key] = x if wire == x.dtype else x.view(wire)
        elif kind == "fp16":
            # Saturate: an entry beyond fp16's range would become inf and get the whole reply refused.
            parts[key] = x if x.dtype == torch.float16 else x.to(torch.float16).clamp_(-65504, 65504)
        elif kind == "bf16":
            parts[key] = x.to(torch.bfloat16).view(torch.int16)
        elif kind == "int8":
            parts[f"{key}/q"], parts[f"{key}/scale"] = _quantize(x, _per_channel(x.shape), uniform)
        else:
            flat = x.reshape(-1)
            positions = _topk_positions(flat, topk_count(flat.numel(), ratio))
            values = flat[positions].float()
            if quantize_values:
                parts[f"{key}/val"], parts[f"{key}/scale"] = _quantize(values, False, uniform)
            else:
                parts[f"{key}/val"] = values
            if f"{key}/mask" in layout[key]:
                parts[f"{key}/mask"] = _pack_mask(positions, flat.numel())
            else:
                parts[f"{key}/idx"] = positions.to(layout[key][f"{key}/idx"][0])
    return parts


# ---------------------------------------------------------------------------------------------
# decode: validate everything before using it.


def _fmt(dtype: torch.dtype, shape: tuple) -> str:
    return f"{str(dtype).removeprefix('torch.')} of shape {tuple(shape)}"


def _check_range(name: str, values: torch.Tensor, like_dtype: torch.dtype) -> None:
    """Finite, and representable in like's dtype (so the decoded update holds no inf either)."""
    if values.numel() == 0:
        return
    lo, hi = torch.aminmax(values)
    limit = torch.finfo(like_dtype).max
    if not (-limit <= float(lo) and float(hi) <= limit):  # NaN fails both comparisons
        raise MalformedPayload(f"{name}: non-finite or out-of-range values (min {float(lo)}, max {float(hi)})")


def _check_scale(name: str, scale: torch.Tensor, like_dtype: torch.dtype) -> None:
    # 128 * scale must stay finite in like's dtype (an int8 code may be -128 even though we never send it).
    limit = torch.finfo(like_dtype).max / 128
    lo, hi = torch.aminmax(scale.double())
    if not (0 < float(lo) and float(hi) <= limit):  # NaN fails both
        raise MalformedPayload(
            f"{name}: scales must be finite, > 0 and <= {limit:.3g}; got min {float(lo)}, max {float(hi)}"
        )


def _decode_values(key: str, got: dict[str, torch.Tensor], like_dtype: torch.dtype) -> torch.Tensor:
    """topk's values as float32: plain, or int8 codes with their scale."""
    values = got[f"{key}/val"]
    if f"{key}/scale" in got:
        _check_scale(f"{key}/scale", got[f"{key}/scale"], like_dtype)
        return _dequantize(values, got[f"{key}/scale"])
    _check_range(f"{key}/val", values, like_dtype)
    return values


def _decode_positions(key: str, got: dict[str, torch.Tensor], numel: int, k: int) -> torch.Tensor:
    """topk's positions (int64, strictly increasing, in [0, numel)) from the index array or the mask."""
    if f"{key}/mask" in got:
        bits = _unpack_mask(got[f"{key}/mask"])
        if bits[numel:].any():
            raise MalformedPayload(f"{key}/mask: bits set past the tensor's {numel} elements")
        count = int(bits.sum())
        if count != k:
            raise MalformedPayload(f"{key}/mask: {count} bits set, expected {k} (ratio and {numel} elements)")
        return bits[:numel].nonzero().squeeze(1)
    positions = got[f"{key}/idx"].to(torch.int64)
    first, last = int(positions[0]), int(positions[-1])
    if first < 0 or last >= numel:
        raise MalformedPayload(f"{key}/idx: index out of range [0, {numel}) (first {first}, last {last})")
    if k > 1 and not bool((positions[1:] > positions[:-1]).all()):
        raise MalformedPayload(f"{key}/idx: indices must be strictly increasing (repeated or unsorted)")
    return positions


@dataclass(frozen=True)
class Piece:
    """One tensor's update as checked parts, not yet dense: `values` alone (exact, fp16, bf16: in
    like's dtype), int8 codes with their `scale`, or topk's `values` (float32) at `positions`."""

    kind: str
    values: torch.Tensor
    scale: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def dense(self, ref: torch.Tensor) -> torch.Tensor:
        """The update as a tensor shaped and typed like `ref` (may share memory with the parts)."""
        if self.kind == "int8":
            return _dequantize(self.values, self.scale).to(ref.dtype)
        if self.kind == "topk":
            out = torch.zeros(ref.numel(), dtype=ref.dtype, device=ref.device)
            out[self.positions] = self.values.to(ref.dtype)
            return out.view(ref.shape)
        return self.values

    def add_to(self, acc: torch.Tensor, alpha: float) -> None:
        """acc += alpha * update, without a dense copy of a topk update (int8: one float tensor)."""
        if self.kind == "topk":
            acc.view(-1).index_add_(
                0, self.positions.to(acc.device), self.values.to(acc.device, acc.dtype), alpha=alpha
            )
        elif self.kind == "int8":
            q = self.values.to(acc.device, acc.dtype).reshape(self.scale.numel(), -1)
            acc.view(self.scale.numel(), -1).addcmul_(q, self.scale.to(acc.device, acc.dtype).unsqueeze(1), value=alpha)
        else:
            acc.add_(self.values.to(acc.device, acc.dtype), alpha=alpha)


def check_parts(
    parts: Mapping[str, torch.Tensor],
    like: Mapping[str, torch.Tensor],
    mode: str,
    *,
    ratio: float = 0.01,
    quantize_values: bool = False,
) -> dict[str, Piece]:
    """Every check `decode` makes, on like's device, without building the dense update: the bytes
    come from an untrusted node, and anything that does not match the layout `encode` produces for
    `like` with these settings raises MalformedPayload."""
    check_settings(mode, ratio)
    layout = _layout(like, mode, ratio, quantize_values)
    if not isinstance(parts, Mapping):
        raise MalformedPayload(f"expected a mapping of named tensors, got {type(parts).__name__}")
    expected = {name for plan in layout.values() for name in plan}
    missing = sorted(expected.difference(parts))
    if missing:
        raise MalformedPayload(
            f"missing part {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    extra = [name for name in parts if name not in expected]
    if extra:
        raise MalformedPayload(
            f"unexpected part {extra[0]!r}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )

    out: dict[str, Piece] = {}
    for key, ref in like.items():
        got: dict[str, torch.Tensor] = {}
        for name, (dtype, shape) in layout[key].items():
            t = parts[name]
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                raise MalformedPayload(f"{name}: expected a dense tensor, got {type(t).__name__}")
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise MalformedPayload(f"{name}: expected {_fmt(dtype, shape)}, got {_fmt(t.dtype, t.shape)}")
            got[name] = t.to(ref.device)
        kind = _kind(ref, mode)
        if kind in ("exact", "fp16", "bf16"):
            t = got[key]
            if kind == "bf16":
                t = t.view(torch.bfloat16)
            elif kind == "exact" and t.dtype != ref.dtype:  # the raw bits of a float dtype numpy lacks
                t = t.view(ref.dtype)
            if t.dtype.is_floating_point:
                _check_range(key, t, ref.dtype)
            out[key] = Piece(kind, t.to(ref.dtype))
        elif kind == "int8":
            _check_scale(f"{key}/scale", got[f"{key}/scale"], ref.dtype)
            out[key] = Piece(kind, got[f"{key}/q"], scale=got[f"{key}/scale"])
        else:
            n = ref.numel()
            positions = _decode_positions(key, got, n, topk_count(n, ratio))
            out[key] = Piece(kind, _decode_values(key, got, ref.dtype), positions=positions)
    return out


def decode(
    parts: Mapping[str, torch.Tensor],
    like: Mapping[str, torch.Tensor],
    mode: str,
    *,
    ratio: float = 0.01,
    quantize_values: bool = False,
) -> Update:
    """The dense update that `parts` encode, with like's keys, shapes and dtypes, on like's device.

    `like` (the model the node trained from, or any tensors of its shapes and dtypes) is trusted; the
    parts are not: see `check_parts`. A returned tensor may share memory with its part.
    """
    pieces = check_parts(parts, like, mode, ratio=ratio, quantize_values=quantize_values)
    return {key: piece.dense(like[key]) for key, piece in pieces.items()}


# ---------------------------------------------------------------------------------------------
# One byte array for the link


def _bundle_order(layout: dict[str, dict]) -> list[tuple[str, torch.dtype, tuple]]:
    """Every part as (name, dtype, shape), widest dtype first (each part's byte offset is then a
    multiple of its item size, so the receiver views it in place), then by name: the order depends
    on the model's names, shapes and dtypes only, not on the order a dict happens to hold them in."""
    parts = [(name, dtype, shape) for plan in layout.values() for name, (dtype, shape) in plan.items()]
    return sorted(parts, key=lambda p: (-p[1].itemsize, p[0]))


def bundle(
    parts: Mapping[str, torch.Tensor],
    like: Mapping[str, torch.Tensor],
    mode: str,
    *,
    ratio: float = 0.01,
    quantize_values: bool = False,
) -> torch.Tensor:
    """The parts as one uint8 tensor, in the order `_bundle_order` gives for `like`'s layout.

    An ArrayRecord spends ~128 bytes of headers per array (its .npy header and the protobuf
    fields): on the default task's 22 small tensors that is 5% of an int8 payload. One array
    spends it once; `unbundle` recovers the parts from `like` and the settings alone.
    """
    order = _bundle_order(_layout(like, mode, ratio, quantize_values))
    flat = [parts[name].reshape(-1).view(torch.uint8) for name, _, _ in order if parts[name].numel()]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def unbundle(
    payload: torch.Tensor,
    like: Mapping[str, torch.Tensor],
    mode: str,
    *,
    ratio: float = 0.01,
    quantize_values: bool = False,
) -> Update:
    """The parts `bundle` packed (views into `payload`), or MalformedPayload when its size is wrong."""
    check_settings(mode, ratio)
    order = _bundle_order(_layout(like, mode, ratio, quantize_values))
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise MalformedPayload(f"payload: expected a 1-D uint8 array, got {_fmt(payload.dtype, payload.shape)}")
    expected = sum(dtype.itemsize * math.prod(shape) for _, dtype, shape in order)
    if payload.numel() != expected:
        raise MalformedPayload(f"payload: {payload.numel()} bytes, expected {expected} for this model and mode")
    parts, offset = {}, 0
    for name, dtype, shape in order:
        size = dtype.itemsize * math.prod(shape)
        parts[name] = payload[offset : offset + size].view(dtype).view(shape)
        offset += size
    return parts


# ---------------------------------------------------------------------------------------------
# error feedback


def with_error_feedback(
    update: Mapping[str, torch.Tensor],
    residual: Mapping[str, torch.Tensor] | None,
    mode: str,
    *,
    ratio: float = 0.01,
    quantize_values: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Update, Update]:
    """Encode update + residual; return the parts and the new residual (what the parts did not carry).

    compensated = update + residual (a missing residual or key counts as zeros); parts =
    encode(compensated); new residual = compensated - decode(parts). So over rounds the decoded updates
    sum to the true updates minus the last residual, exactly up to float rounding: what topk drops
    or int8 rounds away is sent later instead of lost. The residual holds the floating-point keys only
    (the rest is sent exactly), in the update's dtype and on its device; keep it in the node's state.
    Raises ValueError when update + residual is not finite: the server would refuse it, and a NaN
    residual would spoil every later round of this node.
    """
    residual = residual or {}
    compensated: Update = {}
    for key, x in update.items():
        r = residual.get(key)
        if r is None or not x.dtype.is_floating_point:
            compensated[key] = x
        elif r.shape != x.shape:
            raise ValueError(f"residual {key!r} has shape {tuple(r.shape)}, the update {tuple(x.shape)}")
        else:
            compensated[key] = x + r.to(device=x.device, dtype=x.dtype)
    parts = encode(compensated, mode, ratio=ratio, quantize_values=quantize_values, generator=generator)
    try:
        sent = decode(parts, compensated, mode, ratio=ratio, quantize_values=quantize_values)
    except MalformedPayload as e:
        raise ValueError(f"the update (plus the residual) cannot be sent: {e}") from None
    new_residual = {key: compensated[key] - sent[key] for key, x in update.items() if x.dtype.is_floating_point}
    return parts, new_residual

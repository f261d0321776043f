"""Tensor maths shared by our strategies: zero-copy views of Flower Arrays, the
weighted mean, and flatten/unflatten for strategies that work on one vector per client.

Flower's `aggregate_arrayrecords` deserialises every Array with `np.load` (a copy),
multiplies it into a new array (another copy) and adds. Here a received Array is
viewed in place (`torch.frombuffer` over its .npy payload) and accumulated with one
fused `add_(x, alpha=w)` per tensor, on the server's device.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

TensorDict = dict[str, torch.Tensor]


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def array_view(array: Array) -> torch.Tensor:
    """Read-only CPU tensor over an Array's .npy bytes, without copying.

    Raises ValueError when the payload is not a plain C-order numeric .npy array or
    disagrees with the Array's declared shape and dtype (a malformed or lying reply).
    """
    data = array.data
    buf = io.BytesIO(data)
    version = np.lib.format.read_magic(buf)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf)
    if fortran or dtype.hasobject or not dtype.isnative or dtype.kind not in "biuf":
        raise ValueError(f"unsupported array payload (dtype {dtype}, fortran_order={fortran})")
    if tuple(shape) != tuple(array.shape) or str(dtype) != array.dtype:
        raise ValueError(f"payload is {dtype}{list(shape)} but declares {array.dtype}{list(array.shape)}")
    offset = buf.tell()
    count = math.prod(shape)
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(f"payload has {len(data) - offset} bytes, expected {count * dtype.itemsize}")
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # bytes are read-only; we never write
        flat = torch.frombuffer(data, dtype=torch_dtype(dtype), count=count, offset=offset)
    return flat.view(shape)


def record_to_tensors(record: ArrayRecord) -> TensorDict:
    """Zero-copy views of every Array in a record."""
    return {key: array_view(arr) for key, arr in record.items()}


def tensors_to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: Array(t.detach().cpu().numpy()) for k, t in tensors.items()})


def is_finite(t: torch.Tensor) -> bool:
    """All values finite, checked through one reduction (no n-sized boolean mask).

    A finite sum implies finite elements; NaN or Inf anywhere makes the sum non-finite.
    Half types are summed in float32 so large-but-finite models do not overflow.
    """
    if not t.is_floating_point():
        return True
    total = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
    return bool(torch.isfinite(total))


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float32, torch.float64):
        return dtype
    return torch.float32 if dtype.is_floating_point else torch.float64


def weighted_mean(
    clients: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], device: torch.device
) -> TensorDict:
    """Σ wᵢ xᵢ / Σ wᵢ per key, accumulated in place on `device`; dtypes are preserved.

    Half-precision tensors accumulate in float32 and integer tensors (e.g. BatchNorm's
    num_batches_tracked) in float64, rounded back.
    """
    if not clients or len(clients) != len(weights):
        raise ValueError("weighted_mean needs one weight per client and at least one client")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {total}")
    out: TensorDict = {}
    for key, ref in clients[0].items():
        acc = torch.zeros(ref.shape, dtype=_accumulator_dtype(ref.dtype), device=device)
        for tensors, w in zip(clients, weights, strict=True):
            acc.add_(tensors[key].to(device, non_blocking=True), alpha=w / total)
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

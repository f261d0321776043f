"""Block-wise maths of the Byzantine-robust aggregators, on client *updates*.

An update is a client's model minus the model it was sent (its base). Every function
takes the models and their bases separately and forms update blocks on the fly: a
synchronous round passes the same global model as every base, the asynchronous
buffer passes each update's own version. Nothing materialises the n x d update
matrix: work goes through one n x block buffer at a time, so the extra memory beyond
the received arrays is one model-sized output plus one block (plus n x n scalars).

On another device than the replies' (a GPU server), every function first `stage`s its
models and bases there, one upload per distinct dict; a rule that calls several of
them stages once at its entry (`stage_groups`), so the later calls copy nothing. The
device then also holds the n replies and their distinct bases for the rule's duration.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Mapping, Sequence

import torch

from strategies.tensor_ops import TensorDict, stage

DEFAULT_BLOCK_BYTES = 4 << 20  # 4 MiB: the n x block float32 buffer stays in cache


def stage_groups(device: torch.device, *groups: Sequence[Mapping[str, torch.Tensor]]) -> list[list[TensorDict]]:
    """`stage` of several lists at once (e.g. [current], models, bases), split back: a dict
    in more than one list (the global model as every base) is uploaded once."""
    staged = stage([d for group in groups for d in group], device)
    out, start = [], 0
    for group in groups:
        out.append(staged[start : start + len(group)])
        start += len(group)
    return out


def float_keys(like: TensorDict) -> list[str]:
    return [k for k, t in like.items() if t.is_floating_point()]


def update_dtype(t: torch.Tensor) -> torch.dtype:
    """Updates are float32 (float64 for integer tensors, rounded back by `apply_update`)."""
    return torch.float32 if t.is_floating_point() else torch.float64


def blocks(numel: int, block: int) -> Iterator[tuple[int, int]]:
    for start in range(0, numel, block):
        yield start, min(start + block, numel)


def block_elems(n: int, block_bytes: int) -> int:
    return max(1024, block_bytes // (4 * max(n, 1)))


def fill_update_block(
    out: torch.Tensor, models: Sequence[TensorDict], bases: Sequence[TensorDict], key: str, start: int, end: int
) -> torch.Tensor:
    """out[i] = (models[i][key] - bases[i][key]).flatten()[start:end], in out's dtype; models
    and bases are on out's device already (`stage`)."""
    for i, (model, base) in enumerate(zip(models, bases, strict=True)):
        torch.sub(model[key].reshape(-1)[start:end], base[key].reshape(-1)[start:end], out=out[i])
    return out


def _scratch(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """A float32 rows x cols work buffer whose memory is gone once the tensor is.

    On the CPU it is an anonymous mmap: a buffer of a few MiB freed through malloc
    stays in the process's heap, so the block would still be resident while the
    output model is built; unmapped, the peak stays one block or one output.
    """
    if device.type != "cpu" or rows * cols == 0:
        return torch.empty(rows, cols, dtype=torch.float32, device=device)
    return torch.frombuffer(mmap.mmap(-1, rows * cols * 4), dtype=torch.float32).view(rows, cols)


def _packed_blocks(sizes: Sequence[int], block: int) -> Iterator[list[tuple[int, int, int, int]]]:
    """Cut the concatenation of tensors of `sizes` into blocks of at most `block` values.

    Each block is a list of (tensor index, start, end, column offset in the block):
    small tensors (biases, norms) share a block instead of costing a matrix product each.
    """
    parts: list[tuple[int, int, int, int]] = []
    filled = 0
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(size - start, block - filled)
            parts.append((index, start, start + take, filled))
            start += take
            filled += take
            if filled == block:
                yield parts
                parts, filled = [], 0
    if parts:
        yield parts


def update_gram(
    models: Sequence[TensorDict],
    bases: Sequence[TensorDict],
    device: torch.device,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> torch.Tensor:
    """G[i, j] = <Δᵢ, Δⱼ> over all floating-point tensors, accumulated in float64.

    The floating-point tensors are walked as one concatenated vector, n x block values
    at a time (small tensors share a block). Each block is a float32 BLAS matrix
    product (B Bᵀ, into a reused n x n buffer); the sum over blocks is float64 so large
    models do not lose the small differences between nearby updates. A non-finite
    value anywhere in update i makes G[i, i] non-finite and leaves the entries between
    finite updates untouched: the diagonal doubles as a finiteness check of every update.
    """
    n = len(models)
    models, bases = stage_groups(device, models, bases)
    gram = torch.zeros(n, n, dtype=torch.float64, device=device)
    keys = float_keys(models[0])
    if not keys:
        return gram
    block = block_elems(n, block_bytes)
    sizes = [models[0][k].numel() for k in keys]
    buf = _scratch(n, min(block, sum(sizes)), device)
    prod = torch.empty(n, n, dtype=torch.float32, device=device)

    def flat(tensors: TensorDict) -> list[torch.Tensor]:
        return [tensors[k].reshape(-1) for k in keys]

    flat_models = [flat(m) for m in models]
    flat_bases: dict[int, list[torch.Tensor]] = {}  # a synchronous round has one base for all
    for b in bases:
        flat_bases.setdefault(id(b), flat(b))
    rows = list(zip(flat_models, [flat_bases[id(b)] for b in bases], strict=True))
    for parts in _packed_blocks(sizes, block):
        width = parts[-1][3] + parts[-1][2] - parts[-1][1]
        b = buf[:, :width]
        for i, (model, base) in enumerate(rows):
            row = b[i]
            for index, start, end, col in parts:
                torch.sub(model[index][start:end], base[index][start:end], out=row[col : col + end - start])
        torch.mm(b, b.T, out=prod)
        gram += prod
    return gram


def squared_distances(gram: torch.Tensor) -> torch.Tensor:
    """‖Δᵢ − Δⱼ‖² = Gᵢᵢ + Gⱼⱼ − 2Gᵢⱼ, clamped at 0 against rounding."""
    diag = gram.diagonal()
    return (diag[:, None] + diag[None, :] - 2 * gram).clamp_(min=0)


def krum_scores(distances: torch.Tensor, num_byzantine: int) -> torch.Tensor:
    """Krum score of each client: the sum of its n − f − 2 smallest distances to others.

    Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent" (https://arxiv.org/abs/1703.02757).
    """
    n = distances.shape[0]
    k = n - num_byzantine - 2
    if k < 1:
        raise ValueError(f"Krum needs n >= 2f + 3 updates (n={n}, f={num_byzantine})")
    others = distances + torch.diag(torch.full((n,), float("inf"), dtype=distances.dtype, device=distances.device))
    return others.topk(k, dim=1, largest=False).values.sum(dim=1)


def select_lowest(scores: torch.Tensor, m: int) -> list[int]:
    """Indices of the m lowest scores, best first (stable on ties)."""
    order = torch.sort(scores, stable=True).indices
    return [int(i) for i in order[:m]]


def coordinatewise(
    models: Sequence[TensorDict],
    bases: Sequence[TensorDict],
    trim: int | None,
    device: torch.device,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> TensorDict:
    """Coordinate-wise trimmed mean of the updates; trim=None gives the median.

    Per coordinate the n values are sorted; the trimmed mean averages the middle
    n − 2·trim, the median is the middle value (the mean of the two middle values for
    even n, as NumPy defines it). Unweighted, as in Yin et al. 2018 ("Byzantine-Robust
    Distributed Learning", https://arxiv.org/abs/1803.01498): sample counts are
    claims a Byzantine client could inflate. Integer tensors (BatchNorm counters)
    are aggregated in float64 and rounded back.
    """
    n = len(models)
    if trim is not None and not 0 <= 2 * trim < n:
        raise ValueError(f"trimming {trim} from each end of {n} values leaves nothing")
    models, bases = stage_groups(device, models, bases)
    block = block_elems(n, block_bytes)
    out: TensorDict = {}
    for key, ref in models[0].items():
        dtype = update_dtype(ref)
        result = torch.empty(ref.numel(), dtype=dtype, device=device)
        buf = torch.empty(n, min(block, ref.numel()), dtype=dtype, device=device)
        for start, end in blocks(ref.numel(), block):
            b = fill_update_block(buf[:, : end - start], models, bases, key, start, end)
            ordered = b.sort(dim=0).values
            if trim is None:
                mid = (n - 1) // 2
                value = ordered[mid] if n % 2 else (ordered[mid] + ordered[mid + 1]) / 2
            else:
                value = ordered[trim : n - trim].mean(dim=0)
            result[start:end] = value
        out[key] = result.view(ref.shape)
    return out


def weighted_update_mean(
    models: Sequence[TensorDict], bases: Sequence[TensorDict], weights: Sequence[float], device: torch.device
) -> TensorDict:
    """Σ wᵢ (modelᵢ − baseᵢ) / Σ wᵢ per key: the mean update of replies that trained from
    different models (the asynchronous buffer). Float32 for floating-point tensors,
    float64 for integer ones (`apply_update` rounds them back)."""
    total = float(sum(weights))
    if not models or len(weights) != len(models) or not total > 0:
        raise ValueError("weighted_update_mean needs one positive weight per update and at least one update")
    models, bases = stage_groups(device, models, bases)
    out: TensorDict = {}
    for key, ref in models[0].items():
        dtype = update_dtype(ref)
        acc = torch.zeros(ref.shape, dtype=dtype, device=device)
        for model, base, w in zip(models, bases, weights, strict=True):
            acc.add_(model[key].to(dtype), alpha=w / total).sub_(base[key].to(dtype), alpha=w / total)
        out[key] = acc
    return out


def apply_update(base: TensorDict, update: TensorDict) -> TensorDict:
    """base + update, back in base's dtypes (integer tensors rounded), on update's device
    (base `stage`d there)."""
    if update:
        (base,) = stage([base], next(iter(update.values())).device)
    out: TensorDict = {}
    for key, ref in base.items():
        value = ref.to(update[key].dtype) + update[key]
        out[key] = (value if ref.is_floating_point() else value.round()).to(ref.dtype)
    return out

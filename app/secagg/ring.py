"""What a node masks: its weighted update and a few weighted sums as one vector in the ring Z_M.

A coordinate x in [-c, c] (c = `clipping_range`) becomes the integer round(x / step) with
step = 2c / Q (Q = `quantization_range`), stored mod M. The sum of n such integers lies in
[-nQ/2, nQ/2]; while that is inside [-M/2, M/2) (`Ring.room`), the sum taken mod M and read
back centred is the exact integer sum, so the server's float sum is off only by the rounding:
stochastic rounding (unbiased, each node's error below one step) for plain secure aggregation,
rounding to nearest under distributed DP (its sensitivity bound needs a deterministic
rounding: app/privacy/skellam.py). The node's integer Skellam noise is added in the same ring.

Layout (both sides derive it: the server from the global model, a node from what it received):
the floating-point tensors the server aggregates, in the record's order, flattened; then the
`extras` the round asks for (weight, weighted loss and accuracy, the clipped fraction, the
adaptive clip's count), each scaled into [-c, c] by its `EXTRA_SCALE`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from app.secagg.prg import word_dtype

# extras: name -> divisor that brings the value into [-c, c] for any c >= 1 (a loss up to 64 fits)
WEIGHT, LOSS, ACCURACY, CLIPPED, UNCLIPPED = "weight", "loss", "accuracy", "clipped", "unclipped"
EXTRA_SCALE = {WEIGHT: 1.0, LOSS: 64.0, ACCURACY: 1.0, CLIPPED: 1.0, UNCLIPPED: 1.0}
PLAIN_EXTRAS = (WEIGHT, LOSS, ACCURACY, CLIPPED)  # plain secure aggregation: weighted sums
NOISE_STDS_OF_ROOM = 8.0  # the noise sum may take this many of its standard deviations before it could wrap


@dataclass(frozen=True)
class Ring:
    """Z_M with the fixed-point scale of the updates it carries."""

    clipping_range: float  # c: coordinates beyond +-c are clipped
    quantization_range: int  # Q: 2c is split into Q steps
    modulus: int  # M: a power of two

    @property
    def step(self) -> float:
        """The float value of one ring unit."""
        return 2.0 * self.clipping_range / self.quantization_range

    def room(self, summands: int, noise_std: float = 0.0) -> str | None:
        """Why a sum of `summands` inputs (and integer noise of std `noise_std` ring units) could wrap
        around the ring, or None when it cannot."""
        if self.modulus < 2 or self.modulus & (self.modulus - 1):
            return f"secagg.modulus_range must be a power of two, got {self.modulus}"
        need = summands * self.quantization_range / 2 + NOISE_STDS_OF_ROOM * noise_std
        if need >= self.modulus / 2:
            least = 2 ** math.ceil(math.log2(2 * need + 1))
            return (
                f"a sum of {summands} inputs of {self.quantization_range} quantization steps"
                + (f" plus noise of std {noise_std:.3g} steps" if noise_std else "")
                + f" can wrap around secagg.modulus_range={self.modulus}: raise it to at least {least}"
                " or lower secagg.quantization_range"
            )
        return None

    def encode(self, x: torch.Tensor, generator: torch.Generator | None) -> np.ndarray:
        """`x` (float, flat) clipped to [-c, c] in ring units mod M (`reduce`): stochastic rounding
        with a generator, rounding to nearest without one."""
        c = self.clipping_range
        y = x.detach().to(torch.float64).clamp(-c, c).div_(self.step)  # clamp copies: `x` is left alone
        ints = torch.floor(y) if generator is not None else torch.round(y)
        if generator is not None:  # up with probability frac(y): unbiased (uniforms to 2^-24: bias below that)
            up = y.sub_(ints) > torch.rand(y.shape, generator=generator, dtype=torch.float32)
            ints.add_(up)
        return self.reduce(ints.to(torch.int64).numpy())

    def reduce(self, ints: np.ndarray) -> np.ndarray:
        """Signed integers mod M, in [0, M) as the ring's wire word (`prg.word_dtype`: casting wraps
        modulo the word's 2^bits, which M divides)."""
        word = word_dtype(self.modulus)
        return ints.astype(np.int64).astype(word) & word.type(self.modulus - 1)

    def decode(self, total: np.ndarray) -> np.ndarray:
        """A sum mod M read back centred, in float units (float64)."""
        signed = total.astype(np.int64)
        signed[signed >= self.modulus // 2] -= self.modulus
        return signed.astype(np.float64) * self.step


@dataclass(frozen=True)
class Layout:
    """The masked vector's coordinates: the update's tensors, flattened, then the extras."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    extras: tuple[str, ...]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], extras: Sequence[str]) -> Layout:
        """The layout of the floating-point tensors of `tensors` (integer buffers are not averaged
        under secure aggregation: they keep the global model's values)."""
        floats = [k for k, t in tensors.items() if t.is_floating_point()]
        return cls(tuple(floats), tuple(tuple(tensors[k].shape) for k in floats), tuple(extras))

    @property
    def size(self) -> int:
        return sum(math.prod(s) for s in self.shapes) + len(self.extras)

    def flatten(self, update: Mapping[str, torch.Tensor], extras: Mapping[str, float]) -> torch.Tensor:
        """The float64 vector of `update` (keys in layout order) and the scaled extras."""
        parts = [update[k].detach().reshape(-1).to(torch.float64) for k in self.keys]
        parts.append(torch.tensor([extras[e] / EXTRA_SCALE[e] for e in self.extras], dtype=torch.float64))
        return torch.cat(parts)

    def split(self, vector: np.ndarray) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A decoded vector back into tensors (float64) and extras (unscaled)."""
        out, at = {}, 0
        for key, shape in zip(self.keys, self.shapes, strict=True):
            n = math.prod(shape)
            out[key] = torch.from_numpy(vector[at : at + n].copy()).reshape(shape)
            at += n
        extras = {e: float(vector[at + i]) * EXTRA_SCALE[e] for i, e in enumerate(self.extras)}
        return out, extras

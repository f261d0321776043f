"""The masks: a seed expanded into a vector uniform in the ring Z_M, M a power of two.

Flower's `secaggplus_utils.pseudo_rand_gen` folds a 32-byte seed into 32 bits (XOR of its 4-byte
words) and draws from NumPy's MT19937: a 2^32 search recovers any mask, two seeds with the same fold
give the same mask, and `randint(0, M - 1)` never draws M - 1. Masks here are AES-256-CTR keystreams
(`cryptography`, the library Flower's own encryption uses) keyed by SHA-256 of the whole seed, so a
mask is as hard to guess as its seed; with M a power of two, its low bits are exactly uniform.
"""

from __future__ import annotations

import hashlib

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_NONCE = bytes(16)  # every seed masks one vector of one round: keys are fresh per round (node.py)


def word_dtype(modulus: int) -> np.dtype:
    """The unsigned integer type that holds every element of Z_modulus (the wire type)."""
    if modulus <= 2**16:
        return np.dtype(np.uint16)
    if modulus <= 2**32:
        return np.dtype(np.uint32)
    return np.dtype(np.uint64)


def mask(seed: bytes, length: int, modulus: int) -> np.ndarray:
    """`length` elements uniform in Z_modulus, in `word_dtype(modulus)`, a deterministic function of
    `seed` (read-only when the modulus fills the word: use it as an operand, not in place)."""
    if modulus < 2 or modulus & (modulus - 1):
        raise ValueError(f"the ring's modulus must be a power of two, got {modulus}")
    dtype = word_dtype(modulus)
    key = hashlib.sha256(b"fedgpu-secagg-mask\x00" + seed).digest()
    stream = Cipher(algorithms.AES(key), modes.CTR(_NONCE)).encryptor().update(bytes(length * dtype.itemsize))
    words = np.frombuffer(stream, dtype=dtype)
    return words if modulus == 2 ** (8 * dtype.itemsize) else words & dtype.type(modulus - 1)

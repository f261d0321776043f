"""The update codecs of the compressed uplink (app/compression/codecs.py): each mode's error bound,
stochastic rounding's unbiasedness, topk's exact selection and its packings, error feedback's
closed form, the bytes saved, and that a hostile payload only ever raises MalformedPayload."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from app.compression import codecs
from app.compression.codecs import (
    MODES,
    MalformedPayload,
    bundle,
    decode,
    encode,
    payload_nbytes,
    topk_count,
    unbundle,
)

SETTINGS = [(mode, False) for mode in MODES] + [("topk", True)]  # (mode, quantize_values)
FP16_MAX = 65504.0


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _model_update(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small update with every kind of tensor: per-channel and per-tensor int8, uint16 / int32 / mask
    topk packings, dtypes other than float32, an empty tensor, a scalar and integer buffers."""
    g = _gen(seed)
    return {
        "conv.weight": torch.randn(32, 16, 3, 3, generator=g) * 1e-2,  # 4608: per channel
        "conv.bias": torch.randn(32, generator=g) * 1e-3,
        "fc.weight": torch.randn(10, 7000, generator=g) * 1e-2,  # 70000 > 65536: int32 indices
        "bn.running_mean": torch.randn(32, generator=g, dtype=torch.float64),
        "bn.num_batches_tracked": torch.tensor(7),
        "emb.weight": torch.randn(64, 8, generator=g).half(),  # 512 < 4096: per tensor
        "head.weight": torch.randn(3, 50, generator=g).bfloat16(),
        "mask.buffer": torch.tensor([True, False, True]),
        "counts": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(0.25),
    }


def _channel_scales(parts: dict[str, torch.Tensor], key: str, x: torch.Tensor) -> torch.Tensor:
    """The int8 step of every element of x, broadcast from its per-channel or per-tensor scale."""
    scale = parts[f"{key}/scale"]
    return scale.reshape(-1, *([1] * (x.dim() - 1))) if scale.numel() > 1 else scale.reshape(())


# ------------------------------------------------------------------------------------------------
# Round trips and their bounds


@pytest.mark.parametrize("mode, quantize_values", SETTINGS)
def test_decode_returns_likes_keys_shapes_dtypes_and_integer_buffers_exactly(mode, quantize_values):
    update = _model_update()
    parts = encode(update, mode, ratio=0.05, quantize_values=quantize_values, generator=_gen())
    for name, t in parts.items():  # every part is a dtype numpy (and so an ArrayRecord) carries
        assert t.numpy().dtype != object, name
    out = decode(parts, update, mode, ratio=0.05, quantize_values=quantize_values)
    assert list(out) == list(update)
    for key, x in update.items():
        assert out[key].dtype == x.dtype and out[key].shape == x.shape, key
        if not x.dtype.is_floating_point or mode == "none":
            assert torch.equal(out[key], x), key


@pytest.mark.parametrize(
    "mode, rel, absolute",
    [("fp16", 2.0**-11, 2.0**-25), ("bf16", 2.0**-8, 1e-38)],  # half an ulp, and the subnormal floor
)
def test_half_precision_round_trip_is_within_half_an_ulp(mode, rel, absolute):
    g = _gen(1)
    x = torch.randn(5000, generator=g) * torch.logspace(-6, 3, 5000)
    update = {"w": x, "w64": x.double().reshape(50, 100), "h": x.half().float().half()}
    out = decode(encode(update, mode), update, mode)
    for key, value in update.items():
        err = (out[key].double() - value.double()).abs()
        floor = 2.0**-25 if value.dtype == torch.float16 else absolute  # back onto fp16's subnormal grid
        assert bool((err <= rel * value.double().abs() + floor).all()), key


def test_fp16_saturates_instead_of_overflowing_and_keeps_nan():
    update = {"w": torch.tensor([1e6, -1e6, 3.0, float("inf")])}
    part = encode(update, "fp16")["w"]
    assert part.tolist() == [FP16_MAX, -FP16_MAX, 3.0, FP16_MAX]
    assert torch.isnan(encode({"w": torch.tensor([float("nan")])}, "fp16")["w"]).all()


@pytest.mark.parametrize(
    "shape, per_channel",
    [((1000,), False), ((10, 100), False), ((64, 128), True), ((32, 16, 3, 3), True), ((4096,), False), ((), False)],
)
def test_int8_error_is_at_most_one_step_per_tensor_or_per_channel(shape, per_channel):
    g = _gen(2)
    x = torch.randn(shape, generator=g)
    if per_channel:  # channels of very different magnitudes: what per-channel scales are for
        x = x * torch.logspace(-4, 1, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
    parts = encode({"w": x}, "int8", generator=g)
    assert parts["w/q"].dtype == torch.int8 and parts["w/q"].shape == x.shape
    assert parts["w/scale"].shape == ((shape[0],) if per_channel else (1,))
    assert int(parts["w/q"].min()) >= -127 and int(parts["w/q"].max()) <= 127
    step = _channel_scales(parts, "w", x)
    err = (decode(parts, {"w": x}, "int8")["w"] - x).abs()
    assert bool((err <= step * (1 + 1e-6)).all())
    if per_channel:  # the quietest channel's error is on its own scale, not the loudest one's
        assert float(err[0].max()) <= float(x[0].abs().max()) / 127 * (1 + 1e-6)


@pytest.mark.parametrize(
    "x",
    [
        torch.full((100,), 0.37),
        torch.full((100,), -5.0),
        torch.zeros(64, 64),
        torch.full((7,), 1e-40),  # subnormal
        torch.tensor([3.0, -3.0, 3.0]),  # exactly +-max|x|
        torch.cat([torch.zeros(1, 4096), torch.randn(1, 4096)]),  # an all-zero channel
    ],
    ids=["positive-constant", "negative-constant", "zeros", "subnormal", "at-max", "zero-channel"],
)
def test_int8_constant_zero_and_extreme_tensors(x):
    parts = encode({"w": x}, "int8", generator=_gen(3))
    assert bool(torch.isfinite(parts["w/scale"]).all()) and bool((parts["w/scale"] > 0).all())
    assert int(parts["w/q"].min()) >= -127 and int(parts["w/q"].max()) <= 127
    out = decode(parts, {"w": x}, "int8")["w"]
    assert bool(((out - x).abs() <= _channel_scales(parts, "w", x) * (1 + 1e-6)).all())
    assert bool((out[x == 0] == 0).all())  # symmetric: zeros stay zero


def test_int8_never_reaches_128_through_float_rounding():
    # Values whose x / scale lands a hair under 127, with many draws: floor(y + u) must stay <= 127.
    x = torch.tensor([1.0, -1.0] + [1 - 2.0**-24] * 2000 + [-(1 - 2.0**-24)] * 2000)
    for seed in range(20):
        q = encode({"w": x}, "int8", generator=_gen(seed))["w/q"]
        assert int(q.min()) >= -127 and int(q.max()) <= 127


# ------------------------------------------------------------------------------------------------
# Stochastic rounding


def _assert_unbiased(mean: torch.Tensor, x: torch.Tensor, step: torch.Tensor, draws: int) -> None:
    """|mean - x| within 6 standard errors: a code is floor(y) + Bernoulli(f), f = frac(x / step), so
    the decoded value's standard deviation is step * sqrt(f (1 - f)); plus float32 rounding (the
    decoded q * step carries a relative error of 2^-24, under 1e-5 of a step for |q| <= 127)."""
    y = (x / step).double()
    f = y - y.floor()
    se = step.double() * torch.sqrt(f * (1 - f) / draws)
    tolerance = 6 * se + 1e-5 * step.double()
    assert bool(((mean.double() - x.double()).abs() <= tolerance).all())


def test_stochastic_rounding_is_unbiased_per_tensor():
    draws, g = 2000, _gen(4)
    x = torch.randn(500, generator=g)
    tiled = x.repeat(draws)  # one 1-D tensor: one per-tensor scale, max|x|, for every draw
    parts = encode({"w": tiled}, "int8", generator=g)
    mean = decode(parts, {"w": tiled}, "int8")["w"].reshape(draws, -1).double().mean(0)
    _assert_unbiased(mean, x, parts["w/scale"], draws)


def test_stochastic_rounding_is_unbiased_per_channel():
    draws, g = 2000, _gen(5)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-3, 0, 16).unsqueeze(1)
    tiled = x.repeat(1, draws)  # each channel's max|x| (its scale) is that of x's channel
    parts = encode({"w": tiled}, "int8", generator=g)
    assert parts["w/scale"].shape == (16,)
    mean = decode(parts, {"w": tiled}, "int8")["w"].reshape(16, draws, 256).double().mean(1)
    _assert_unbiased(mean, x, parts["w/scale"].unsqueeze(1), draws)


def test_stochastic_rounding_is_random_and_reproducible():
    x = torch.randn(1000, generator=_gen(6))
    first = encode({"w": x}, "int8", generator=_gen(7))
    assert torch.equal(first["w/q"], encode({"w": x}, "int8", generator=_gen(7))["w/q"])  # same seed
    assert not torch.equal(first["w/q"], encode({"w": x}, "int8", generator=_gen(8))["w/q"])
    nearest = torch.round(x / first["w/scale"]).to(torch.int8)
    differ = first["w/q"] != nearest
    assert 0.1 < float(differ.float().mean()) < 0.9  # rounds away from the nearest code about 1/4 of the time
    assert bool(((first["w/q"].int() - nearest.int()).abs() <= 1).all())


# ------------------------------------------------------------------------------------------------
# topk


def _reference_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Dense tensor with only the k largest |x| entries of x, by a full sort."""
    order = torch.argsort(x.reshape(-1).abs(), descending=True)[:k]
    dense = torch.zeros_like(x).reshape(-1)
    dense[order] = x.reshape(-1)[order]
    return dense.reshape(x.shape)


@pytest.mark.parametrize(
    "shape, ratio, packing",
    [
        ((1000,), 0.01, "uint16"),
        ((256, 256), 0.01, "uint16"),  # numel 65536: the last size uint16 indices address
        ((65537,), 0.01, "int32"),
        ((300, 1000), 0.01, "int32"),  # above TOPK_SAMPLE_MIN_NUMEL: the sampled threshold path
        ((64, 64), 0.25, "mask"),  # 512-byte mask < 2048 bytes of uint16 indices
        ((100_000,), 0.1, "mask"),
        ((300, 1000), 0.2, "mask"),  # 37500-byte mask < 240000 bytes of int32 indices
        ((1,), 0.01, "mask"),  # k = 1: one byte of mask < two of index
    ],
)
def test_topk_keeps_exactly_the_largest_magnitudes(shape, ratio, packing):
    x = torch.randn(shape, generator=_gen(9))
    k = topk_count(x.numel(), ratio)
    assert k == max(1, round(ratio * x.numel()))
    parts = encode({"w": x}, "topk", ratio=ratio)
    assert parts["w/val"].shape == (k,) and parts["w/val"].dtype == torch.float32
    if packing == "mask":
        assert set(parts) == {"w/val", "w/mask"} and parts["w/mask"].shape == ((x.numel() + 7) // 8,)
    else:
        assert set(parts) == {"w/val", "w/idx"} and parts["w/idx"].dtype == getattr(torch, packing)
        idx = parts["w/idx"].to(torch.int64)
        assert bool((idx[1:] > idx[:-1]).all())
    out = decode(parts, {"w": x}, "topk", ratio=ratio)["w"]
    assert torch.equal(out, _reference_topk(x, k))
    assert int((out != 0).sum()) == k


def test_topk_mask_is_numpys_little_endian_packbits():
    x = torch.randn(1001, generator=_gen(10))
    parts = encode({"w": x}, "topk", ratio=0.3)
    kept = (_reference_topk(x, topk_count(1001, 0.3)) != 0).numpy()
    assert np.array_equal(parts["w/mask"].numpy(), np.packbits(kept, bitorder="little"))


def test_topk_selection_is_exact_when_the_sample_misleads_and_counts_nan_as_largest():
    # Every sampled position (multiples of the stride) holds a large value and there are fewer of
    # them than k: the sampled threshold admits too few candidates, so the fallback must run.
    n = 1 << 20
    stride = n // codecs._TOPK_SAMPLE_SIZE
    x = 1 + torch.rand(n, generator=_gen(11))
    x[::stride] += 10
    k = topk_count(n, 0.1)
    assert n // stride < k
    expected = torch.argsort(x.abs(), descending=True)[:k].sort().values
    assert torch.equal(codecs._topk_positions(x, k), expected)
    for sample_min in (0, n + 1):  # the sampled path and plain torch.topk agree
        y = torch.randn(300_000, generator=_gen(12))
        assert torch.equal(
            codecs._topk_positions(y, 3000, sample_min), torch.argsort(y.abs(), descending=True)[:3000].sort().values
        )
        y[[5, 77_777]] = float("nan")
        assert {5, 77_777} <= set(codecs._topk_positions(y, 3000, sample_min).tolist())


def test_topk_with_int8_values_is_within_one_step():
    x = torch.randn(300, 1000, generator=_gen(13))
    parts = encode({"w": x}, "topk", ratio=0.01, quantize_values=True, generator=_gen(14))
    assert parts["w/val"].dtype == torch.int8 and parts["w/scale"].shape == (1,)
    out = decode(parts, {"w": x}, "topk", ratio=0.01, quantize_values=True)["w"]
    reference = _reference_topk(x, 3000)
    assert torch.equal(out != 0, reference != 0)
    assert bool(((out - reference).abs() <= float(parts["w/scale"]) * (1 + 1e-6)).all())


# ------------------------------------------------------------------------------------------------
# Error feedback


@pytest.mark.parametrize("mode", ["topk", "int8"])
def test_error_feedback_sends_the_sum_of_the_updates_less_the_last_residual(mode):
    g = _gen(15)
    shapes = {"conv.weight": (32, 16, 3, 3), "fc.weight": (10, 500), "fc.bias": (10,)}
    total_true = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}
    total_sent = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}
    residual, rounds, energy = None, 20, 0.0
    for _ in range(rounds):
        update = {k: torch.randn(s, generator=g) for k, s in shapes.items()} | {"steps": torch.tensor(3)}
        compensated = {k: update[k] + (residual[k] if residual else 0) for k in shapes}
        parts, residual = codecs.with_error_feedback(update, residual, mode, ratio=0.01, generator=g)
        sent = decode(parts, update, mode, ratio=0.01)
        energy += sum(float(update[k].square().sum()) for k in shapes)
        assert int(sent["steps"]) == 3 and set(residual) == set(shapes)  # integer buffers: exact, no residual
        for key in shapes:
            total_true[key] += update[key]
            total_sent[key] += sent[key]
            r, c = residual[key].double(), compensated[key].double()
            if mode == "topk":  # what was dropped is the n - k smallest of the compensated update
                assert (
                    float(r.square().sum())
                    <= (1 - topk_count(c.numel(), 0.01) / c.numel()) * float(c.square().sum()) + 1e-9
                )
            else:  # int8: what was rounded away is under one step
                assert float(r.abs().max()) <= float(c.abs().max()) / 127 * (1 + 1e-5)
    for key in shapes:
        assert torch.allclose(total_sent[key] + residual[key].double(), total_true[key], atol=1e-4)
    # Bounded: it grows no faster than a random walk of the updates (each round drops at most the
    # n - k smallest entries of what it holds), far from the sum of the updates' norms.
    assert math.sqrt(sum(float(r.square().sum()) for r in residual.values())) <= math.sqrt(energy)


def test_error_feedback_takes_a_residual_from_another_device_or_dtype_and_refuses_another_shape():
    update = {"w": torch.randn(100, generator=_gen(16))}
    parts, residual = codecs.with_error_feedback(update, {"w": torch.ones(100, dtype=torch.float64)}, "fp16")
    assert residual["w"].dtype == torch.float32
    with pytest.raises(ValueError, match="residual 'w'"):
        codecs.with_error_feedback(update, {"w": torch.ones(99)}, "fp16")
    nan = {"w": torch.tensor([1.0, float("nan")])}
    with pytest.raises(ValueError, match="cannot be sent") as caught:  # not a NaN residual kept for later
        codecs.with_error_feedback(nan, None, "int8")
    assert not isinstance(caught.value, MalformedPayload)


# ------------------------------------------------------------------------------------------------
# Bytes on the wire


def _realistic_update() -> dict[str, torch.Tensor]:
    """The weights of a small ResNet-like network: conv kernels, BatchNorm and a linear head (2.3M)."""
    g = _gen(17)
    layers = {"conv1": (64, 3, 7, 7), "layer1": (64, 64, 3, 3), "layer2": (128, 64, 3, 3)}
    layers |= {"layer2b": (128, 128, 3, 3), "layer3": (256, 128, 3, 3), "layer3b": (256, 256, 3, 3)}
    layers |= {"layer4": (512, 256, 3, 3), "fc": (100, 512)}
    update: dict[str, torch.Tensor] = {}
    for name, shape in layers.items():
        update[f"{name}.weight"] = torch.randn(shape, generator=g) * 1e-3
        for stat in ("bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"):
            update[f"{name}.{stat}"] = torch.randn(shape[0], generator=g) * 1e-3
        update[f"{name}.bn.num_batches_tracked"] = torch.tensor(10)
    return update


def _record_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes as Flower ships them: each part's serialized array in an ArrayRecord (header included)."""
    return sum(len(array.data) for array in ArrayRecord(tensors).values())


@pytest.mark.parametrize("mode, factor", [("int8", 3.9), ("topk", 30.0)])
def test_compressed_parts_are_several_times_smaller(mode, factor):
    update = _realistic_update()
    parts = encode(update, mode, ratio=0.01, generator=_gen(18))
    plain = _record_bytes(update)
    assert plain / _record_bytes(parts) >= factor
    assert payload_nbytes(update) / payload_nbytes(parts) >= factor


@pytest.mark.parametrize("mode, quantize_values", SETTINGS)
def test_parts_survive_an_array_record(mode, quantize_values):
    update = _model_update()
    parts = encode(update, mode, ratio=0.05, quantize_values=quantize_values, generator=_gen(19))
    shipped = ArrayRecord(parts).to_torch_state_dict()
    direct = decode(parts, update, mode, ratio=0.05, quantize_values=quantize_values)
    received = decode(shipped, update, mode, ratio=0.05, quantize_values=quantize_values)
    for key in update:
        assert torch.equal(direct[key], received[key]), key


@pytest.mark.parametrize("mode, quantize_values", SETTINGS)
def test_one_bundled_array_carries_the_parts_whatever_the_dict_order(mode, quantize_values):
    update, kw = _model_update(), {"ratio": 0.05, "quantize_values": quantize_values}
    parts = encode(update, mode, generator=_gen(20), **kw)
    payload = bundle(parts, update, mode, **kw)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_nbytes(parts)
    shuffled = dict(reversed(list(update.items())))  # the server's dict may list keys in another order
    assert torch.equal(bundle(dict(reversed(list(parts.items()))), shuffled, mode, **kw), payload)
    shipped = torch.from_numpy(ArrayRecord({"p": payload}).to_torch_state_dict()["p"].numpy())
    back = unbundle(shipped, shuffled, mode, **kw)
    assert back.keys() == parts.keys()
    for name, t in parts.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    for bad in (payload[:-1], torch.cat([payload, payload[:1]]), payload.view(1, -1), payload.to(torch.int16)):
        with pytest.raises(MalformedPayload, match="payload"):
            unbundle(bad, update, mode, **kw)


# ------------------------------------------------------------------------------------------------
# Hostile payloads


def _sub(parts: dict[str, torch.Tensor], name: str, value) -> dict[str, torch.Tensor]:
    return {**parts, name: value}


def _set(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t.reshape(-1)[index] = value
    return t


X = torch.randn(20, 300, generator=_gen(20))  # 6000 elements: per-channel int8, uint16 topk indices
BIG = torch.randn(70_000, generator=_gen(21))  # int32 topk indices


def _topk(x, ratio=0.01, quantize_values=False):
    return encode({"w": x}, "topk", ratio=ratio, quantize_values=quantize_values, generator=_gen(22))


MALFORMED = {
    # name: (like, mode, ratio, quantize_values, parts, words in the message)
    "missing part": (X, "int8", 0.01, False, {"w/q": encode({"w": X}, "int8")["w/q"]}, "missing part 'w/scale'"),
    "extra part": (
        X,
        "fp16",
        0.01,
        False,
        {**encode({"w": X}, "fp16"), "w/backdoor": torch.zeros(1)},
        "unexpected part 'w/backdoor'",
    ),
    "wrong size": (
        X,
        "int8",
        0.01,
        False,
        _sub(encode({"w": X}, "int8"), "w/q", torch.zeros(20, 299, dtype=torch.int8)),
        "w/q: expected int8 of shape (20, 300)",
    ),
    "wrong scale size": (X, "int8", 0.01, False, _sub(encode({"w": X}, "int8"), "w/scale", torch.ones(1)), "w/scale"),
    "wrong dtype": (
        X,
        "topk",
        0.01,
        False,
        _sub(_topk(X), "w/val", _topk(X)["w/val"].double()),
        "w/val: expected float32",
    ),
    "wrong index dtype": (
        X,
        "topk",
        0.01,
        False,
        _sub(_topk(X), "w/idx", _topk(X)["w/idx"].int()),
        "w/idx: expected uint16",
    ),
    "not a tensor": (X, "fp16", 0.01, False, {"w": X.half().numpy()}, "expected a dense tensor"),
    "index out of range": (
        BIG,
        "topk",
        0.01,
        False,
        _sub(_topk(BIG), "w/idx", _set(_topk(BIG)["w/idx"], -1, 70_000)),
        "out of range",
    ),
    "negative index": (
        BIG,
        "topk",
        0.01,
        False,
        _sub(_topk(BIG), "w/idx", _set(_topk(BIG)["w/idx"], 0, -1)),
        "out of range",
    ),
    "repeated index": (
        X,
        "topk",
        0.01,
        False,
        _sub(_topk(X), "w/idx", _set(_topk(X)["w/idx"], 1, int(_topk(X)["w/idx"][0]))),
        "strictly increasing",
    ),
    "unsorted indices": (
        X,
        "topk",
        0.01,
        False,
        _sub(_topk(X), "w/idx", _topk(X)["w/idx"].flip(0)),
        "strictly increasing",
    ),
    "bitmap count": (
        X,
        "topk",
        0.25,
        False,
        _sub(_topk(X, 0.25), "w/mask", torch.full((750,), 255, dtype=torch.uint8)),
        "6000 bits set, expected 1500",
    ),
    "bitmap padding": (
        torch.randn(1001),
        "topk",
        0.3,
        False,
        _sub(_topk(torch.randn(1001), 0.3), "w/mask", _set(_topk(torch.randn(1001), 0.3)["w/mask"], -1, 255)),
        "past the tensor",
    ),
    "nan scale": (
        X,
        "int8",
        0.01,
        False,
        _sub(encode({"w": X}, "int8"), "w/scale", _set(encode({"w": X}, "int8")["w/scale"], 3, float("nan"))),
        "w/scale",
    ),
    "negative scale": (
        X,
        "int8",
        0.01,
        False,
        _sub(encode({"w": X}, "int8"), "w/scale", _set(encode({"w": X}, "int8")["w/scale"], 0, -0.5)),
        "> 0",
    ),
    "zero scale": (X, "topk", 0.01, True, _sub(_topk(X, quantize_values=True), "w/scale", torch.zeros(1)), "> 0"),
    "overflowing scale": (
        X,
        "int8",
        0.01,
        False,
        _sub(encode({"w": X}, "int8"), "w/scale", torch.full((20,), 1e37)),
        "<=",
    ),
    "inf value": (
        X,
        "topk",
        0.01,
        False,
        _sub(_topk(X), "w/val", _set(_topk(X)["w/val"], 2, float("inf"))),
        "non-finite",
    ),
    "nan value": (X, "none", 0.01, False, {"w": _set(X, 5, float("nan"))}, "non-finite"),
    "inf half": (X, "fp16", 0.01, False, {"w": _set(X.half(), 0, float("-inf"))}, "non-finite"),
    "nan bf16 bits": (
        X,
        "bf16",
        0.01,
        False,
        {"w": _set(X.bfloat16(), 9, float("nan")).view(torch.int16)},
        "non-finite",
    ),
    "beyond like's dtype": (
        X.half(),
        "bf16",
        0.01,
        False,
        {"w": _set(X.bfloat16(), 0, 1e6).view(torch.int16)},
        "out-of-range",
    ),
    "not a mapping": (X, "fp16", 0.01, False, [X.half()], "mapping"),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_each_malformed_payload_raises_malformed_payload_naming_the_problem(kind):
    like, mode, ratio, quantize_values, parts, words = MALFORMED[kind]
    with pytest.raises(MalformedPayload) as caught:
        decode(parts, {"w": like}, mode, ratio=ratio, quantize_values=quantize_values)
    assert words in str(caught.value)
    if "part" not in words and kind != "not a mapping":
        assert str(caught.value).startswith("w")  # names the tensor


NUMPY_DTYPES = [
    torch.float32,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.int64,
    torch.bool,
]


def _garbage(rng: np.random.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bytes as a tensor of `dtype` and `shape` (bools as 0 / 1: other bytes are not bools)."""
    n = math.prod(shape)
    raw = torch.from_numpy(rng.integers(0, 256, size=max(1, n) * dtype.itemsize, dtype=np.uint8))
    t = (raw != 0) if dtype == torch.bool else raw.view(dtype)
    return t[:n].reshape(shape)


@pytest.mark.parametrize("mode, quantize_values", SETTINGS)
def test_random_garbage_only_ever_raises_malformed_payload(mode, quantize_values):
    like = _model_update() | {"big": torch.randn(300), "tiny": torch.randn(8, 1)}
    honest = encode(like, mode, ratio=0.05, quantize_values=quantize_values, generator=_gen(23))
    rng = np.random.default_rng(24)
    outcomes = {"decoded": 0, "refused": 0}
    for trial in range(150):
        parts = {}
        for name, t in honest.items():
            roll = rng.random()
            if roll < 0.6:  # the right dtype and shape, random bits: only the content checks can refuse
                parts[name] = _garbage(rng, t.dtype, tuple(t.shape))
            elif roll < 0.8:  # a random dtype and shape
                shape = tuple(int(s) for s in rng.integers(0, 5, size=rng.integers(0, 3)))
                parts[name] = _garbage(rng, NUMPY_DTYPES[rng.integers(len(NUMPY_DTYPES))], shape)
            elif roll < 0.95:
                parts[name] = t
            # else: left out
        if trial % 10 == 0:
            parts[f"junk{trial}"] = torch.zeros(1)
        try:
            out = decode(parts, like, mode, ratio=0.05, quantize_values=quantize_values)
        except MalformedPayload:
            outcomes["refused"] += 1
        else:
            outcomes["decoded"] += 1
            for key, x in out.items():  # what is accepted is well-formed
                assert x.shape == like[key].shape and x.dtype == like[key].dtype
                if x.dtype.is_floating_point:
                    assert bool(torch.isfinite(x).all()), key
    assert outcomes["refused"] > 0


# ------------------------------------------------------------------------------------------------
# Settings and inputs


@pytest.mark.parametrize(
    "mode, ratio", [("zip", 0.01), ("topk", 0.0), ("topk", 1.5), ("topk", float("nan")), ("topk", -0.1)]
)
def test_bad_settings_are_refused_on_both_sides(mode, ratio):
    with pytest.raises(ValueError) as caught:
        encode({"w": X}, mode, ratio=ratio)
    assert not isinstance(caught.value, MalformedPayload)  # our own setting, not the node's payload
    with pytest.raises(ValueError):
        decode({}, {"w": X}, mode, ratio=ratio)


def test_part_names_that_would_collide_are_refused():
    with pytest.raises(ValueError, match="collides"):
        encode({"w": X, "w/q": torch.tensor(1)}, "int8")


@pytest.mark.parametrize("mode, quantize_values", SETTINGS)
def test_encode_leaves_the_update_untouched(mode, quantize_values):
    update = _model_update() | {"h16": torch.tensor([1e4, -2.0]).half()}
    before = {k: v.clone() for k, v in update.items()}
    encode(update, mode, ratio=0.05, quantize_values=quantize_values, generator=_gen(25))
    for key in update:
        assert torch.equal(update[key], before[key]), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("mode, quantize_values", SETTINGS)
def test_a_gpu_update_is_encoded_on_the_gpu_and_decoded_onto_likes_device(mode, quantize_values):
    update = {k: v.cuda() for k, v in _model_update().items()}
    parts = encode(
        update, mode, ratio=0.05, quantize_values=quantize_values, generator=torch.Generator("cuda").manual_seed(0)
    )
    assert all(t.is_cuda for t in parts.values())
    cpu_parts = {k: v.cpu() for k, v in parts.items()}  # as they arrive from an ArrayRecord
    out = decode(cpu_parts, update, mode, ratio=0.05, quantize_values=quantize_values)
    assert all(t.is_cuda for t in out.values())
    back = decode(cpu_parts, {k: v.cpu() for k, v in update.items()}, mode, ratio=0.05, quantize_values=quantize_values)
    for key in update:
        assert torch.equal(out[key].cpu(), back[key]), key

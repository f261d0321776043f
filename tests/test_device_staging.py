"""Staging replies on the aggregation device: each distinct dict is uploaded once per
aggregation, in one transfer, and nothing is copied when it is on the device already.

No GPU is needed: `meta` stands in for a device (CPU -> meta copies run, meta maths
produces shapes only), and a "simulated device" (uploads on the CPU, marked resident)
runs the full rules with real values to count uploads and compare results.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import MetricRecord

from strategies import tensor_ops
from strategies.coordinatewise import MedianRule, TrimmedMeanRule
from strategies.fedavg import FedAvg
from strategies.krum import KrumRule, MultiKrumRule
from strategies.replies import Screened, ValidReply
from strategies.robust_ops import coordinatewise, stage_groups, update_gram, weighted_update_mean
from strategies.tensor_ops import TensorDict, stage, upload, weighted_mean

CPU = torch.device("cpu")
META = torch.device("meta")
N = 20


def _model(rng: np.random.Generator, base: TensorDict | None = None, scale: float = 0.01) -> TensorDict:
    if base is None:
        return {
            "conv.weight": torch.from_numpy(rng.normal(size=(8, 3, 3, 3)).astype(np.float32)),
            "conv.bias": torch.from_numpy(rng.normal(size=(8,)).astype(np.float32)),
            "fc.weight": torch.from_numpy(rng.normal(size=(40, 64)).astype(np.float32)),  # several blocks
            "bn.num_batches_tracked": torch.tensor(7, dtype=torch.int64),
        }
    return {
        k: t + scale * torch.from_numpy(rng.normal(size=t.shape).astype(np.float32)) if t.is_floating_point() else t + 3
        for k, t in base.items()
    }


def _round(rng: np.random.Generator, n: int = N) -> tuple[TensorDict, list[TensorDict]]:
    """A global model and n replies trained from it; the last two are outliers."""
    glob = _model(rng)
    return glob, [_model(rng, glob, 1.0 if i >= n - 2 else 0.01 * (1 + i / n)) for i in range(n)]


def _screened(models: list[TensorDict]) -> Screened:
    return Screened(
        valid=[
            ValidReply(node_id=i + 1, weight=10.0 + i, metrics=MetricRecord(), arrays=m) for i, m in enumerate(models)
        ]
    )


@pytest.fixture
def moves(monkeypatch) -> list[tuple[torch.device, torch.device]]:
    """Every `Tensor.to` call whose result is on another device than its input."""
    seen: list[tuple[torch.device, torch.device]] = []
    real = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if out.device != self.device:
            seen.append((self.device, out.device))
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    return seen


@pytest.fixture
def uploads(monkeypatch) -> list[int]:
    """The sizes (in keys) of the dicts `stage` uploads."""
    seen: list[int] = []
    real = tensor_ops.upload

    def counting(tensors, device):
        seen.append(len(tensors))
        return real(tensors, device)

    monkeypatch.setattr(tensor_ops, "upload", counting)
    return seen


@pytest.fixture
def simulated_device(monkeypatch, uploads) -> list[int]:
    """The CPU as if it were another device: only what `stage` uploaded counts as resident,
    so the rules run with real values while their uploads are counted."""
    real = tensor_ops.upload  # the counting wrapper

    def marking(tensors, device):
        out, host = real(tensors, device)
        for t in out.values():
            t._staged = True
        return out, host

    monkeypatch.setattr(tensor_ops, "upload", marking)
    monkeypatch.setattr(tensor_ops, "_resident", lambda t, device: getattr(t, "_staged", False))
    return uploads


def test_on_its_own_device_nothing_is_copied(rng, uploads, moves):
    glob, models = _round(rng)
    staged = stage([*models, *[glob] * N], CPU)
    assert all(s is d for s, d in zip(staged, [*models, *[glob] * N], strict=True))
    assert uploads == [] and moves == []


def test_a_shared_base_is_uploaded_once_and_maps_to_one_device_dict(rng, uploads, moves):
    glob, models = _round(rng)
    (current,), staged_models, bases = stage_groups(META, [glob], models, [glob] * N)
    assert len(uploads) == N + 1 and len(moves) == N + 1  # one transfer per dict, not per tensor
    assert all(b is current for b in bases)
    for staged, model in zip(staged_models, models, strict=True):
        assert staged.keys() == model.keys()
        assert all(
            s.device == META and s.shape == t.shape and s.dtype == t.dtype
            for s, t in zip(staged.values(), model.values(), strict=True)
        )


@pytest.mark.parametrize(
    "op",
    [
        lambda models, bases: update_gram(models, bases, META, block_bytes=64),
        lambda models, bases: coordinatewise(models, bases, None, META, block_bytes=64),
        lambda models, bases: coordinatewise(models, bases, 2, META, block_bytes=64),
        lambda models, bases: weighted_update_mean(models, bases, [1.0] * len(models), META),
    ],
    ids=["gram", "median", "trimmed-mean", "weighted-update-mean"],
)
def test_every_rule_moves_each_reply_and_the_base_once_not_block_by_block(rng, moves, op):
    glob, models = _round(rng)
    op(models, [glob] * N)
    assert len(moves) == N + 1, f"{len(moves)} host-to-device copies for {N} replies and one base"


def test_asynchronous_updates_upload_each_distinct_base_once(rng, moves):
    versions = [_model(rng) for _ in range(3)]
    bases = [versions[i % 3] for i in range(N)]
    weighted_update_mean([_model(rng, b) for b in bases], bases, [1.0] * N, META)
    assert len(moves) == N + 3


def test_weighted_mean_moves_each_reply_once_not_tensor_by_tensor(rng, moves):
    _, models = _round(rng)
    out = weighted_mean(models, [1.0] * N, META)
    assert len(moves) == N and all(t.device == META for t in out.values())


@pytest.mark.parametrize(
    "rule",
    [
        KrumRule(num_byzantine=2),
        MultiKrumRule(num_byzantine=2, num_selected=4),
        MedianRule(num_byzantine=2),
        TrimmedMeanRule(num_byzantine=2, trim_ratio=0.1),
    ],
    ids=lambda r: r.name,
)
def test_a_rule_uploads_each_reply_and_the_global_model_once_and_gets_the_cpu_result(rng, rule, request):
    glob, models = _round(rng)
    want, want_report = rule.aggregate(1, glob, _screened(models), [glob] * N)
    uploads = request.getfixturevalue("simulated_device")
    got, report = rule.aggregate(1, glob, _screened(models), [glob] * N)
    assert len(uploads) == N + 1
    assert report.excluded == want_report.excluded
    for key, t in want.items():
        assert got[key].dtype == t.dtype
        torch.testing.assert_close(got[key], t, rtol=0, atol=1e-6)


def test_krum_falling_back_to_the_median_after_a_nan_reply_uploads_nothing_twice(rng, simulated_device):
    glob, models = _round(rng, 5)
    models[0]["fc.weight"][0, 0] = float("nan")
    screened = _screened(models)
    new, report = KrumRule(num_byzantine=1, on_too_few="fallback").aggregate(1, glob, screened, [glob] * 5)
    assert report.policy == "fallback-median" and [r.node_id for r in screened.rejected] == [1]
    assert len(simulated_device) == 6
    torch.testing.assert_close(
        new["fc.weight"], (glob["fc.weight"] + coordinatewise(models[1:], [glob] * 4, None, CPU)["fc.weight"])
    )


def test_fedavg_uploads_each_reply_once_even_when_it_recomputes_after_a_nan(rng, simulated_device):
    glob, models = _round(rng, 6)
    models[2]["conv.bias"][1] = float("inf")
    screened = _screened(models)
    out = FedAvg().aggregate_models(1, screened)
    assert len(simulated_device) == 6 and [r.node_id for r in screened.rejected] == [3]
    kept = [m for i, m in enumerate(models) if i != 2]
    torch.testing.assert_close(
        out["fc.weight"], weighted_mean(kept, [10.0 + i for i in (0, 1, 3, 4, 5)], CPU)["fc.weight"]
    )


def test_upload_packs_every_dtype_and_shape_faithfully():
    tensors = {
        "f32": torch.randn(3, 5),
        "f16": torch.randn(7, dtype=torch.float16),
        "i64": torch.tensor(11, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "bool": torch.tensor([True, False, True]),
        "transposed": torch.randn(4, 6).T,
    }
    out, host = upload(tensors, CPU)
    for key, t in tensors.items():
        assert out[key].dtype == t.dtype and out[key].shape == t.shape and torch.equal(out[key], t)
        assert (out[key].data_ptr() - host.data_ptr()) % tensor_ops.STAGE_ALIGN == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_matches_the_host_values(rng):
    glob, models = _round(rng)
    staged = stage([*models, glob, glob], "cuda")
    assert staged[-1] is staged[-2]
    for s, d in zip(staged, [*models, glob, glob], strict=True):
        for key, t in d.items():
            assert s[key].is_cuda and torch.equal(s[key].cpu(), t)
    want = weighted_mean(models, [1.0] * N, CPU)
    got = weighted_mean(models, [1.0] * N, torch.device("cuda"))
    for key, t in want.items():
        torch.testing.assert_close(got[key].cpu(), t, rtol=0, atol=1e-6)


def test_a_device_named_with_an_index_still_finds_cpu_tensors_resident(rng, uploads):
    glob, models = _round(rng, 3)
    staged = stage([glob, *models], "cpu:0")
    assert all(s is d for s, d in zip(staged, [glob, *models], strict=True)) and uploads == []

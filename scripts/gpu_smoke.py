"""GPU smoke check: one command that proves the app's CUDA fixes on a real GPU.

What it proves
    One check per CUDA fix, each through the app's own functions (the path the ClientApp
    and the ServerApp run), each in its own try/except so one failure does not stop the rest:

    telemetry                 GpuTelemetry around training reports `gpu-telemetry`=1 and device-wide
                              keys; NVML finds the torch device by UUID, also in a process started
                              with CUDA_VISIBLE_DEVICES=<that UUID>
    fedbuff_momentum_resume   FedBuff with server momentum on CUDA: flush, checkpoint, load into a fresh
                              strategy, flush again; velocity on CUDA, same model as an uninterrupted run
    device_index_refused      cuda:<device_count> is a ConfigError naming CUDA_VISIBLE_DEVICES
    amp_modes                 the CNN on digits with amp off / fp16 (+ grad clip, GradScaler state carried
                              between calls) / bf16: finite, falling loss
    timer_excludes_autotuning ResNet-18, cudnn_benchmark, partial last batch: the first timed call of a
                              fresh process is within 20% of the second
    channels_last             the layout `use_channels_last(.., "auto", ..)` picks is at most 10% slower
                              than the other, for the CNN (GroupNorm) and ResNet-18 (BatchNorm)
    aggregation_cuda_vs_cpu   FedAvg / Krum / coordinate median / Bulyan on ResNet-18-shaped replies agree on CUDA
                              and CPU (with time and CUDA peak memory per method)
    threads_share_gpu         two threads training at once report no peak memory; a lone run does
    deterministic             train.deterministic=true: ResNet-18 and the CNN bit-identical twice
    bf16_choice               amp=auto is bf16 exactly from compute capability 8.0
    rng_resume_fewer_gpus     restoring more CUDA RNG states than visible GPUs does not raise
    local_dp                  DP-SGD (bf16 CNN, ResNet-18): finite epsilon, per-example gradients within clip
    client_loop_vs_plain      samples/s of the app's train() >= 0.9 x a plain PyTorch loop (ResNet-18)
    hidden_gpu_notice         CUDA_VISIBLE_DEVICES="" on a GPU machine gives a non-empty notice

    On a CPU-only machine the checks that need a GPU are recorded as skipped, with why.

How to run (from anywhere; at most 5 minutes on one data-centre GPU)
    python scripts/gpu_smoke.py --out DIR [--device cuda:0] [--quick] [--only name,name]

    --quick shrinks data, epochs and repetitions for a CPU run (tests/test_gpu_smoke.py runs
    `--quick --device cpu`); the GPU run is meant without it, since small runs make the
    timing checks noisy.

Where the figures go
    DIR/smoke.json: {"machine", "device", "checks": {name: {"verdict", "why", ...figures}},
    "passed", "failed", "skipped"}; a short table on stdout; exit status 1 when a check
    failed. The GPU figures belong in docs/benchmarks.md (section "GPU smoke check").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `import app` when run as a plain file

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import Array, ArrayRecord, RecordDict  # noqa: E402
from torch import nn  # noqa: E402

from app.config.schema import ConfigError, DatasetConfig, ModelConfig, PrivacyConfig, TrainConfig  # noqa: E402
from app.run.checkpoint import Checkpoint, capture_rng, load_checkpoint, restore_rng, save_checkpoint  # noqa: E402
from app.simulation.local_grid import act_as_server  # noqa: E402
from app.simulation.messages import make_reply  # noqa: E402
from app.task.data import DataSpec, Examples, data_spec, load_splits, materialize  # noqa: E402
from app.task.models import build_model  # noqa: E402
from app.task.telemetry import GpuTelemetry, nvml_uuid  # noqa: E402
from app.task.training import (  # noqa: E402
    Precision,
    model_inputs,
    prepare_model,
    resolve_device,
    resolve_precision,
    train,
    use_channels_last,
    with_layout,
)
from strategies.bulyan import BulyanRule  # noqa: E402
from strategies.coordinatewise import MedianRule  # noqa: E402
from strategies.fedavg import FedAvg, RoundReport  # noqa: E402
from strategies.fedbuff import FedBuff, InFlight  # noqa: E402
from strategies.krum import KrumRule  # noqa: E402
from strategies.replies import specs_of  # noqa: E402
from strategies.robust import RobustStrategy  # noqa: E402
from strategies.staleness import staleness_fn  # noqa: E402
from strategies.tensor_ops import TensorDict, record_to_tensors  # noqa: E402

RESNET_SPEC = DataSpec((3, 32, 32), 10)
CPU = torch.device("cpu")


# --------------------------------------------------------------------------- framework


class Skip(Exception):  # noqa: N818 - a verdict, not an error
    """The check cannot run on this machine; the message says why."""


class CheckFailed(AssertionError):
    """A check's assertion did not hold; the message says what was seen."""


def expect(condition: bool, message: str) -> None:
    """`assert` that survives `python -O`."""
    if not condition:
        raise CheckFailed(message)


def expect_none(problems: list[str]) -> None:
    """Fail with every problem found (checks collect them so all figures are recorded first)."""
    expect(not problems, "; ".join(problems))


@dataclass(frozen=True)
class Sizes:
    """Workload sizes; FULL for the GPU run, QUICK (`--quick`) for a CPU."""

    cnn_n: int | None  # digits training examples (None: all 1437)
    amp_epochs: int  # amp_modes: train() calls of one epoch each
    resnet_n: int  # random 3x32x32 images; n % resnet_batch >= 2 leaves a partial last batch
    resnet_batch: int
    resnet_epochs: int
    reps: int  # timed repetitions per variant (interleaved)
    det_resnet_n: int  # deterministic: ResNet-18 examples
    det_resnet_batch: int
    dp_cnn_n: int | None
    dp_epochs: int
    dp_resnet_n: int
    dp_resnet_batch: int
    clip_examples: int  # local_dp: one-example steps per model
    replies: int = 10  # aggregation: replies shaped like ResNet-18


FULL = Sizes(
    cnn_n=None,
    amp_epochs=5,
    resnet_n=4096 + 100,
    resnet_batch=256,
    resnet_epochs=2,
    reps=3,
    det_resnet_n=1024 + 40,
    det_resnet_batch=128,
    dp_cnn_n=None,
    dp_epochs=2,
    dp_resnet_n=512,
    dp_resnet_batch=64,
    clip_examples=4,
)
QUICK = Sizes(
    cnn_n=512,
    amp_epochs=3,
    resnet_n=256 + 20,
    resnet_batch=64,
    resnet_epochs=1,
    reps=2,
    det_resnet_n=40,
    det_resnet_batch=16,
    dp_cnn_n=256,
    dp_epochs=1,
    dp_resnet_n=32,
    dp_resnet_batch=8,
    clip_examples=2,
)


@dataclass
class Ctx:
    """What every check gets: the device, the sizes, the output folder."""

    device: torch.device
    sizes: Sizes
    out: Path
    quick: bool

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    @cached_property
    def digits_all(self) -> tuple[Examples, DataSpec]:
        """The default dataset's (scikit-learn digits, offline) training split, as the ClientApp holds it."""
        train_src, test_src = load_splits(DatasetConfig(), seed=0)
        return materialize(train_src), data_spec(train_src, test_src)

    def digits(self, n: int | None) -> tuple[Examples, DataSpec]:
        data, spec = self.digits_all
        return (data if n is None else Examples(data.x[:n], data.y[:n])), spec


def needs_gpu(ctx: Ctx, what: str = "") -> None:
    if not ctx.gpu:
        raise Skip(f"needs a CUDA device (this run is on {ctx.device}){': ' + what if what else ''}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_images(n: int, seed: int = 0) -> Examples:
    """n random uint8 3x32x32 images with labels 0-9 (ResNet-18's workload)."""
    g = torch.Generator().manual_seed(seed)
    return Examples(
        torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g),
        torch.randint(0, 10, (n,), dtype=torch.int64, generator=g),
    )


def app_model(
    name: str, spec: DataSpec, amp: str, device: torch.device, channels_last: str = "auto", seed: int = 0
) -> tuple[nn.Module, Precision]:
    """A seeded model prepared as `app.client_app.prepare_job` does (precision, layout, device)."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(name=name), spec)
    precision = with_layout(resolve_precision(amp, device), model, channels_last)
    return prepare_model(model, precision), precision


def run_python(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> dict[str, Any]:
    """Run `python ARGS` from the repository root; its last stdout line is JSON, returned parsed."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"subprocess exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


def interleaved(runners: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """One untimed warm-up of each runner, then `reps` rounds in ABBA order; each runner returns a figure."""
    for run in runners.values():
        run()
    names = list(runners)
    results: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            results[name].append(runners[name]())
    return results


def state_of(model: nn.Module) -> TensorDict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- checks

CHILD_UUID = """
import json, torch
from app.task.telemetry import nvml_uuid
print(json.dumps({"visible": torch.cuda.device_count(),
                  "torch_uuid": str(torch.cuda.get_device_properties(0).uuid), "nvml_uuid": nvml_uuid(0)}))
"""


def check_telemetry(ctx: Ctx, fig: dict[str, Any]) -> None:
    """GpuTelemetry reports device-wide keys; NVML's UUID matches torch's, also under CUDA_VISIBLE_DEVICES=<uuid>."""
    needs_gpu(ctx, "NVML telemetry")
    data, spec = ctx.digits(ctx.sizes.cnn_n)
    model, precision = app_model("cnn", spec, "auto", ctx.device)
    with GpuTelemetry(ctx.device, interval_s=0.05) as telemetry:
        train(model, data, TrainConfig(epochs=2), precision, seed=0)
    metrics = telemetry.metrics()
    fig["metrics"] = metrics
    torch_uuid = str(torch.cuda.get_device_properties(ctx.index).uuid)
    fig["torch_uuid"], fig["nvml_uuid"] = torch_uuid, nvml_uuid(ctx.device)
    names = {f"GPU-{torch_uuid}", f"MIG-{torch_uuid}"}
    child = run_python(["-c", CHILD_UUID], env={"CUDA_VISIBLE_DEVICES": fig["nvml_uuid"]})
    fig["child_under_uuid"] = child
    problems = []
    if metrics.get("gpu-telemetry") != 1.0:
        problems.append(f"gpu-telemetry={metrics.get('gpu-telemetry')}")
    if not any(k.startswith("gpu-device-") for k in metrics):
        problems.append(f"no gpu-device-* keys in {sorted(metrics)}")
    if fig["nvml_uuid"] not in names:
        problems.append(f"nvml_uuid {fig['nvml_uuid']} is not GPU-/MIG-{torch_uuid}")
    if child["visible"] != 1 or child["nvml_uuid"] != fig["nvml_uuid"]:
        problems.append(f"under CUDA_VISIBLE_DEVICES={fig['nvml_uuid']}: {child}")
    if child["nvml_uuid"] not in {f"GPU-{child['torch_uuid']}", f"MIG-{child['torch_uuid']}"}:
        problems.append(f"child's NVML UUID {child['nvml_uuid']} is not its torch UUID {child['torch_uuid']}")
    fig["headline"] = f"{len(metrics)} metrics, {fig['nvml_uuid']}"
    expect_none(problems)


def _fedbuff(device: torch.device) -> FedBuff:
    return FedBuff(
        buffer_size=3,
        max_staleness=2,
        staleness=staleness_fn("polynomial", 0.5),
        server_lr=0.5,
        server_momentum=0.9,
        device=device,
    )


def _fedbuff_flush(strategy: FedBuff, version: int, models: list[dict[str, np.ndarray]]) -> ArrayRecord:
    """Tasks out at `version` answered with `models` (as tests/test_fedbuff.py drives it): one flush."""
    replies = []
    for i, arrays in enumerate(models):
        message_id = f"v{version}-m{i}"
        strategy.in_flight[message_id] = InFlight(100 + i, version, deadline=math.inf)
        replies.append(make_reply(100 + i, arrays, {"num-examples": 10 + 5 * i}, message_id=message_id))
    new, _ = strategy.aggregate_train(version, replies)
    expect(new is not None and strategy.version == version + 1, f"no flush at version {version}")
    return new


def _perturbed(record: ArrayRecord, rng: np.random.Generator, n: int) -> list[dict[str, np.ndarray]]:
    base = {k: a.numpy() for k, a in record.items()}
    return [
        {
            k: (v + rng.normal(scale=0.1, size=v.shape).astype(v.dtype))
            if v.dtype.kind == "f"
            else np.asarray(v + 1, dtype=v.dtype)
            for k, v in base.items()
        }
        for _ in range(n)
    ]


def check_fedbuff_momentum_resume(ctx: Ctx, fig: dict[str, Any]) -> None:
    """FedBuff(momentum, cuda): flush, checkpoint, resume into a fresh strategy, flush again."""
    needs_gpu(ctx, "the defect is CPU and CUDA tensors mixed in one server step")
    rng = np.random.default_rng(0)
    start = ArrayRecord(
        {
            "conv.weight": Array(rng.normal(size=(16, 3, 3, 3)).astype(np.float32)),
            "fc.weight": Array(rng.normal(size=(10, 16)).astype(np.float32)),
            "fc.bias": Array(rng.normal(size=(10,)).astype(np.float32)),
            "bn.num_batches_tracked": Array(np.array(7, dtype=np.int64)),
        }
    )
    first = _perturbed(start, rng, 3)
    strategy = _fedbuff(ctx.device)
    strategy.set_model(start, 0)
    new1 = _fedbuff_flush(strategy, 0, first)
    path = ctx.out / "fedbuff_checkpoint.pt"
    state = {k: torch.from_numpy(a.numpy().copy()) for k, a in new1.items()}
    save_checkpoint(path, Checkpoint(state, 1, strategy.state_dict(), capture_rng(), 0.0))
    ckpt = load_checkpoint(path)
    resumed = _fedbuff(ctx.device)
    resumed.load_state_dict(ckpt.strategy_state)
    resumed.set_model(ArrayRecord(ckpt.state_dict), ckpt.round)  # as app.run.federation resumes
    fig["velocity_devices_after_load"] = sorted({str(v.device) for v in resumed.velocity.values()})
    second = _perturbed(new1, rng, 3)
    new2 = _fedbuff_flush(resumed, 1, second)
    fig["velocity_devices_after_second_flush"] = sorted({str(v.device) for v in resumed.velocity.values()})
    reference = _fedbuff(CPU)  # the same two flushes without a checkpoint, on the CPU
    reference.set_model(start, 0)
    _fedbuff_flush(reference, 0, first)
    ref2 = _fedbuff_flush(reference, 1, second)
    diff = max(float(np.abs(new2[k].numpy().astype(np.float64) - ref2[k].numpy()).max()) for k in ref2)
    vdiff = max(float((resumed.velocity[k].cpu().double() - reference.velocity[k].double()).abs().max()) for k in ref2)
    fig.update(version=resumed.version, max_abs_diff_vs_uninterrupted_cpu=diff, velocity_max_abs_diff=vdiff)
    fig["headline"] = f"version {resumed.version}, velocity on {fig['velocity_devices_after_second_flush']}"
    problems = []
    for when in ("after_load", "after_second_flush"):
        devices = fig[f"velocity_devices_{when}"]
        if any(not d.startswith("cuda") for d in devices):
            problems.append(f"velocity {when.replace('_', ' ')} on {devices}")
    if not (diff <= 1e-5 and vdiff <= 1e-5):
        problems.append(f"resumed CUDA run differs from the uninterrupted CPU run by {diff:g} (velocity {vdiff:g})")
    expect_none(problems)


def check_device_index_refused(ctx: Ctx, fig: dict[str, Any]) -> None:
    """resolve_device(cuda:<device_count>) raises a ConfigError naming CUDA_VISIBLE_DEVICES."""
    needs_gpu(ctx, "device indices exist only with CUDA")
    count = torch.cuda.device_count()
    fig["device_count"], fig["CUDA_VISIBLE_DEVICES"] = count, os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        resolve_device(f"cuda:{count}")
    except ConfigError as err:
        fig["message"] = str(err)
    else:
        raise CheckFailed(f"resolve_device('cuda:{count}') was accepted with {count} visible device(s)")
    expect(resolve_device(f"cuda:{count - 1}").index == count - 1, f"cuda:{count - 1} was refused")
    fig["headline"] = f"cuda:{count} refused"
    expect(
        "CUDA_VISIBLE_DEVICES" in fig["message"], f"the message does not name CUDA_VISIBLE_DEVICES: {fig['message']}"
    )


def check_amp_modes(ctx: Ctx, fig: dict[str, Any]) -> None:
    """The CNN on digits per amp mode, one train() per epoch: finite loss, last epoch below the first."""
    data, spec = ctx.digits(ctx.sizes.cnn_n)
    problems, ran = [], []
    for amp in ("off", "fp16", "bf16"):
        if amp == "fp16" and not ctx.gpu:
            why = "fp16 with a GradScaler needs CUDA (on the CPU train.amp=fp16 runs as bf16)"
            fig[amp] = {"verdict": "skipped", "why": why}
            continue
        if amp == "bf16" and ctx.gpu and torch.cuda.get_device_capability(ctx.device) < (8, 0):
            fig[amp] = {"verdict": "skipped", "why": "compute capability < 8.0: no native bf16"}
            continue
        cfg = TrainConfig(epochs=1, amp=amp, grad_clip=1.0 if amp == "fp16" else 0.0)
        model, precision = app_model("cnn", spec, amp, ctx.device)
        losses, rates, skipped, scales = [], [], [], []
        scaler_state = None
        for epoch in range(ctx.sizes.amp_epochs):
            stats = train(model, data, cfg, precision, seed=epoch, scaler_state=scaler_state)
            scaler_state = stats.scaler_state or None  # what the ClientApp keeps in its Context
            losses.append(stats.loss)
            rates.append(stats.samples_per_s)
            skipped.append(stats.skipped_steps)
            scales.append(stats.scaler_state.get("scale"))
        row: dict[str, Any] = {"amp": precision.amp, "epoch_losses": losses, "samples_per_s": statistics.median(rates)}
        if amp == "fp16":
            row.update(grad_clip=cfg.grad_clip, skipped_steps=skipped, scale_after_each_epoch=scales)
            if not all(s is not None and s > 0 for s in scales):
                problems.append(f"fp16: no GradScaler state after some epoch: {scales}")
        fig[amp] = row
        ran.append(amp)
        if precision.amp != amp:
            problems.append(f"{amp}: resolved to {precision.amp}")
        if not all(math.isfinite(x) for x in losses):
            problems.append(f"{amp}: non-finite loss {losses}")
        elif not losses[-1] < losses[0]:
            problems.append(f"{amp}: last-epoch loss {losses[-1]:.4f} >= first {losses[0]:.4f}")
    fig["headline"] = ", ".join(
        f"{a} {fig[a]['epoch_losses'][0]:.2f}->{fig[a]['epoch_losses'][-1]:.2f}" if a in ran else f"{a} skipped"
        for a in ("off", "fp16", "bf16")
    )
    expect_none(problems)


def timer_worker(device: torch.device, sizes: Sizes) -> dict[str, Any]:
    """In a fresh process: ResNet-18 with cudnn_benchmark, train() twice; both timers and the outer clock."""
    data = random_images(sizes.resnet_n)
    cfg = TrainConfig(epochs=sizes.resnet_epochs, batch_size=sizes.resnet_batch, cudnn_benchmark=True)
    model, precision = app_model("resnet18", RESNET_SPEC, "auto", device)
    walls, outer = [], []
    for call in range(2):
        sync(device)
        t0 = time.perf_counter()
        walls.append(train(model, data, cfg, precision, seed=call).wall_time_s)
        sync(device)
        outer.append(time.perf_counter() - t0)
    return {
        "samples": len(data),
        "batch_size": cfg.batch_size,
        "last_batch": len(data) % cfg.batch_size,
        "epochs": cfg.epochs,
        "amp": precision.amp,
        "channels_last": precision.channels_last,
        "wall_time_s": walls,
        "outer_s": outer,  # whole train() calls: the first includes warm-up and autotuning
    }


def check_timer_excludes_autotuning(ctx: Ctx, fig: dict[str, Any]) -> None:
    """The first and second timed calls of a fresh process agree within 20% (autotuning is outside the timer)."""
    needs_gpu(ctx, "cuDNN autotuning and lazy CUDA kernel loading")
    args = [str(Path(__file__).resolve()), "--worker", "timer", "--device", str(ctx.device), "--out", str(ctx.out)]
    fig.update(run_python(args + (["--quick"] if ctx.quick else [])))
    first, second = fig["wall_time_s"]
    fig["ratio_first_over_second"] = first / second
    fig["headline"] = f"timed {first:.3f} s then {second:.3f} s (whole first call {fig['outer_s'][0]:.2f} s)"
    expect(abs(first - second) <= 0.2 * second, f"first timed call {first:.3f} s vs second {second:.3f} s")


def _train_rate(
    name: str, spec: DataSpec, data: Examples, cfg: TrainConfig, device: torch.device, channels_last: str
) -> float:
    """samples/s of one app train() call on a fresh seeded model in the given layout (amp auto)."""
    model, precision = app_model(name, spec, "auto", device, channels_last=channels_last)
    return train(model, data, cfg, precision, seed=0).samples_per_s


def check_channels_last(ctx: Ctx, fig: dict[str, Any]) -> None:
    """samples/s with channels_last on and off; the layout `auto` picks is at most 10% slower."""
    needs_gpu(ctx, "layout speed is a CUDA kernel question")
    s = ctx.sizes
    digits, spec = ctx.digits(s.cnn_n)
    workloads = {
        "cnn": (spec, digits, TrainConfig(epochs=3)),
        "resnet18": (RESNET_SPEC, random_images(s.resnet_n), TrainConfig(epochs=1, batch_size=s.resnet_batch)),
    }
    problems = []
    for name, (model_spec, data, cfg) in workloads.items():
        auto = use_channels_last(build_model(ModelConfig(name=name), model_spec), "auto", ctx.device)
        runners = {
            setting: functools.partial(_train_rate, name, model_spec, data, cfg, ctx.device, setting)
            for setting in ("on", "off")
        }
        rates = interleaved(runners, s.reps)
        med = {k: statistics.median(v) for k, v in rates.items()}
        picked, other = ("on", "off") if auto else ("off", "on")
        ratio = med[picked] / med[other]
        fig[name] = {
            "auto_picks": picked,
            "samples_per_s_on": med["on"],
            "samples_per_s_off": med["off"],
            "ratio_picked_over_other": ratio,
            "runs": rates,
        }
        if ratio < 0.9:
            problems.append(f"{name}: auto picks channels_last={picked}, {ratio:.2f}x the other layout's speed")
    fig["headline"] = ", ".join(
        f"{n} {fig[n]['auto_picks']} {fig[n]['ratio_picked_over_other']:.2f}x" for n in workloads
    )
    expect_none(problems)


def _aggregation_replies(n: int, outliers: set[int]) -> tuple[ArrayRecord, list]:
    """A ResNet-18 global model and n replies around it; `outliers` move 100x further."""
    torch.manual_seed(0)
    glob = {k: v.numpy() for k, v in build_model(ModelConfig(name="resnet18"), RESNET_SPEC).state_dict().items()}
    rng = np.random.default_rng(0)
    replies = []
    for i in range(n):
        scale = np.float32(1.0 if i in outliers else 0.01)
        arrays = {
            k: (g + scale * rng.standard_normal(g.shape, dtype=np.float32))
            if g.dtype.kind == "f"
            else np.asarray(g + 10 + i, dtype=g.dtype)
            for k, g in glob.items()
        }
        replies.append(make_reply(i + 1, arrays, {"num-examples": 100 + 10 * i}))
    return ArrayRecord({k: Array(v) for k, v in glob.items()}), replies


def check_aggregation_cuda_vs_cpu(ctx: Ctx, fig: dict[str, Any]) -> None:
    """FedAvg, Krum (f=2), the coordinate median (f=2) and Bulyan (f=1: n >= 4f+3) give the same model on CUDA and on the CPU."""
    needs_gpu(ctx, "compares CUDA aggregation with the CPU's")
    n, outliers = ctx.sizes.replies, {2, 7}
    global_record, replies = _aggregation_replies(n, outliers)
    specs, global_views = specs_of(global_record), record_to_tensors(global_record)
    methods: dict[str, Callable[[torch.device], FedAvg]] = {
        "fedavg": lambda d: FedAvg(device=d),
        "krum": lambda d: RobustStrategy(rule=KrumRule(num_byzantine=2, device=d), device=d),
        "median": lambda d: RobustStrategy(rule=MedianRule(num_byzantine=2, device=d), device=d),
        "bulyan": lambda d: RobustStrategy(rule=BulyanRule(num_byzantine=1, device=d), device=d),  # n >= 4f+3
    }
    out: dict[str, dict[str, TensorDict]] = {}
    picks: dict[str, list[int]] = {}
    for dev, device in (("cuda", ctx.device), ("cpu", CPU)):
        for name, make in methods.items():
            strategy = make(device)

            def aggregate(strategy: FedAvg = strategy) -> ArrayRecord:
                strategy._specs, strategy._global = specs, global_views  # what configure_train records
                strategy.train_report = RoundReport(sampled=n)
                arrays, _ = strategy.aggregate_train(1, replies)
                return arrays

            aggregate()  # untimed: kernel loading, allocator growth
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            arrays = aggregate()
            sync(device)
            row = fig.setdefault(name, {})
            row[f"{dev}_s"] = time.perf_counter() - t0
            if device.type == "cuda":
                row["cuda_peak_mb"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
            out.setdefault(name, {})[dev] = {k: t.clone() for k, t in record_to_tensors(arrays).items()}
            if name == "krum":
                picks[dev] = strategy.train_report.accepted
    problems = []
    for name in methods:
        cuda, cpu = out[name]["cuda"], out[name]["cpu"]
        diff = max(float((cuda[k].double() - cpu[k].double()).abs().max()) for k in cpu)
        fig[name]["max_abs_diff"] = diff
        if diff > 1e-6:
            problems.append(f"{name}: CUDA and CPU differ by {diff:g}")
    fig["krum"].update(picks_cuda=picks["cuda"], picks_cpu=picks["cpu"], outlier_nodes=sorted(i + 1 for i in outliers))
    if picks["cuda"] != picks["cpu"]:
        problems.append(f"Krum picks {picks['cuda']} on CUDA, {picks['cpu']} on the CPU")
    fig["replies"] = n
    fig["headline"] = ", ".join(f"{m} {fig[m]['cuda_s']:.2f}/{fig[m]['cpu_s']:.2f} s" for m in methods) + " (cuda/cpu)"
    expect_none(problems)


def check_threads_share_gpu(ctx: Ctx, fig: dict[str, Any]) -> None:
    """Two threads train at once on one GPU: finite times, no peak memory; a lone run reports a peak."""
    needs_gpu(ctx, "GPU sharing")
    data = random_images(ctx.sizes.resnet_n // 2)
    cfg = TrainConfig(epochs=ctx.sizes.resnet_epochs, batch_size=ctx.sizes.resnet_batch // 2)
    barrier, results, errors = threading.Barrier(2), [None, None], []

    def node(i: int) -> None:
        try:
            model, precision = app_model("resnet18", RESNET_SPEC, "auto", ctx.device, seed=i)
            barrier.wait(timeout=60)
            results[i] = train(model, data, cfg, precision, seed=i)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(f"thread {i}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    expect_none(errors)
    model, precision = app_model("resnet18", RESNET_SPEC, "auto", ctx.device)
    lone = train(model, data, cfg, precision, seed=2)
    fig["threads"] = [{"wall_time_s": r.wall_time_s, "peak_gpu_mem_mb": r.peak_gpu_mem_mb} for r in results]
    fig["lone"] = {"wall_time_s": lone.wall_time_s, "peak_gpu_mem_mb": lone.peak_gpu_mem_mb}
    problems = [
        f"thread {i}: wall {r.wall_time_s}, peak {r.peak_gpu_mem_mb}"
        for i, r in enumerate(results)
        if not (math.isfinite(r.wall_time_s) and r.wall_time_s > 0 and r.peak_gpu_mem_mb is None)
    ]
    if not (lone.peak_gpu_mem_mb is not None and lone.peak_gpu_mem_mb > 0):
        problems.append(f"lone run peak {lone.peak_gpu_mem_mb}")
    fig["headline"] = f"threads {[round(r.wall_time_s, 3) for r in results]} s, lone peak {lone.peak_gpu_mem_mb} MB"
    expect_none(problems)


def check_deterministic(ctx: Ctx, fig: dict[str, Any]) -> None:
    """train.deterministic=true: ResNet-18 and the CNN trained twice from one seed are bit-identical."""
    s = ctx.sizes
    digits, spec = ctx.digits(s.cnn_n)
    workloads = {
        "resnet18": (RESNET_SPEC, random_images(s.det_resnet_n), TrainConfig(epochs=1, batch_size=s.det_resnet_batch)),
        "cnn": (spec, digits, TrainConfig(epochs=1)),
    }
    problems = []
    for name, (model_spec, data, cfg) in workloads.items():
        cfg = TrainConfig(epochs=cfg.epochs, batch_size=cfg.batch_size, deterministic=True)
        states, precision = [], None
        for _ in range(2):
            model, precision = app_model(name, model_spec, cfg.amp, ctx.device, seed=0)
            train(model, data, cfg, precision, seed=3)
            states.append(state_of(model))
        differing = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
        fig[name] = {
            "amp": precision.amp,
            "channels_last": precision.channels_last,
            "samples": len(data),
            "identical": not differing,
            "differing_keys": differing[:5],
        }
        if differing:
            problems.append(f"{name}: {len(differing)} tensors differ, e.g. {differing[:3]}")
    fig["headline"] = ", ".join(f"{n} {'identical' if fig[n]['identical'] else 'DIFFERENT'}" for n in workloads)
    expect_none(problems)


def check_bf16_choice(ctx: Ctx, fig: dict[str, Any]) -> None:
    """amp=auto resolves to bf16 exactly when the device's compute capability is >= 8.0."""
    needs_gpu(ctx, "compute capability")
    capability = torch.cuda.get_device_capability(ctx.device)
    amp = resolve_precision("auto", ctx.device).amp
    fig.update(capability=list(capability), auto_amp=amp, headline=f"sm {capability[0]}.{capability[1]} -> {amp}")
    expect((amp == "bf16") == (capability >= (8, 0)) and amp in ("bf16", "fp16"), f"capability {capability} -> {amp}")


def check_lora_checkpointing(ctx: Ctx, fig: dict[str, Any]) -> None:
    """model=hf with LoRA (a 2-layer Llama from a config) under amp auto: a finite loss that falls
    over 3 epochs, and gradient checkpointing trains the same adapters (issue 35's CUDA path)."""
    from app.config.schema import TaskConfig
    from app.task.checkpointing import enable_checkpointing
    from app.task.metrics import Task

    tiny = {
        "model_type": "llama",
        "vocab_size": 259,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    }
    spec = DataSpec((128,), 259, causal_lm=True)
    x = torch.randint(0, 259, (32, 128), generator=torch.Generator().manual_seed(0))
    data = Examples(x, torch.roll(x, -1, 1))
    task = Task.from_config(TaskConfig(type="causal_lm", metrics=["token_accuracy"]), spec)
    precision = resolve_precision("auto", ctx.device)
    states, losses = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model(ModelConfig(name="hf", config=tiny, peft="lora"), spec)
        if checkpointing:
            enable_checkpointing(model)
        model = prepare_model(model, precision)
        cfg = TrainConfig(epochs=3, batch_size=8, lr=0.01, optimizer="adamw", device=str(ctx.device))
        losses.append(train(model, data, cfg, precision, seed=0, task=task).loss)
        states.append({n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad})
    diff = max(float((states[0][k] - states[1][k]).abs().max()) for k in states[0])
    fig.update(amp=precision.amp, losses=losses, max_abs_diff=diff, headline=f"{precision.amp}, diff {diff:.2e}")
    expect(all(math.isfinite(v) for v in losses), f"losses {losses}")
    expect(diff < 1e-2, f"checkpointing changed the trained adapters by {diff}")


def check_rng_resume_fewer_gpus(ctx: Ctx, fig: dict[str, Any]) -> None:
    """A checkpoint holding device_count()+3 CUDA RNG states restores without raising."""
    needs_gpu(ctx, "CUDA RNG states")
    rng = capture_rng()
    extra = [rng["cuda"][0].clone() for _ in range(3)]
    rng["cuda"] = list(rng["cuda"]) + extra
    path = ctx.out / "rng_checkpoint.pt"
    save_checkpoint(path, Checkpoint({"w": torch.zeros(1)}, 1, {}, rng, 0.0))
    saved = load_checkpoint(path).rng
    fig.update(visible=torch.cuda.device_count(), saved_states=len(saved["cuda"]))
    torch.cuda.manual_seed_all(12345)  # something else, so the restore has to set it
    restore_rng(saved)
    restored = torch.equal(torch.cuda.get_rng_state(0), saved["cuda"][0])
    fig.update(device0_restored=restored, headline=f"{fig['saved_states']} states on {fig['visible']} GPU(s)")
    expect(restored, "the visible GPU's RNG state was not restored")


def _clip_steps(ctx: Ctx, name: str, spec: DataSpec, data: Examples, amp: str, clip: float, count: int) -> list[float]:
    """Norm of one DP-SGD step on each of `count` single examples (q=1, no noise, lr=1, no momentum):
    the clipped per-example gradient itself (tests/test_local_dp.py's method)."""
    from app.privacy.dp_sgd import make_private_compatible, train_private

    norms = []
    for i in range(count):
        torch.manual_seed(0)
        model = make_private_compatible(build_model(ModelConfig(name=name), spec))
        precision = with_layout(resolve_precision(amp, ctx.device), model, "auto")
        model = prepare_model(model, precision)
        before = torch.cat([p.detach().flatten().float().clone() for p in model.parameters()])
        train_private(
            model,
            Examples(data.x[i : i + 1], data.y[i : i + 1]),
            TrainConfig(epochs=1, batch_size=1, lr=1.0, momentum=0.0),
            PrivacyConfig(noise_multiplier=0.0, clip_norm=clip),
            precision,
            RecordDict(),
            {},
        )
        step = torch.cat([p.detach().flatten().float() for p in model.parameters()]) - before
        norms.append(float(step.norm()))
    return norms


def check_local_dp(ctx: Ctx, fig: dict[str, Any]) -> None:
    """DP-SGD on the CNN in bf16 and on ResNet-18 in the default precision: finite epsilon, gradients within clip."""
    from app.privacy.dp_sgd import make_private_compatible, train_private

    s = ctx.sizes
    digits, spec = ctx.digits(s.dp_cnn_n)
    workloads = {
        "cnn": (spec, digits, "bf16", TrainConfig(epochs=s.dp_epochs, batch_size=32)),
        "resnet18": (
            RESNET_SPEC,
            random_images(s.dp_resnet_n),
            "auto",
            TrainConfig(epochs=s.dp_epochs, batch_size=s.dp_resnet_batch),
        ),
    }
    clip, problems = 0.1, []
    # Opacus's RDP accountant warns when few steps put the optimum at its smallest order; epsilon is still valid.
    warnings.filterwarnings("ignore", message="Optimal order is the smallest alpha")
    for name, (model_spec, data, amp, cfg) in workloads.items():
        torch.manual_seed(0)
        model = make_private_compatible(build_model(ModelConfig(name=name), model_spec))
        precision = with_layout(resolve_precision(amp, ctx.device), model, "auto")
        model = prepare_model(model, precision)
        stats, metrics = train_private(model, data, cfg, PrivacyConfig(), precision, RecordDict(), {})
        norms = _clip_steps(ctx, name, model_spec, data, amp, clip, s.clip_examples)
        epsilon = metrics["dp-epsilon"]
        fig[name] = {
            "amp": precision.amp,
            "samples": len(data),
            "steps": stats.steps,
            "samples_per_s": stats.samples_per_s,
            "dp_epsilon": epsilon,
            "clip_norm": clip,
            "one_example_step_norms": norms,
            "max_step_over_clip": max(norms) / clip,
        }
        if not math.isfinite(epsilon):
            problems.append(f"{name}: dp-epsilon {epsilon}")
        if max(norms) > clip * (1 + 1e-4):
            problems.append(f"{name}: a clipped per-example step has norm {max(norms):.6g} > clip {clip}")
    fig["headline"] = ", ".join(
        f"{n} eps {fig[n]['dp_epsilon']:.2f}, step/clip {fig[n]['max_step_over_clip']:.5f}" for n in workloads
    )
    expect_none(problems)


def plain_loop(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, precision: Precision, seed: int
) -> float:
    """Samples/s of a minimal PyTorch loop on device-resident float inputs (same layout, amp, batches)."""
    device = precision.device
    layout = torch.channels_last if precision.channels_last else torch.contiguous_format
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    scaler = torch.amp.GradScaler(device.type) if precision.amp == "fp16" else None
    generator = torch.Generator().manual_seed(seed)
    model.train()
    sync(device)
    t0, seen = time.perf_counter(), 0
    for _ in range(cfg.epochs):
        for idx in torch.randperm(len(y), generator=generator).to(device).split(cfg.batch_size):
            if len(idx) < 2:  # the app's rule: BatchNorm cannot train on one example
                continue
            xb, yb = x[idx].contiguous(memory_format=layout), y[idx]
            optimizer.zero_grad(set_to_none=True)
            amp = torch.autocast(device.type, dtype=precision.dtype) if precision.dtype else contextlib.nullcontext()
            with amp:
                loss = F.cross_entropy(model(xb), yb)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            seen += len(idx)
    sync(device)
    return seen / (time.perf_counter() - t0)


def check_client_loop_vs_plain(ctx: Ctx, fig: dict[str, Any]) -> None:
    """samples/s of the app's train() over a plain PyTorch loop (ResNet-18 on a GPU, the CNN on a CPU)."""
    s = ctx.sizes
    if ctx.gpu:
        name, spec, data = "resnet18", RESNET_SPEC, random_images(s.resnet_n)
        cfg = TrainConfig(epochs=s.resnet_epochs, batch_size=s.resnet_batch)
    else:
        data, spec = ctx.digits(s.cnn_n)
        name, cfg = "cnn", TrainConfig(epochs=1)
    _, precision = app_model(name, spec, "auto", ctx.device)
    x = model_inputs(data.x.to(ctx.device), precision)  # float 0-1 in the layout, before any timing
    y = data.y.to(ctx.device)

    def ours() -> float:
        model, precision = app_model(name, spec, "auto", ctx.device)
        return train(model, data, cfg, precision, seed=0).samples_per_s

    def plain() -> float:
        model, precision = app_model(name, spec, "auto", ctx.device)
        return plain_loop(model, x, y, cfg, precision, seed=0)

    rates = interleaved({"ours": ours, "plain": plain}, s.reps)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["ours"] / med["plain"]
    fig.update(
        model=name,
        amp=precision.amp,
        channels_last=precision.channels_last,
        samples=len(data),
        batch_size=cfg.batch_size,
        samples_per_s_ours=med["ours"],
        samples_per_s_plain=med["plain"],
        ratio=ratio,
        runs=rates,
        headline=f"{name}: ours/plain = {ratio:.3f}",
    )
    if not ctx.gpu:
        raise Skip("timing assertion only on a GPU")
    expect(ratio >= 0.9, f"ours/plain = {ratio:.3f} < 0.9")


CHILD_NOTICE = """
import json
from app.task.telemetry import hidden_gpus_notice
print(json.dumps({"notice": hidden_gpus_notice()}))
"""


def check_hidden_gpu_notice(ctx: Ctx, fig: dict[str, Any]) -> None:
    """A process denied the GPUs (CUDA_VISIBLE_DEVICES="") on a GPU machine gets a notice."""
    needs_gpu(ctx, "the notice is about GPUs a process cannot see")
    fig.update(run_python(["-c", CHILD_NOTICE], env={"CUDA_VISIBLE_DEVICES": ""}))
    fig["headline"] = (fig["notice"] or "(none)")[:60]
    expect(bool(fig["notice"]), "hidden_gpus_notice() is empty with CUDA_VISIBLE_DEVICES='' on a GPU machine")


def check_device_seconds(ctx: Ctx, fig: dict[str, Any]) -> None:
    """A training reply's `device-s` on a GPU (what a signed work record states, and the status
    channel's heartbeat carries) is NVML's busy time: above 0 and at most the training time."""
    needs_gpu(ctx, "device seconds from NVML utilisation")
    import tempfile

    from app.run.results import read_rows
    from app.tools.in_process import run_in_process

    with tempfile.TemporaryDirectory() as root, quiet_logs():
        overrides = "federation.rounds=1 train.epochs=2 train.telemetry_interval_s=0.05 ledger=off"
        summary, _ = run_in_process(overrides, root, nodes=2)
        train = read_rows(summary["run_dir"])[0]["train"]
    fig["train"] = {k: train.get(k) for k in ("device-s", "wall-time-s", "gpu-telemetry")}
    busy, wall = float(train.get("device-s", 0.0)), float(train["wall-time-s"])
    problems = []
    if train.get("gpu-telemetry") != 1.0:
        problems.append(f"gpu-telemetry={train.get('gpu-telemetry')}: NVML did not sample the training")
    if not 0 < busy <= wall * 1.0001:
        problems.append(f"device-s {busy} is not in (0, wall-time-s {wall}]")
    fig["headline"] = f"device-s {busy:.3f} of {wall:.3f} s"
    expect_none(problems)


CHECKS: dict[str, Callable[[Ctx, dict[str, Any]], None]] = {
    "telemetry": check_telemetry,
    "fedbuff_momentum_resume": check_fedbuff_momentum_resume,
    "device_index_refused": check_device_index_refused,
    "amp_modes": check_amp_modes,
    "timer_excludes_autotuning": check_timer_excludes_autotuning,
    "channels_last": check_channels_last,
    "aggregation_cuda_vs_cpu": check_aggregation_cuda_vs_cpu,
    "threads_share_gpu": check_threads_share_gpu,
    "deterministic": check_deterministic,
    "bf16_choice": check_bf16_choice,
    "lora_checkpointing": check_lora_checkpointing,
    "rng_resume_fewer_gpus": check_rng_resume_fewer_gpus,
    "local_dp": check_local_dp,
    "client_loop_vs_plain": check_client_loop_vs_plain,
    "hidden_gpu_notice": check_hidden_gpu_notice,
    "device_seconds": check_device_seconds,
}

WORKERS: dict[str, Callable[[torch.device, Sizes], dict[str, Any]]] = {"timer": timer_worker}


# --------------------------------------------------------------------------- running and reporting


def run_check(fn: Callable[[Ctx, dict[str, Any]], None], ctx: Ctx) -> dict[str, Any]:
    """One check's verdict, why and figures; it never raises."""
    fig: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        fn(ctx, fig)
        head: dict[str, Any] = {"verdict": "pass"}
    except Skip as err:
        head = {"verdict": "skipped", "why": str(err)}
    except Exception as err:  # noqa: BLE001 - one check's failure must not stop the others
        head = {"verdict": "fail", "why": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=6)}
    return {**head, **fig, "seconds": round(time.perf_counter() - t0, 3)}


def cpu_model() -> str:
    """bench/machine.py's CPU name (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_machine", ROOT / "bench" / "machine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cpu_model()


def machine_info(device: torch.device) -> dict[str, Any]:
    import flwr
    import opacus

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "flwr": flwr.__version__,
        "opacus": opacus.__version__,
        "cuda_available": torch.cuda.is_available(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            capability=list(torch.cuda.get_device_capability(device)),
            gpu_memory_gb=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            device_count=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        except Exception as err:  # noqa: BLE001 - machine info is best effort
            info["driver"] = f"unknown ({err})"
    return info


def jsonable(value: Any) -> Any:  # noqa: ANN401 - any figure
    """Figures as strict JSON: non-finite floats and torch/numpy objects become strings or numbers."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def print_table(checks: dict[str, dict[str, Any]]) -> None:
    width = max(len(name) for name in checks)
    print(f"{'check'.ljust(width)}  verdict  seconds  detail")
    print("-" * (width + 30))
    for name, result in checks.items():
        detail = result.get("why") if result["verdict"] != "pass" else result.get("headline", "")
        detail = " ".join(str(detail or "").split())
        detail = detail if len(detail) <= 90 else detail[:87] + "..."
        print(f"{name.ljust(width)}  {result['verdict']:<7}  {result['seconds']:7.1f}  {detail}")


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """The app's INFO logs (Krum's picks, Opacus's fixes) would bury the table."""
    loggers = [logging.getLogger(n) for n in ("flwr", "flwr.fedgpu", "opacus")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for smoke.json (created)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    p.add_argument("--quick", action="store_true", help="smaller data, fewer epochs and repetitions (for a CPU)")
    p.add_argument("--only", default="", help="comma-separated check names to run (default: all)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)  # a fresh-process part of a check
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = QUICK if args.quick else FULL
    if args.worker:
        with quiet_logs():
            print(json.dumps(jsonable(WORKERS[args.worker](device, sizes))))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"error: unknown check(s) {unknown}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    act_as_server()  # replies are built outside a run (app/simulation/messages.py)
    ctx = Ctx(device=device, sizes=sizes, out=args.out, quick=args.quick)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"machine": machine_info(device), "device": str(device), "quick": args.quick}
    print(f"GPU smoke check on {device} ({report['machine'].get('gpu', report['machine']['cpu'])})", flush=True)
    checks: dict[str, dict[str, Any]] = {}
    with quiet_logs():
        for name in names:
            checks[name] = run_check(CHECKS[name], ctx)
            print(f"  {name}: {checks[name]['verdict']} ({checks[name]['seconds']:.1f} s)", flush=True)
    report["checks"] = checks
    for verdict, key in (("pass", "passed"), ("fail", "failed"), ("skipped", "skipped")):
        report[key] = [n for n, r in checks.items() if r["verdict"] == verdict]
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    path = args.out / "smoke.json"
    path.write_text(json.dumps(jsonable(report), indent=2) + "\n")
    print()
    print_table(checks)
    print(
        f"\n{len(report['passed'])} passed, {len(report['failed'])} failed, {len(report['skipped'])} skipped "
        f"in {report['wall_s']:.0f} s; figures in {path}"
    )
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

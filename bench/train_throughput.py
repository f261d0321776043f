"""Client training loop throughput: ours vs a plain PyTorch loop, measured in one run.

What it measures
    1. "ours": the ClientApp's training path exactly as `app/client_app.py::train_handler`
       runs it: `resolve_precision` -> `with_layout` -> `prepare_model` -> `GpuTelemetry(...)` around
       `app.task.training.train(...)`. Timed from entering the telemetry context to a device
       sync after it exits, so data staging, optimizer creation, loss/accuracy
       accumulation and telemetry start/stop are all inside the measurement.
    2. "plain": a textbook loop (`model.train()`; per batch `zero_grad`, forward,
       `cross_entropy`, `backward`, `step`) with the same SGD-momentum settings, batch
       size, epochs, shuffle rule, precision (fp32) and memory layout (channels_last
       exactly where ours picks it: `use_channels_last`, so like is compared with like). Its inputs are the same images,
       converted to float 0-1 once and placed on the device *before* timing (the most
       favourable setting for the baseline; `--plain-input uint8` makes it convert each
       batch like ours does). No metrics are accumulated.
    Samples/s = samples trained / wall time, for both. The headline is the ratio
    ours/plain of the medians (goal >= 0.97).

Why it is built this way
    Same model (same initial weights, rebuilt for every repetition), same data, same
    device and batch size, so the ratio isolates the loop itself. Repetitions are
    interleaved (one warm-up of each, then ours/plain alternating in ABBA order) and
    the median of each is reported, so machine noise and thermal/frequency drift hit
    both loops equally. Throughput numbers from different runs or machines are not
    comparable; the ratio from one run is.

Workloads
    * cnn:      the default model (SmallCNN) on scikit-learn digits (the default
                DatasetConfig training split, materialized as uint8 1x8x8), batch 32.
    * resnet18: ResNet-18 (32x32 stem) on random uint8 3x32x32 images, 10 classes,
                batch 256 (kept small on a CPU: `--resnet-samples`).
    On CUDA, additionally: ResNet-18 at batch 256 through our loop with train.amp =
    off / fp16 / bf16 -> samples/s and peak memory (torch.cuda.max_memory_allocated).
    Without CUDA that part prints that it was skipped.

Run from the repository root:  python bench/train_throughput.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from machine import cpu_model  # bench/machine.py (bench/ is on sys.path when run as a script)

# Make `import app` work when run as `python bench/train_throughput.py` from the repo root
# even without the editable install.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from app.config.schema import DatasetConfig, ModelConfig, TrainConfig  # noqa: E402
from app.task.data import DataSpec, Examples, data_spec, load_splits, materialize  # noqa: E402
from app.task.models import build_model  # noqa: E402
from app.task.telemetry import GpuTelemetry  # noqa: E402
from app.task.training import (  # noqa: E402
    bf16_native,
    prepare_model,
    resolve_device,
    resolve_precision,
    train,
    use_channels_last,
    with_layout,
)

GOAL_RATIO = 0.97


# --------------------------------------------------------------------------- helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine_info(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cuda_available": torch.cuda.is_available(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def samples_per_run(n: int, batch_size: int, epochs: int) -> int:
    """Samples one run trains on, with `app.task.training.batch_indices`' rule (a trailing batch of one is dropped)."""
    full, rest = divmod(n, batch_size)
    per_epoch = n - rest if (rest == 1 and full >= 1) else n
    return per_epoch * epochs


@dataclass
class Workload:
    name: str
    model_cfg: ModelConfig
    spec: DataSpec
    data: Examples  # uint8 N x C x H x W on the host, as the ClientApp holds it
    cfg: TrainConfig
    init_state: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)

    def fresh_model(self) -> nn.Module:
        model = build_model(self.model_cfg, self.spec)
        model.load_state_dict(self.init_state)
        return model

    @property
    def samples(self) -> int:
        return samples_per_run(len(self.data), self.cfg.batch_size, self.cfg.epochs)


def make_workload(
    name: str, model_cfg: ModelConfig, spec: DataSpec, data: Examples, cfg: TrainConfig, seed: int
) -> Workload:
    torch.manual_seed(seed)
    init = {k: v.detach().clone() for k, v in build_model(model_cfg, spec).state_dict().items()}
    return Workload(name, model_cfg, spec, data, cfg, init)


def digits_workload(args: argparse.Namespace) -> Workload:
    train_src, test_src = load_splits(DatasetConfig(), args.seed)
    data = materialize(train_src)
    spec = data_spec(train_src, test_src)
    cfg = TrainConfig(
        epochs=args.cnn_epochs, batch_size=args.cnn_batch_size, lr=args.lr, momentum=args.momentum, amp="off"
    )
    return make_workload("cnn / digits", ModelConfig(name="cnn"), spec, data, cfg, args.seed)


def resnet_workload(args: argparse.Namespace, n: int, epochs: int) -> Workload:
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (n,), dtype=torch.int64, generator=g)
    spec = DataSpec((3, 32, 32), 10)
    cfg = TrainConfig(epochs=epochs, batch_size=args.resnet_batch_size, lr=args.lr, momentum=args.momentum, amp="off")
    return make_workload(
        "resnet18 / random 32x32", ModelConfig(name="resnet18", width=64), spec, Examples(x, y), cfg, args.seed
    )


# --------------------------------------------------------------------------- the two loops


@dataclass
class RunResult:
    samples_per_s: float
    wall_s: float
    internal_samples_per_s: float | None = None  # train()'s own timer (ours only)
    peak_mem_mb: float | None = None


def run_ours(w: Workload, device: torch.device, amp: str, seed: int) -> RunResult:
    """The path of `train_handler`: resolve_precision, prepare_model, GpuTelemetry around train()."""
    cfg = TrainConfig(**{**asdict(w.cfg), "amp": amp, "device": str(device)})
    model = w.fresh_model()
    precision = with_layout(resolve_precision(amp, device), model, cfg.channels_last)
    model = prepare_model(model, precision)
    torch.manual_seed(seed)
    sync(device)
    start = time.perf_counter()
    with GpuTelemetry(precision.device, cfg.telemetry_interval_s):
        stats = train(model, w.data, cfg, precision, seed)
    sync(device)
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    expected = w.samples
    if stats.steps and abs(stats.samples_per_s * stats.wall_time_s - expected) > 0.5:
        raise RuntimeError(f"ours trained {stats.samples_per_s * stats.wall_time_s:.0f} samples, expected {expected}")
    return RunResult(expected / wall, wall, stats.samples_per_s, peak)


def plain_layout(w: Workload, device: torch.device) -> torch.memory_format:
    """The layout ours trains `w`'s model in on `device` (train.channels_last=auto)."""
    channels_last = use_channels_last(w.fresh_model(), w.cfg.channels_last, device)
    return torch.channels_last if channels_last else torch.contiguous_format


def plain_inputs(w: Workload, device: torch.device, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline's tensors, made once before timing, in ours' layout."""
    x = w.data.x.float().div_(255.0) if mode == "float" else w.data.x
    return x.to(device).contiguous(memory_format=plain_layout(w, device)), w.data.y.to(device)


def run_plain(w: Workload, device: torch.device, x: torch.Tensor, y: torch.Tensor, seed: int) -> RunResult:
    """Textbook fp32 loop: model.train(); zero_grad, forward, cross_entropy, backward, step."""
    layout = plain_layout(w, device)
    model = w.fresh_model().to(device, memory_format=layout)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    n, bs = len(y), w.cfg.batch_size
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=w.cfg.lr, momentum=w.cfg.momentum, weight_decay=w.cfg.weight_decay
    )
    model.train()
    seen = 0
    for _ in range(w.cfg.epochs):
        perm = torch.randperm(n, generator=g).to(device)
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            if len(idx) < 2 and i > 0:  # same rule as ours: BatchNorm cannot train on one sample
                continue
            xb = (x[idx] if x.dtype != torch.uint8 else x[idx].float().div_(255.0)).contiguous(memory_format=layout)
            yb = y[idx]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            seen += len(idx)
    sync(device)
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    assert seen == w.samples, (seen, w.samples)
    return RunResult(seen / wall, wall, None, peak)


# --------------------------------------------------------------------------- measurement


def interleave(runners: dict[str, Callable[[], RunResult]], reps: int, warmup: int) -> dict[str, list[RunResult]]:
    """Warm up every runner, then run them in alternating (ABBA...) order `reps` times each."""
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    results: dict[str, list[RunResult]] = {name: [] for name in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            results[name].append(runners[name]())
    return results


def summarize(runs: list[RunResult]) -> dict[str, object]:
    sps = [r.samples_per_s for r in runs]
    out: dict[str, object] = {
        "median_samples_per_s": statistics.median(sps),
        "min_samples_per_s": min(sps),
        "max_samples_per_s": max(sps),
        "runs_samples_per_s": sps,
        "median_wall_s": statistics.median(r.wall_s for r in runs),
    }
    internal = [r.internal_samples_per_s for r in runs if r.internal_samples_per_s is not None]
    if internal:
        out["median_internal_samples_per_s"] = statistics.median(internal)
    peaks = [r.peak_mem_mb for r in runs if r.peak_mem_mb is not None]
    if peaks:
        out["peak_mem_mb"] = max(peaks)
    return out


def compare(w: Workload, device: torch.device, args: argparse.Namespace, reps: int) -> dict[str, object]:
    x, y = plain_inputs(w, device, args.plain_input)
    seed = args.seed
    results = interleave(
        {"ours": lambda: run_ours(w, device, "off", seed), "plain": lambda: run_plain(w, device, x, y, seed)},
        reps=reps,
        warmup=args.warmup,
    )
    ours, plain = summarize(results["ours"]), summarize(results["plain"])
    paired = [o.samples_per_s / p.samples_per_s for o, p in zip(results["ours"], results["plain"], strict=True)]
    return {
        "workload": w.name,
        "device": str(device),
        "precision": "fp32",
        "samples": len(w.data),
        "epochs": w.cfg.epochs,
        "batch_size": w.cfg.batch_size,
        "samples_per_run": w.samples,
        "reps": reps,
        "plain_input": args.plain_input,
        "ours": ours,
        "plain": plain,
        "ratio_ours_over_plain": ours["median_samples_per_s"] / plain["median_samples_per_s"],
        "paired_ratios": paired,
        "paired_ratio_median": statistics.median(paired),
        # Best run of each: the least disturbed by other load on a shared machine.
        "ratio_best": ours["max_samples_per_s"] / plain["max_samples_per_s"],
    }


def gpu_amp(device: torch.device, args: argparse.Namespace) -> list[dict[str, object]]:
    """ResNet-18 at batch 256 through our loop with train.amp = off / fp16 / bf16."""
    w = resnet_workload(args, args.gpu_resnet_samples, args.gpu_resnet_epochs)
    modes = ["off", "fp16"] + (["bf16"] if bf16_native(device) else [])
    results = interleave(
        {m: (lambda m=m: run_ours(w, device, m, args.seed)) for m in modes}, reps=args.gpu_reps, warmup=args.warmup
    )
    rows = []
    for m in modes:
        s = summarize(results[m])
        rows.append(
            {
                "amp": m,
                "workload": w.name,
                "samples": len(w.data),
                "epochs": w.cfg.epochs,
                "batch_size": w.cfg.batch_size,
                **s,
            }
        )
    base = rows[0]["median_samples_per_s"]
    for row in rows:
        row["speedup_vs_fp32"] = row["median_samples_per_s"] / base
    return rows


# --------------------------------------------------------------------------- output


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs of each loop")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; None = torch's choice")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument(
        "--plain-input",
        choices=("float", "uint8"),
        default="float",
        help="baseline inputs: float 0-1 made once before timing, or uint8 converted per batch like ours",
    )
    p.add_argument(
        "--cnn-epochs",
        type=int,
        default=3,
        help="epochs per cnn/digits run (the train config's default is 5; examples/s does not depend on it)",
    )
    p.add_argument("--cnn-batch-size", type=int, default=32, help="train config default: 32")
    p.add_argument("--cnn-reps", type=int, default=20, help="timed repetitions of each loop (interleaved)")
    p.add_argument("--skip-cnn", action="store_true")
    p.add_argument(
        "--resnet-samples",
        type=int,
        default=None,
        help="random images for the ResNet-18 comparison; None = 512 on CPU, 10240 on CUDA",
    )
    p.add_argument("--resnet-epochs", type=int, default=1)
    p.add_argument("--resnet-batch-size", type=int, default=256)
    p.add_argument(
        "--resnet-reps", type=int, default=None, help="timed repetitions of each loop; None = 4 on CPU, 6 on CUDA"
    )
    p.add_argument("--skip-resnet", action="store_true")
    p.add_argument("--gpu-resnet-samples", type=int, default=10240, help="CUDA AMP table: images per run")
    p.add_argument("--gpu-resnet-epochs", type=int, default=2, help="CUDA AMP table: epochs per run")
    p.add_argument("--gpu-reps", type=int, default=5, help="CUDA AMP table: timed reps per precision")
    p.add_argument("--json", metavar="PATH", help="also write all numbers as JSON to PATH")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
    except ValueError as err:  # ConfigError: e.g. --device cuda without CUDA
        print(f"error: {err}", file=sys.stderr)
        return 2
    on_cuda = device.type == "cuda"
    machine = machine_info(device)
    t0 = time.perf_counter()

    print("Client training loop throughput: ours (app.task.training.train via the train_handler path) vs plain PyTorch")
    for k in ("cpu", "cpu_count", "torch", "device", "gpu", "torch_threads", "torch_interop_threads"):
        if k in machine:
            print(f"  {k:22s} {machine[k]}")
    print(
        f"  {'plain inputs':22s} {args.plain_input} ({'pre-converted to float once, before timing' if args.plain_input == 'float' else 'uint8, converted per batch'})"
    )
    print(f"  {'timing':22s} {args.warmup} warm-up run(s) of each loop, then interleaved reps (ABBA); medians\n")

    comparisons = []
    if not args.skip_cnn:
        w = digits_workload(args)
        print(f"[cnn / digits] {len(w.data)} samples x {w.cfg.epochs} epochs, batch {w.cfg.batch_size} ...", flush=True)
        comparisons.append(compare(w, device, args, args.cnn_reps))
    if not args.skip_resnet:
        n = args.resnet_samples or (10240 if on_cuda else 512)
        reps = args.resnet_reps or (6 if on_cuda else 4)
        w = resnet_workload(args, n, args.resnet_epochs)
        print(
            f"[resnet18 / random 32x32] {n} samples x {w.cfg.epochs} epochs, batch {w.cfg.batch_size} ...", flush=True
        )
        comparisons.append(compare(w, device, args, reps))

    print()
    headers = [
        "workload",
        "device",
        "batch",
        "samples/run",
        "reps",
        "ours samples/s",
        "plain samples/s",
        "ours/plain",
        "paired med",
        "best/best",
        "ours spread",
        "plain spread",
    ]
    rows = []
    for c in comparisons:
        o, p = c["ours"], c["plain"]
        rows.append(
            [
                c["workload"],
                c["device"],
                str(c["batch_size"]),
                str(c["samples_per_run"]),
                str(c["reps"]),
                f"{o['median_samples_per_s']:.1f}",
                f"{p['median_samples_per_s']:.1f}",
                f"{c['ratio_ours_over_plain']:.3f}",
                f"{c['paired_ratio_median']:.3f}",
                f"{c['ratio_best']:.3f}",
                f"{o['min_samples_per_s']:.0f}-{o['max_samples_per_s']:.0f}",
                f"{p['min_samples_per_s']:.0f}-{p['max_samples_per_s']:.0f}",
            ]
        )
    if rows:
        print_table(headers, rows)
        print(
            "  ours/plain = ratio of the medians; paired med = median of rep-by-rep ratios; "
            "best/best = fastest run of each (least disturbed by other load)"
        )
        for c in comparisons:
            verdict = "OK" if c["ratio_ours_over_plain"] >= GOAL_RATIO else "BELOW GOAL"
            internal = c["ours"].get("median_internal_samples_per_s")
            print(
                f"  {c['workload']}: ours/plain = {c['ratio_ours_over_plain']:.3f} (goal >= {GOAL_RATIO}) {verdict}; "
                f"train()'s own timer: {internal:.1f} samples/s"
            )

    gpu_rows: list[dict[str, object]] = []
    print()
    if on_cuda:
        print(
            f"[GPU] ResNet-18 32x32, batch {args.resnet_batch_size}, our loop, train.amp = off / fp16 / bf16 "
            f"({args.gpu_resnet_samples} samples x {args.gpu_resnet_epochs} epochs, {args.gpu_reps} reps) ...",
            flush=True,
        )
        gpu_rows = gpu_amp(device, args)
        print_table(
            ["amp", "samples/s", "vs fp32", "peak mem MiB", "train() timer samples/s"],
            [
                [
                    str(r["amp"]),
                    f"{r['median_samples_per_s']:.0f}",
                    f"{r['speedup_vs_fp32']:.2f}x",
                    f"{r.get('peak_mem_mb', float('nan')):.0f}",
                    f"{r.get('median_internal_samples_per_s', float('nan')):.0f}",
                ]
                for r in gpu_rows
            ],
        )
    else:
        print(
            "GPU part skipped: no CUDA device (fp32 vs fp16-AMP vs bf16-AMP and peak memory run whenever CUDA is available)."
        )

    elapsed = time.perf_counter() - t0
    print(f"\ntotal benchmark time: {elapsed:.0f} s")
    if args.json:
        out = {
            "machine": machine,
            "args": vars(args),
            "goal_ratio": GOAL_RATIO,
            "comparisons": comparisons,
            "gpu_amp": gpu_rows if on_cuda else None,
            "gpu_skipped": not on_cuda,
            "elapsed_s": elapsed,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compressed uplink: bytes against accuracy for every mode, side by side, and codec throughput.

    python bench/compression.py                        # default task, 10 nodes, 20 rounds, seed 42
    python bench/compression.py --modes none int8 --rounds 10 --seeds 42 43
    python bench/compression.py --throughput-only      # encode + decode GB/s of an 11.7M-entry update

`federation` part: the default task (digits, the default CNN and recipe) on 10 nodes, one run
per mode and seed with the same seed, through the real ServerApp loop and ClientApp on the
in-process grid (`app/tools/in_process.py`; the same code as under `flwr run`, where the bytes
and the accuracy are the same): the mean bytes of a reply's arrays (`bytes_up`) and of a task
(`bytes_down`), final and best test accuracy, and the first round at `--target` accuracy.

`throughput` part: encode + decode of one update shaped like ResNet-18's state dict (11.7M
fp32 entries) on this machine's CPU (and the GPU when there is one), in GB/s of fp32 update
(best of `--repeats`): decoded into a dense update, and added into an aggregate as FedAvg does.
On a VM whose page faults are slow, prefix `MALLOC_MMAP_THRESHOLD_=1000000000
MALLOC_TRIM_THRESHOLD_=100000000000` to see the codec without the kernel's cost of fresh pages.

Writes a Markdown table to stdout and `--json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's `app` first

import torch  # noqa: E402

from app.compression.codecs import check_parts, decode, encode  # noqa: E402

MODES = {
    "none": "compression=none",
    "fp16": "compression=fp16",
    "bf16": "compression=bf16",
    "int8": "compression=int8",
    "topk-10%": "compression=topk compression.ratio=0.1",
    "topk-1%": "compression=topk compression.ratio=0.01",
    "topk-1%-int8": "compression=topk compression.ratio=0.01 compression.quantize_values=true",
    "topk-1%-no-feedback": "compression=topk compression.ratio=0.01 compression.error_feedback=false",
    "topk-10%-no-feedback": "compression=topk compression.ratio=0.1 compression.error_feedback=false",
    # the downlink as well: tasks in half precision, or as deltas from each node's copy
    "none+down-fp16": "compression=none compression.downlink=fp16",
    "int8+down-delta": "compression=int8 compression.downlink=delta",
    "topk-10%+down-delta": "compression=topk compression.ratio=0.1 compression.downlink=delta",
}


def run_one(job: tuple[str, int, int, int, str]) -> dict:
    """One federation in a worker process (one torch thread)."""
    mode, rounds, nodes, seed, out_root = job
    from app.run.results import read_rows
    from app.tools.in_process import run_in_process

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    overrides = f"{MODES[mode]} federation.rounds={rounds} seed={seed} name={mode}-{seed} tracking.tensorboard=false"
    started = time.time()
    summary, _ = run_in_process(overrides, out_root, nodes=nodes)
    rows = read_rows(Path(summary["run_dir"]))
    return {
        "mode": mode,
        "seed": seed,
        "curve": [r["accuracy"] for r in rows],
        "final_accuracy": summary["final_accuracy"],
        "best_accuracy": summary["best_accuracy"],
        "bytes_up": sum(r["bytes_up"] for r in rows) / len(rows),
        "bytes_down": sum(r["bytes_down"] for r in rows) / len(rows),
        "encode_s": sum(r["train"]["encode-s"] for r in rows) / len(rows) if "encode-s" in rows[0]["train"] else 0.0,
        "seconds": time.time() - started,
    }


def resnet18_shaped_update(device: torch.device) -> dict[str, torch.Tensor]:
    """Random tensors with ResNet-18's state-dict shapes (torchvision, 10 classes)."""
    from torchvision.models import resnet18

    gen = torch.Generator().manual_seed(0)
    return {
        k: (0.01 * torch.randn(v.shape, generator=gen)).to(device) if v.is_floating_point() else v.to(device)
        for k, v in resnet18(num_classes=10).state_dict().items()
    }


def resnet18_bytes() -> dict[str, int]:
    """The bytes of one reply's arrays for ResNet-18 (10 classes) per mode, through the real
    packing (`app/compression/packing.py`): sizes depend on shapes only, not on the data."""
    from flwr.app import ArrayRecord, RecordDict

    from app.compression.packing import pack
    from app.config.schema import CompressionConfig

    received = resnet18_shaped_update(torch.device("cpu"))
    trained = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in received.items()}
    sizes = {"none": sum(len(a.data) for a in ArrayRecord(trained).values())}
    for mode, overrides in MODES.items():
        settings = dict(item.split("=") for item in overrides.split() if "downlink" not in item)
        name = settings.pop("compression")
        if mode == "none" or "+" in mode or name == "none":
            continue
        cfg = CompressionConfig(
            name=name,
            ratio=float(settings.get("compression.ratio", 0.01)),
            quantize_values=settings.get("compression.quantize_values") == "true",
            error_feedback=settings.get("compression.error_feedback") != "false",
        )
        sizes[mode] = sum(len(a.data) for a in pack(trained, received, cfg, RecordDict()).values())
    return sizes


def throughput(device: torch.device, repeats: int) -> dict[str, dict[str, float]]:
    """GB/s of fp32 update through encode + decode, per mode (best of `repeats`): decoded into a
    dense update (what Krum, the median or FedBuff read) and added into an aggregate (FedAvg)."""
    update = resnet18_shaped_update(device)
    gigabytes = sum(t.numel() * 4 for t in update.values() if t.is_floating_point()) / 1e9
    settings = {
        "fp16": ("fp16", {}),
        "bf16": ("bf16", {}),
        "int8": ("int8", {}),
        "topk-1%": ("topk", {"ratio": 0.01}),
        "topk-1%-int8": ("topk", {"ratio": 0.01, "quantize_values": True}),
    }
    acc = {k: torch.zeros_like(t) for k, t in update.items() if t.is_floating_point()}

    def into_aggregate(mode: str, gen: torch.Generator, kw: dict) -> None:
        pieces = check_parts(encode(update, mode, generator=gen, **kw), update, mode, **kw)
        for k, t in acc.items():
            pieces[k].add_to(t, 0.1)

    out: dict[str, dict[str, float]] = {"dense": {}, "aggregate": {}}
    for name, (mode, kw) in settings.items():
        gen = torch.Generator(device).manual_seed(0)
        for path, run in (
            ("dense", lambda: decode(encode(update, mode, generator=gen, **kw), update, mode, **kw)),  # noqa: B023
            ("aggregate", lambda: into_aggregate(mode, gen, kw)),  # noqa: B023
        ):
            best = float("inf")
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - t0)
            out[path][name] = gigabytes / best
    return out


def table(results: list[dict]) -> str:
    """Mean over seeds per mode; bytes as the factor fewer than `none`."""
    by_mode: dict[str, list[dict]] = {}
    for r in results:
        by_mode.setdefault(r["mode"], []).append(r)
    reference = by_mode.get("none")
    up0 = sum(r["bytes_up"] for r in reference) / len(reference) if reference else None
    lines = [
        "| mode | bytes up a reply | fewer than none | bytes down a task | final accuracy % | best % "
        "| first round at target |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, runs in by_mode.items():
        up = sum(r["bytes_up"] for r in runs) / len(runs)
        final = 100 * sum(r["final_accuracy"] for r in runs) / len(runs)
        best = 100 * sum(r["best_accuracy"] for r in runs) / len(runs)
        first = [r["first_at_target"] for r in runs]
        factor = f"{up0 / up:.2f}x" if up0 else "–"
        reached = ", ".join("–" if f is None else str(f) for f in first)
        down = sum(r["bytes_down"] for r in runs) / len(runs)
        lines.append(f"| {mode} | {up:,.0f} | {factor} | {down:,.0f} | {final:.1f} | {best:.1f} | {reached} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--target", type=float, default=0.95, help="accuracy for 'first round at target'")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="throughput: tries per mode (best kept)")
    parser.add_argument("--throughput-only", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    payload: dict = {"rounds": args.rounds, "nodes": args.nodes, "seeds": args.seeds, "target": args.target}
    if not args.throughput_only:
        results = []
        with tempfile.TemporaryDirectory() as out_root, ProcessPoolExecutor(max_workers=args.jobs) as pool:
            jobs = [(m, args.rounds, args.nodes, s, out_root) for s in args.seeds for m in args.modes]
            for r in pool.map(run_one, jobs):
                r["first_at_target"] = next((i + 1 for i, a in enumerate(r["curve"]) if a >= args.target), None)
                results.append(r)
                print(
                    f"{r['mode']:>20} seed {r['seed']}: final {100 * r['final_accuracy']:.1f}%, "
                    f"{r['bytes_up']:,.0f} B up a reply ({r['seconds']:.0f} s; {len(results)}/{len(jobs)})",
                    flush=True,
                )
        payload["federation"] = results
        print("\n" + table(results) + "\n")
    payload["resnet18_bytes_up"] = sizes = resnet18_bytes()
    print(
        "ResNet-18, bytes of a reply: " + ", ".join(f"{k} {v:,} ({sizes['none'] / v:.1f}x)" for k, v in sizes.items())
    )
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    payload["throughput_gbps"] = {}
    for device in devices:
        rates = throughput(device, args.repeats)
        payload["throughput_gbps"][device.type] = rates
        for path, by_mode in rates.items():
            print(
                f"encode + decode ({path}) on {device.type} ({torch.get_num_threads()} threads): "
                + ", ".join(f"{k} {v:.2f} GB/s" for k, v in by_mode.items()),
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()

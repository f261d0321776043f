"""Gradient checkpointing: peak memory and step time with and without, measured side by side.

Each (workload, mode) trains in a fresh Python process through the ClientApp's own loop
(`app.task.training.train`, checkpointing switched on by `app.task.checkpointing` as the
ClientApp does for `train.gradient_checkpointing=true`), so peak memory is the process's own:
on CUDA `torch.cuda.max_memory_allocated`, on the CPU the peak resident set (ru_maxrss) minus
the resident set just before training. Runs alternate off/on/off/on and the medians are
reported; the headline figures are the ratios on/off from this one run.

Workloads: `hf` (a 4-layer Llama-architecture causal LM built from a config, 512-token blocks,
LoRA adapters: what the option is for) and `resnet18` (the built-in-model path: block-wise
checkpointing of torchvision's BasicBlocks on 32x32 images).

    python bench/grad_checkpointing.py [--device cpu|cuda] [--repeats 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HF = {
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
}


def one(workload: str, checkpointing: bool, device: str) -> dict[str, float]:
    """Train one epoch of the workload in this process; its peak memory and time per step."""
    import torch

    from app.config.schema import ModelConfig, TaskConfig, TrainConfig
    from app.task.checkpointing import enable_checkpointing
    from app.task.data import DataSpec, Examples
    from app.task.metrics import Task
    from app.task.models import build_model
    from app.task.training import resolve_precision, train

    g = torch.Generator().manual_seed(0)
    if workload == "hf":
        spec = DataSpec((512,), 259, causal_lm=True)
        x = torch.randint(0, 259, (32, 512), generator=g)
        data, model_cfg = Examples(x, torch.roll(x, -1, 1)), ModelConfig(name="hf", config=HF, peft="lora")
        task = Task.from_config(TaskConfig(type="causal_lm", metrics=["token_accuracy"]), spec)
    else:
        spec = DataSpec((3, 32, 32), 10)
        data = Examples(torch.randint(0, 256, (256, 3, 32, 32), generator=g, dtype=torch.uint8), torch.arange(256) % 10)
        model_cfg, task = ModelConfig(name="torchvision", arch="resnet18"), Task.from_config(TaskConfig(), spec)
    torch.manual_seed(0)
    model = build_model(model_cfg, spec)
    if checkpointing:
        enable_checkpointing(model)
    precision = resolve_precision("off", torch.device(device))
    cfg = TrainConfig(epochs=1, batch_size=8 if workload == "hf" else 128, lr=0.01)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_now = _rss_kib()
    started = time.perf_counter()
    stats = train(model, data, cfg, precision, seed=0, task=task)
    wall = time.perf_counter() - started
    if device.startswith("cuda"):
        peak_mib = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mib = (max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, before) - rss_now) / 1024
    return {"peak_mib": peak_mib, "s_per_step": wall / stats.steps, "loss": stats.loss}


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", nargs="*", default=["hf", "resnet18"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one(args.child[0], args.child[1] == "on", args.device)))
        return
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for workload in args.workloads:
        runs = results.setdefault(workload, {"off": [], "on": []})
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                cmd = [sys.executable, __file__, "--device", args.device, "--child", workload, mode]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
                runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    summary = {}
    print(f"{'workload':10} {'mode':4} {'peak MiB':>9} {'s/step':>8}")
    for workload, runs in results.items():
        med = {
            m: {k: statistics.median(r[k] for r in rs) for k in ("peak_mib", "s_per_step")} for m, rs in runs.items()
        }
        for mode in ("off", "on"):
            print(f"{workload:10} {mode:4} {med[mode]['peak_mib']:9.1f} {med[mode]['s_per_step']:8.3f}")
        ratios = {
            "memory_on_over_off": med["on"]["peak_mib"] / med["off"]["peak_mib"],
            "time_on_over_off": med["on"]["s_per_step"] / med["off"]["s_per_step"],
        }
        print(
            f"{workload:10} on/off: memory x{ratios['memory_on_over_off']:.2f}, time x{ratios['time_on_over_off']:.2f}"
        )
        summary[workload] = {"median": med, **ratios, "runs": runs}
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "workloads": summary}, indent=2))


if __name__ == "__main__":
    main()

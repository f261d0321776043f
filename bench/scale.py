"""Simulation throughput through `flwr run`: time per round, samples/s against one plain
PyTorch loop, and peak memory, at 10, 100 and 1000 SuperNodes (`nodes`) and with 1, 2, 4, 8
ClientApps sharing one device (`packing`).

    python bench/scale.py nodes                  # 10, 100 and 1000 nodes, cohort 10, 4 rounds each (10 nodes: ~7 min a round on 2 cores)
    python bench/scale.py nodes --nodes 100 1000 --json out.json   # ~6 min on 2 cores
    python bench/scale.py packing                # GPU: 1, 2, 4, 8 clients per GPU; CPU: per CPU set
    python bench/scale.py packing --per-device 1 2 --train-images 8000

Every run is the user's path: `flwr run` with a private local SuperLink in simulation mode
(app/tools/sweep.py's `run_in_simulation`), the default CNN and training, on 28x28 random
images (32,000 for training, 2,000 for the server's test, written once to an .npz:
dataset=npz), IID partitions. `nodes`: one CPU per ClientApp and 10 nodes sampled a round
(1000 nodes hold ~29 training examples each). `packing`: 8 nodes, all training every round,
`client-resources-num-gpus=1/k` on a GPU (each client capped at its share,
app/task/gpu_memory.py) or `client-resources-num-cpus=CPUs/k` on a CPU.

Per run: the median round time over rounds 2..R-1 (round 1 starts Ray's ClientApp workers;
the server evaluates centrally only after round R, `federation.eval_every=R`, as the plain
loop does not evaluate), the samples trained per round (the cohort's examples x epochs),
the simulation's samples/s (those over the round time), the clients' GPU utilisation and
peak memory (from the replies), and the peak memory (PSS: shared pages count once) of every process of the run
(SuperLink, ServerApp, Ray), with the CPU seconds each kind of process used (the
ClientApps' share is the training; the rest is what a plain loop does not pay). The
reference is one plain PyTorch loop in this process (same model, batch and epochs; float
inputs on the device, made before timing; bf16 autocast on a GPU, as the ClientApp's
default) training the same number of examples: the ratio is the simulation's samples/s
over the loop's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's `app`, ahead of any installed copy

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from app.config.schema import ModelConfig, TrainConfig  # noqa: E402
from app.run.results import read_rows  # noqa: E402
from app.task.data import DataSpec  # noqa: E402
from app.task.models import build_model  # noqa: E402
from app.tools.processes import processes_under  # noqa: E402
from app.tools.sweep import HOME_ROOT_ENV, run_in_simulation  # noqa: E402
from bench.flwr_runs import random_images_npz  # noqa: E402

TRAIN, TEST, COHORT = 32_000, 2_000, 10
PLAIN_MAX = 4_000  # examples the plain loop trains on (each of its 3 tries)
PACKED_NODES = 8  # packing: the federation whose clients share a device
SPEC = DataSpec((1, 28, 28), 10)


def pss_bytes(pids: set[int]) -> int:
    """Proportional set size of `pids` (Linux /proc): shared pages split among their users."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


# What each process of a run is, by its command line: the ClientApps (Ray actors) do the
# training; everything else is overhead the plain loop does not have.
PROCESS_KINDS = (
    ("ClientAppActor", "clientapps"),
    ("flwr-simulation", "serverapp_and_simulation_engine"),
    ("flower-superlink", "superlink"),
    ("ray", "ray"),
    ("flwr", "flwr_cli"),
)


def process_kind(cmdline: bytes) -> str:
    text = cmdline.decode(errors="replace")
    return next((kind for marker, kind in PROCESS_KINDS if marker in text), "other")


def cpu_seconds(pid: int) -> tuple[str, float] | None:
    """(kind, user + system CPU seconds so far) of `pid` (Linux /proc), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return process_kind(cmdline), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ProcessSampler(threading.Thread):
    """Samples every process started under `marker` until stopped: the peak PSS of all of
    them together, and the CPU seconds each used (its last sample), summed by kind."""

    def __init__(self, marker: str, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.marker, self.interval_s, self.peak = marker, interval_s, 0
        self.cpu: dict[int, tuple[str, float]] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            pids = processes_under(self.marker)
            self.peak = max(self.peak, pss_bytes(pids))
            self.cpu |= {pid: got for pid in pids if (got := cpu_seconds(pid)) is not None}

    def stop(self) -> tuple[int, dict[str, float]]:
        """(peak PSS bytes, CPU seconds by process kind)."""
        self._stop_event.set()
        self.join()
        by_kind: dict[str, float] = {}
        for kind, seconds in self.cpu.values():
            by_kind[kind] = by_kind.get(kind, 0.0) + seconds
        return self.peak, dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))


def plain_rate(examples: int, cfg: TrainConfig, device: str = "cpu") -> float:
    """samples/s of a bare PyTorch loop: the default CNN, `examples` random 28x28 images
    already on `device` as floats (bf16 autocast on CUDA, as the ClientApp's default)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(), SPEC).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    x, y = torch.rand(examples, 1, 28, 28, device=device), torch.randint(0, 10, (examples,), device=device)
    cuda = device.startswith("cuda")
    model.train()
    if cuda:
        torch.cuda.synchronize()
    t0, seen = time.perf_counter(), 0
    for _ in range(cfg.epochs):
        for idx in torch.randperm(examples, device=device).split(cfg.batch_size):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            seen += len(idx)
    if cuda:
        torch.cuda.synchronize()
    return seen / (time.perf_counter() - t0)


def run_federation(name: str, nodes: int, cohort: int, rounds: int, fed: str, data: Path, root: Path) -> dict[str, Any]:
    """One `flwr run` of `rounds` rounds with `cohort` of `nodes` nodes training per round."""
    job = root / name
    job.mkdir(parents=True, exist_ok=True)
    overrides = [
        "dataset=npz",
        f"dataset.path={data}",
        f"federation.rounds={rounds}",
        f"federation.fraction_train={cohort / nodes}",
        f"federation.min_train_nodes={cohort}",
        f"federation.min_available_nodes={nodes}",
        f"federation.eval_every={rounds}",  # the plain loop does not evaluate: only the last round does
        "tracking.tensorboard=false",
        f'name="{name}"',
        "resume=auto",  # the run directory is the job's, which already holds flwr.log (as in app/tools/sweep.py)
    ]
    homes = root / "homes"
    homes.mkdir(exist_ok=True)
    os.environ[HOME_ROOT_ENV] = str(homes)
    sampler = ProcessSampler(str(homes))
    sampler.start()
    t0 = time.perf_counter()
    result = run_in_simulation(job, root, overrides, fed, timeout_s=3600)
    wall = time.perf_counter() - t0
    peak, cpu = sampler.stop()
    if result["error"]:
        raise RuntimeError(f"{name}: {result['error']}")
    rows = read_rows(job)
    # Not round 1 (Ray starts its workers), nor the evaluated last one (unless nothing else is left).
    later = [r for r in rows[1:] if r["accuracy"] is None] or rows[1:] or rows
    round_s = statistics.median(r["round_time_s"] for r in later)
    examples = statistics.median(r["train"]["num-examples"] for r in later)
    epochs = TrainConfig().epochs
    train = [r["train"] for r in later]
    return {
        "nodes": nodes,
        "federation_config": fed,
        "rounds": len(rows),
        "round_time_s": round_s,
        "round_times_s": [r["round_time_s"] for r in rows],
        "examples_per_round": examples * epochs,
        "samples_per_s": examples * epochs / round_s,
        "client_samples_per_s": statistics.median(t["samples-per-s"] for t in train),
        "client_peak_gpu_mem_mb": max((t.get("peak-gpu-mem-mb", 0) for t in train), default=0) or None,
        "gpu_util_mean_pct": statistics.median(t["gpu-device-util-mean-pct"] for t in train)
        if all("gpu-device-util-mean-pct" in t for t in train)
        else None,
        "peak_memory_gb": peak / 2**30,
        "cpu_s_by_process": cpu,
        "wall_s": wall,
    }


def with_plain(result: dict[str, Any], device: str) -> dict[str, Any]:
    """`result` with the plain loop's samples/s on the same examples (at most PLAIN_MAX: its
    rate does not depend on how many; 10 nodes' 32,000 would take ~7 min a try) and the
    ratio to it."""
    cfg = TrainConfig()
    examples = min(PLAIN_MAX, int(result["examples_per_round"] / cfg.epochs))
    plain = statistics.median(plain_rate(examples, cfg, device) for _ in range(3))
    return {**result, "plain_samples_per_s": plain, "ratio": result["samples_per_s"] / plain}


def nodes_experiment(args: argparse.Namespace, data: Path, root: Path) -> list[dict[str, Any]]:
    """10, 100, 1000 nodes (--nodes), cohort 10, one CPU per ClientApp."""
    results = []
    for nodes in args.nodes:
        fed = f"num-supernodes={nodes} client-resources-num-cpus=1 client-resources-num-gpus=0.0"
        r = with_plain(run_federation(f"nodes-{nodes}", nodes, min(COHORT, nodes), args.rounds, fed, data, root), "cpu")
        results.append(r)
        print(
            f"{nodes:5d} nodes: round {r['round_time_s']:.2f} s (median of rounds 2-{r['rounds'] - 1}), "
            f"{r['examples_per_round']:.0f} samples/round, {r['samples_per_s']:.0f} samples/s vs plain "
            f"{r['plain_samples_per_s']:.0f} = {r['ratio']:.2f}x; peak memory {r['peak_memory_gb']:.2f} GB; "
            f"run {r['wall_s']:.0f} s",
            flush=True,
        )
        total = sum(r["cpu_s_by_process"].values()) or 1.0
        print(
            "       CPU seconds: "
            + ", ".join(f"{k} {v:.0f} ({v / total:.0%})" for k, v in r["cpu_s_by_process"].items()),
            flush=True,
        )
    return results


def packing_experiment(args: argparse.Namespace, data: Path, root: Path) -> list[dict[str, Any]]:
    """The same federation (8 nodes, all training) with k ClientApps at once per device: on a
    GPU client-resources-num-gpus=1/k (each client capped at its share), on the CPU
    client-resources-num-cpus=cpus/k."""
    gpu = torch.cuda.is_available()
    cpus = os.cpu_count() or 1
    results = []
    for k in args.per_device:
        if not gpu and k > cpus:
            print(f"{k} clients per device: skipped, {cpus} CPUs", flush=True)
            continue
        resources = (
            f"client-resources-num-cpus=1 client-resources-num-gpus={1 / k:.4f}"
            if gpu
            else (f"client-resources-num-cpus={cpus // k} client-resources-num-gpus=0.0")
        )
        fed = f"num-supernodes={PACKED_NODES} {resources}"
        r = run_federation(f"packing-{k}", PACKED_NODES, PACKED_NODES, args.rounds, fed, data, root)
        r = with_plain({**r, "clients_per_device": k}, "cuda" if gpu else "cpu")
        results.append(r)
        util = f", GPU util {r['gpu_util_mean_pct']:.0f}%" if r["gpu_util_mean_pct"] is not None else ""
        peak = f", peak {r['client_peak_gpu_mem_mb']:.0f} MiB/client" if r["client_peak_gpu_mem_mb"] else ""
        print(
            f"{k} clients per {'GPU' if gpu else 'CPU set'}: {r['samples_per_s']:.0f} samples/s vs one plain loop "
            f"{r['plain_samples_per_s']:.0f} = {r['ratio']:.2f}x{util}{peak}; round {r['round_time_s']:.2f} s",
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", choices=["nodes", "packing"], nargs="?", default="nodes")
    p.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 1000], help="nodes: federation sizes")
    p.add_argument("--per-device", type=int, nargs="+", default=[1, 2, 4, 8], help="packing: clients per device")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--train-images", type=int, default=TRAIN, help="training images (packing: fewer is quicker)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--keep", type=Path, default=None, help="keep the runs' directories here (default: deleted)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedgpu-scale-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        data = root / "images28.npz"
        random_images_npz(data, args.train_images, TEST)
        print(
            f"{args.experiment}: {args.train_images} training images 28x28, {args.rounds} rounds, "
            f"plain loop with {torch.get_num_threads()} torch threads",
            flush=True,
        )
        run = nodes_experiment if args.experiment == "nodes" else packing_experiment
        results = run(args, data, root)
    if args.json:
        payload = {"experiment": args.experiment, "train_images": args.train_images, "results": results}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Server memory against the cohort, through `flwr run`: peak RSS of the process that runs the
ServerApp (`flwr-simulation`, which also holds the simulated SuperLink's message store) and of the
SuperLink, for our FedAvg with streamed replies (`federation.aggregation=stream`), our FedAvg with
gathered replies (`gather`) and Flower's own `flwr.serverapp.strategy.FedAvg` (`bench/server_memory_app.py`:
`flower_app`), on the same model, ClientApp and data, side by side in one run.

    python bench/server_memory.py                               # cohorts 5 10 20 40, one round each
    python bench/server_memory.py --cohorts 5 10 --json out.json

The model is `bench/server_memory_app.py`'s wide MLP (50.5 M parameters, 202 MB in float32) on tiny
data (8 random 28x28 images a node, one epoch), every node training each round
(`client-resources-num-cpus=1`). Peak RSS is VmHWM from /proc, read until the process ends. The
figure of merit is the slope: the peak's growth per added client, in model sizes (goal: at most
0.25 for streaming, where a gathered round adds about 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's `app`, ahead of any installed copy

import numpy as np  # noqa: E402

from app.tools.processes import processes_under  # noqa: E402
from app.tools.sweep import HOME_ROOT_ENV, run_in_simulation  # noqa: E402
from bench.flwr_runs import app_copy, random_images_npz  # noqa: E402

MODEL = "model=custom model._target_=bench.server_memory_app.wide_mlp"
PARAMS = 784 * 8192 + 8192 + 8192 * 5376 + 5376 + 5376 * 10 + 10
MODEL_BYTES = 4 * PARAMS
PER_NODE = 8  # training images a node holds
KINDS = {"flwr-simulation": "serverapp", "flower-superlink": "superlink"}
VARIANTS = ("stream", "gather", "flower")


def hwm_bytes(pid: int) -> int | None:
    """VmHWM (peak resident set) of `pid`, None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakSampler(threading.Thread):
    """The last VmHWM seen of every process under `marker`, by kind (KINDS)."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker, self.peaks = marker, {kind: 0 for kind in KINDS.values()}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            for pid in processes_under(self.marker):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                kind = next((k for marker, k in KINDS.items() if marker in cmd), None)
                if kind is not None and (hwm := hwm_bytes(pid)) is not None:
                    self.peaks[kind] = max(self.peaks[kind], hwm)


def flower_app_dir(root: Path) -> Path:
    """A copy of this app whose ServerApp is Flower's FedAvg (`bench.server_memory_app:flower_app`)."""
    return app_copy(root, "flower-app", server="bench.server_memory_app:flower_app")


def run(variant: str, cohort: int, data: Path, root: Path, flower_dir: Path) -> dict[str, Any]:
    name = f"{variant}-{cohort}"
    job = root / name
    job.mkdir(parents=True)
    overrides = [
        MODEL,
        "dataset=npz",
        f"dataset.path={data}",
        "federation.rounds=1",
        f"federation.min_train_nodes={cohort}",
        f"federation.min_available_nodes={cohort}",
        "train.epochs=1",
        "train.batch_size=8",
        "tracking.tensorboard=false",
        "ledger=off",
        f'name="{name}"',
        "resume=auto",
    ]
    if variant != "flower":
        overrides.append(f"federation.aggregation={variant}")
    homes = root / "homes"
    homes.mkdir(exist_ok=True)
    os.environ[HOME_ROOT_ENV] = str(homes)
    sampler = PeakSampler(str(homes))
    sampler.start()
    fed = f"num-supernodes={cohort} client-resources-num-cpus=1"
    result = run_in_simulation(job, root, overrides, fed, 3600, app_dir=flower_dir if variant == "flower" else ROOT)
    sampler.done.set()
    sampler.join()
    if result["error"]:
        raise RuntimeError(f"{name}: {result['error']}")
    return {"variant": variant, "cohort": cohort, **{f"{k}_peak_gb": v / 2**30 for k, v in sampler.peaks.items()}}


def slope(rows: list[dict[str, Any]], variant: str, kind: str) -> float:
    """Least-squares growth of the peak per added client, in model sizes."""
    pts = [(r["cohort"], r[f"{kind}_peak_gb"] * 2**30) for r in rows if r["variant"] == variant]
    x, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
    return float(np.polyfit(x, y, 1)[0] / MODEL_BYTES) if len(pts) > 1 else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cohorts", type=int, nargs="+", default=[5, 10, 20, 40])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="fedgpu-server-memory-"))
    try:
        data = root / "data.npz"
        random_images_npz(data, max(args.cohorts) * PER_NODE * 2, 16)  # partitions also set aside validation
        flower_dir = flower_app_dir(root)
        rows = []
        for cohort in args.cohorts:
            for variant in args.variants:
                rows.append(run(variant, cohort, data, root, flower_dir))
                r = rows[-1]
                print(
                    f"cohort {cohort:3d}  {variant:7s}  ServerApp peak {r['serverapp_peak_gb']:.2f} GiB"
                    f"  ({r['serverapp_peak_gb'] * 2**30 / MODEL_BYTES:.1f} x model)",
                    flush=True,
                )
        slopes = {v: slope(rows, v, "serverapp") for v in args.variants}
        print(f"model: {PARAMS / 1e6:.1f} M parameters, {MODEL_BYTES / 2**20:.0f} MiB")
        print(
            "ServerApp peak growth per added client (x model size): "
            + "  ".join(f"{v} {s:.2f}" for v, s in slopes.items())
        )
        if "flower" in slopes and "stream" in slopes:
            print(f"streamed / Flower's FedAvg: {slopes['stream'] / slopes['flower']:.2f}")
        out = {"model_parameters": PARAMS, "model_bytes": MODEL_BYTES, "runs": rows, "slope_x_model": slopes}
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Pretrain centrally, fine-tune federatedly, compare the traffic: the fine-tuning example's one command.

    python -m examples.finetune --out ~/fedgpu-runs/examples/finetune

1. Pretrains the default CNN (app.task.models.build_model) centrally on digits half "a" with
   the app's own training loop, and saves its state_dict to <out>/pretrained.pt.
2. Runs two federations through the real `flwr run` CLI, each with a private FLWR_HOME and
   SuperLink (app.tools.sweep.run_in_simulation, as sweeps do), both starting from that file
   and training on half "b" (conf/example/finetune.yaml): `head` trains and sends only the
   classifier head (model.trainable=[net.12]); `full` trains and sends every parameter.
3. Prints accuracy and bytes per reply for both and their ratio, and checks that the head
   run left every frozen parameter bit-identical to the pretrained file.

Run it from the app directory (the one with pyproject.toml): `examples` is not an installed
package, and `flwr run` ships it to the ServerApp and ClientApps from there.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.config.compose import load_config
from app.config.schema import ModelConfig, TrainConfig
from app.run.results import read_rows, read_summary
from app.task.data import DataSpec, Examples, load_splits, materialize
from app.task.models import build_model, matches
from app.task.training import evaluate, resolve_device, resolve_precision, train
from app.tools.sweep import APP_DIR, run_in_simulation
from examples.finetune.task import half

HEAD = "net.12"  # the default CNN's final nn.Linear: its classifier head
SPEC = DataSpec((1, 8, 8), 10)  # digits: 1 x 8 x 8 images, ten classes
PRESET = "+example=finetune"


def pretrain(path: Path, epochs: int = 5, seed: int = 42) -> torch.nn.Module:
    """Train the default CNN centrally on half "a" and save its state_dict to `path` (what
    `model.init_weights` loads, weights-only)."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(), SPEC)
    x, y = half("a")
    precision = resolve_precision("auto", resolve_device("auto"))
    model = model.to(precision.device)
    train(model, Examples(torch.from_numpy(x), torch.from_numpy(y)), TrainConfig(epochs=epochs), precision, seed)
    model = model.cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return model


def accuracy_on_test_split(model: torch.nn.Module, overrides: str) -> float:
    """The model's accuracy on the federation's own test split (held out of half "b")."""
    cfg, _ = load_config(overrides)
    test = materialize(load_splits(cfg.dataset, cfg.seed)[1])
    return evaluate(model, test, resolve_precision("off", torch.device("cpu")))[1]["accuracy"]


@dataclass
class Outcome:
    name: str
    final_accuracy: float
    bytes_up: float  # mean array bytes per reply
    bytes_down: float  # array bytes per task sent to a node
    wall_time_s: float  # the whole `flwr run`, start-up and teardown included


def federate(out: Path, name: str, overrides: list[str], nodes: int, timeout_s: float) -> Outcome:
    """One federation through `flwr run`; its run directory is <out>/<name>."""
    run_dir = out / name
    run_dir.mkdir(parents=True)
    fed = f"num-supernodes={nodes} client-resources-num-cpus=1"
    # name + resume=auto: the ServerApp writes into the directory that already holds the log, as
    # sweep jobs do (a plain name= refuses an existing directory).
    t0 = time.monotonic()
    result = run_in_simulation(run_dir, out, [*overrides, f'name="{name}"', "resume=auto"], fed, timeout_s)
    wall = time.monotonic() - t0
    summary = read_summary(run_dir)
    if result["error"] or not summary or summary.get("status") != "completed":
        raise SystemExit(f"the {name} run failed: {result['error'] or summary}; log: {run_dir / 'flwr.log'}")
    rows = read_rows(run_dir)
    return Outcome(
        name,
        float(summary["final_accuracy"]),
        sum(r["bytes_up"] for r in rows) / len(rows),
        sum(r["bytes_down"] for r in rows) / len(rows),
        wall,
    )


def frozen_unchanged(pretrained: Path, final: Path) -> bool:
    """Every parameter outside the head is bit-identical to the pretrained file's."""
    before = torch.load(pretrained, weights_only=True)
    after = torch.load(final, weights_only=True)
    return all(torch.equal(after[k], v) for k, v in before.items() if not matches(k, [HEAD]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("~/fedgpu-runs/examples/finetune"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--pretrain-epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per federation")
    args = parser.parse_args(argv)
    out = args.out.expanduser().resolve()
    if out == APP_DIR or APP_DIR in out.parents:
        parser.error(f"--out {out} is inside the app directory, which `flwr run` packs and ships: put it elsewhere")
    taken = [str(out / n) for n in ("head", "full") if (out / n).exists()]
    if taken:
        parser.error(f"{', '.join(taken)} exist: remove them or pick another --out")

    weights = out / "pretrained.pt"
    t0 = time.monotonic()
    model = pretrain(weights, args.pretrain_epochs, args.seed)
    common = [PRESET, f'model.init_weights="{weights}"', f"federation.rounds={args.rounds}", f"seed={args.seed}"]
    baseline = accuracy_on_test_split(model, " ".join(common))
    print(
        f"pretrained on half a in {time.monotonic() - t0:.0f} s: accuracy {baseline:.4f} on the federation's test split"
    )

    head = federate(out, "head", [*common, f"model.trainable=[{HEAD}]"], args.nodes, args.timeout_s)
    full = federate(out, "full", [*common, "model.trainable=[]"], args.nodes, args.timeout_s)
    unchanged = frozen_unchanged(weights, out / "head" / "model_final.pt")

    print(f"\n{args.rounds} rounds, {args.nodes} nodes, fine-tuning on half b (from {weights})")
    print(f"{'run':<6} {'accuracy':>9} {'bytes up/reply':>15} {'bytes down/task':>16} {'wall s':>7}")
    for o in (head, full):
        print(f"{o.name:<6} {o.final_accuracy:>9.4f} {o.bytes_up:>15,.0f} {o.bytes_down:>16,.0f} {o.wall_time_s:>7.0f}")
    print(f"full / head bytes up per reply: {full.bytes_up / head.bytes_up:.1f}x")
    print(f"head run: frozen parameters bit-identical to the pretrained file: {'yes' if unchanged else 'NO'}")
    print(f"results: {out / 'head'}, {out / 'full'}")

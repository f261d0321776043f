"""Adapter traffic and quality, through `flwr run` (Flower's simulation engine): LoRA adapters
against full fine-tuning of the same causal LM on the same offline corpus, and sequence
classification on a labelled text set.

    python bench/adapters.py --json docs/adapters-benchmark.json --plot docs/adapters-perplexity.png
    python bench/adapters.py --phases scratch --lora-lrs 0.01 --qkvo-lrs --full-lrs 0.001 --rounds 2   # a quick look

The model is `conf/model/hf_tiny.yaml`: a 2-layer Llama built from a config (hidden 128, 4 heads,
MLP 256, ByT5's 259 byte ids; 394,624 parameters), LoRA r=8 (alpha 16) on peft's default target
modules for Llama (q_proj, v_proj: 8,192 trained) or on all four attention projections (16,384),
against `model.peft=none` (full fine-tuning). The corpus is `scripts/text_corpus.py`'s: the four
longest of scikit-learn's dataset descriptions (24 KB; they ship with scikit-learn, so any
machine with it has them), one per node (`partition=by_file`), 64-byte blocks, AdamW, two local
epochs of batch 16 a round, every node every round, 10 rounds.

Two phases: `scratch` fine-tunes the config's random weights (nothing is pretrained, so LoRA
adapts a random network); `pretrained` first trains a base through `flwr run` (full training,
4 nodes iid, on the other 10 descriptions, 19 KB) and fine-tunes its exported model
(`hf/merged`, `model.path`) on the four: the setting adapters are for. Each mode runs at a few
learning rates and the best final perplexity of each is compared (every run is in the JSON).
Then sequence classification: the four descriptions' sentences labelled by document
(`text_corpus.py --labelled`), 4 nodes iid, LoRA and full, accuracy per round.

Figures read from each run's `metrics.jsonl`: `bytes_up` (the mean array bytes of one training
reply), `perplexity` and `token_accuracy` (central evaluation on the server's held-out split,
every round). Goals (the issue's): LoRA's bytes per reply at most 5% of full fine-tuning's,
LoRA's perplexity falling round over round, LoRA's final perplexity within 10% of full
fine-tuning's after the same rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's `app`, ahead of any installed copy

from app.tools.sweep import HOME_ROOT_ENV, run_in_simulation  # noqa: E402

# The four longest descriptions (24 KB): one per node (partition=by_file), and the four labels of
# the classification set (each sentence labelled with its document).
DOCS = ("twenty_newsgroups", "breast_cancer", "lfw", "kddcup99")
CLASS_DOCS = DOCS
QKVO = "[q_proj,k_proj,v_proj,o_proj]"  # LoRA on all four attention projections (peft default: q, v)


def other_docs() -> list[str]:
    """The scikit-learn descriptions not in DOCS: the base model's pretraining text."""
    import sklearn  # noqa: PLC0415

    names = sorted(f.stem for f in (Path(sklearn.__file__).parent / "datasets" / "descr").glob("*.rst"))
    return [n for n in names if n not in DOCS]


def write_corpora(root: Path) -> tuple[Path, Path, Path]:
    corpus, labelled, pretrain = root / "corpus", root / "labelled", root / "pretrain"
    script = str(ROOT / "scripts" / "text_corpus.py")
    subprocess.run([sys.executable, script, "--out", str(corpus), "--names", *DOCS], check=True, capture_output=True)
    subprocess.run(
        [sys.executable, script, "--out", str(pretrain), "--names", *other_docs()], check=True, capture_output=True
    )
    subprocess.run(
        [sys.executable, script, "--out", str(labelled), "--labelled", "--names", *CLASS_DOCS],
        check=True,
        capture_output=True,
    )
    return corpus, labelled, pretrain


def model_parameters() -> dict[str, int]:
    """Parameters of hf_tiny: the whole model and LoRA's trainable ones (built as the app builds them)."""
    import yaml  # noqa: PLC0415
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    conf = yaml.safe_load((ROOT / "conf" / "model" / "hf_tiny.yaml").read_text())
    cfg = dict(conf["config"])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    total = sum(p.numel() for p in model.parameters())
    out = {"total": int(total)}
    for key, targets in (("lora_qv_trainable", None), ("lora_qkvo_trainable", QKVO.strip("[]").split(","))):
        lora = get_peft_model(
            copy.deepcopy(model),
            LoraConfig(
                r=conf["lora_r"],
                lora_alpha=conf["lora_alpha"],
                lora_dropout=conf["lora_dropout"],
                target_modules=targets,
                task_type="CAUSAL_LM",
            ),
        )
        out[key] = int(sum(p.numel() for p in lora.parameters() if p.requires_grad))
    return out


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def fed_metric(row: dict[str, Any], name: str) -> float | None:
    fed = row.get("federated_eval")
    if isinstance(fed, dict):
        value = fed.get(name, (fed.get("metrics") or {}).get(name) if isinstance(fed.get("metrics"), dict) else None)
        return value if isinstance(value, int | float) else None
    return None


def run_one(name: str, overrides: list[str], root: Path, nodes: int, timeout_s: float) -> dict[str, Any]:
    job = root / "jobs" / name
    job.mkdir(parents=True)
    overrides = [*overrides, "tracking.tensorboard=false", "ledger=off", f'name="{name}"']
    fed = f"num-supernodes={nodes} client-resources-num-cpus=1"
    t0 = time.monotonic()
    result = run_in_simulation(job, root / "runs", overrides, fed, timeout_s, app_dir=ROOT)
    wall = time.monotonic() - t0
    run_dir = root / "runs" / name
    rows = read_rows(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if result["error"]:
        log = (job / "flwr.log").read_text(errors="replace")[-3000:] if (job / "flwr.log").exists() else ""
        raise RuntimeError(f"{name}: {result['error']}\n--- flwr.log tail ---\n{log}")
    rounds = [r for r in rows if isinstance(r.get("round"), int) and r["round"] > 0]
    return {
        "name": name,
        "overrides": overrides,
        "wall_s": round(wall, 1),
        "run_id": result["run_id"],
        "summary": summary,
        "rows": [
            {
                k: r.get(k)
                for k in ("round", "loss", "perplexity", "token_accuracy", "accuracy", "bytes_up", "bytes_down")
                if k in r
            }
            | ({"val_" + m: fed_metric(r, m) for m in ("perplexity", "accuracy", "token_accuracy") if fed_metric(r, m)})
            for r in rounds
        ],
    }


def lm_overrides(
    corpus: Path,
    peft: str,
    lr: float,
    args: argparse.Namespace,
    targets: str | None = None,
    base: Path | None = None,
    partition: str = "by_file",
    rounds: int | None = None,
) -> list[str]:
    nodes = args.nodes
    return [
        "model=hf_tiny",
        *([f"model.path={base}", "model.config=null"] if base else []),  # one of the two
        f"model.peft={peft}",
        *([f"model.lora_target_modules={targets}"] if targets else []),
        "task=causal_lm",
        "dataset=text",
        f"dataset.path={corpus}",
        "dataset.block_size=64",
        f"partition={partition}",
        f"federation.rounds={rounds or args.rounds}",
        f"federation.min_train_nodes={nodes}",
        f"federation.min_available_nodes={nodes}",
        f"train.epochs={args.epochs}",
        f"train.batch_size={args.batch_size}",
        f"train.lr={lr}",
        "train.optimizer=adamw",
    ]


def cls_overrides(labelled: Path, peft: str, lr: float, args: argparse.Namespace) -> list[str]:
    nodes, rounds = args.nodes, args.cls_rounds
    return [
        "model=hf_tiny",
        f"model.peft={peft}",
        "task=sequence_classification",
        "dataset=text",
        f"dataset.path={labelled}",
        "dataset.block_size=128",
        "dataset.test_fraction=0.2",
        "partition=iid",
        f"federation.rounds={rounds}",
        f"federation.min_train_nodes={nodes}",
        f"federation.min_available_nodes={nodes}",
        f"train.epochs={args.epochs}",
        "train.batch_size=16",
        f"train.lr={lr}",
        "train.optimizer=adamw",
    ]


def final(run: dict[str, Any], key: str) -> float | None:
    values = [r[key] for r in run["rows"] if r.get(key) is not None]
    return values[-1] if values else None


def falling(run: dict[str, Any], key: str = "perplexity") -> tuple[int, int]:
    """(rounds where `key` fell from the round before, comparisons made)."""
    values = [r[key] for r in run["rows"] if r.get(key) is not None]
    return sum(b < a for a, b in zip(values, values[1:], strict=False)), max(len(values) - 1, 0)


def plot(phases: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4.2), squeeze=False)
    for ax, (phase, result) in zip(axes[0], phases.items(), strict=True):
        for name, run in result["runs"].items():
            xs = [r["round"] for r in run["rows"] if r.get("perplexity") is not None]
            ys = [r["perplexity"] for r in run["rows"] if r.get("perplexity") is not None]
            is_best = name in result["best"].values()
            ax.plot(
                xs,
                ys,
                marker="o" if is_best else None,
                lw=2 if is_best else 1,
                alpha=1 if is_best else 0.45,
                ls="-" if name.startswith("lora") else "--",
                label=name + (" (best)" if is_best else ""),
            )
        ax.set_xlabel("round")
        ax.set_ylabel("perplexity (server's held-out split)")
        ax.set_yscale("log")
        ax.set_title(PHASE_TITLES[phase], fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("hf_tiny (2-layer Llama, 0.39 M) through flwr run, 4 nodes by file", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fmt(v: Any, spec: str = ".3f") -> str:  # noqa: ANN401
    return "-" if v is None else format(v, spec)


PHASE_TITLES = {
    "scratch": "from the config's random weights",
    "pretrained": "from a base pretrained on the other 10 descriptions",
}


def compare(
    phase: str, corpus: Path, root: Path, args: argparse.Namespace, base: Path | None, lrs: dict[str, list[float]]
) -> dict[str, Any]:
    """LoRA (q, v and q, k, v, o) and full fine-tuning at each learning rate; the best of each."""
    runs: dict[str, dict[str, Any]] = {}
    plan = [
        *[("lora-qv", "lora", lr, None) for lr in lrs["qv"]],
        *[("lora-qkvo", "lora", lr, QKVO) for lr in lrs["qkvo"]],
        *[("full", "none", lr, None) for lr in lrs["full"]],
    ]
    for mode, peft, lr, targets in plan:
        name = f"{mode}-lr{lr:g}"
        overrides = lm_overrides(corpus, peft, lr, args, targets, base)
        r = runs[name] = run_one(f"{phase}-{name}", overrides, root, args.nodes, args.timeout)
        print(
            f"{phase:10s} {name:16s} {r['wall_s']:5.0f} s  bytes_up/reply {fmt(final(r, 'bytes_up'), ',')}  "
            f"perplexity " + " ".join(fmt(x.get("perplexity"), ".2f") for x in r["rows"]),
            flush=True,
        )
    best = {
        mode: min((n for n in runs if n.startswith(mode)), key=lambda n: final(runs[n], "perplexity") or float("inf"))
        for mode in ("lora", "full")  # "lora": the best of both target sets
    }
    lora, full = runs[best["lora"]], runs[best["full"]]
    bytes_ratio = final(lora, "bytes_up") / final(full, "bytes_up")
    ppl_ratio = final(lora, "perplexity") / final(full, "perplexity")
    fell, steps = falling(lora)
    return {
        "base": "random (config)" if base is None else "pretrained through flwr run (pretrain run below)",
        "best": best,
        "goals": {
            "bytes_ratio": bytes_ratio,
            "bytes_ratio_ok": bytes_ratio <= 0.05,
            "lora_perplexity_fell": [fell, steps],
            "lora_perplexity_falling_ok": fell == steps,
            "final_perplexity_ratio": ppl_ratio,
            "final_perplexity_ok": ppl_ratio <= 1.10,
        },
        "runs": runs,
    }


def report(phase: str, result: dict[str, Any]) -> None:
    best, goals, runs = result["best"], result["goals"], result["runs"]
    lora, full = runs[best["lora"]], runs[best["full"]]
    print(f"\n== {phase}: {PHASE_TITLES[phase]}; best (final perplexity): {best['lora']}, {best['full']}")
    print(f"{'round':>5} | {'LoRA ppl':>9} {'LoRA acc':>8} | {'full ppl':>9} {'full acc':>8}")
    for a, b in zip(lora["rows"], full["rows"], strict=False):
        print(
            f"{a['round']:>5} | {fmt(a.get('perplexity'), '9.2f')} {fmt(a.get('token_accuracy'), '8.3f')} | "
            f"{fmt(b.get('perplexity'), '9.2f')} {fmt(b.get('token_accuracy'), '8.3f')}"
        )
    print(
        f"bytes per reply: LoRA {final(lora, 'bytes_up'):,}  full {final(full, 'bytes_up'):,}  "
        f"ratio {goals['bytes_ratio']:.2%} (goal <= 5%)"
    )
    fell, steps = goals["lora_perplexity_fell"]
    print(f"LoRA perplexity fell in {fell} of {steps} rounds")
    print(f"final perplexity LoRA / full: {goals['final_perplexity_ratio']:.3f} (goal <= 1.10)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=4, help="must equal the number of files (by_file)")
    parser.add_argument("--epochs", type=int, default=2, help="local epochs a round")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--phases", nargs="+", default=list(PHASE_TITLES), choices=list(PHASE_TITLES))
    parser.add_argument("--lora-lrs", type=float, nargs="+", default=[0.01, 0.03], help="LoRA on q, v")
    parser.add_argument("--qkvo-lrs", type=float, nargs="*", default=[0.01], help="LoRA on q, k, v, o")
    parser.add_argument("--full-lrs", type=float, nargs="+", default=[0.001, 0.003])
    parser.add_argument("--pretrain-rounds", type=int, default=10)
    parser.add_argument("--pretrain-lr", type=float, default=0.003)
    parser.add_argument("--cls-rounds", type=int, default=8)
    parser.add_argument("--cls-lrs", type=float, nargs=2, default=[0.01, 0.001], help="LoRA's, full's")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (runs, logs)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="fedgpu-adapters-"))
    os.environ[HOME_ROOT_ENV] = str(root / "homes")
    started = time.monotonic()
    try:
        corpus, labelled, pretrain = write_corpora(root)
        params = model_parameters()
        corpus_bytes = sum(p.stat().st_size for p in corpus.glob("*.txt"))
        pretrain_bytes = sum(p.stat().st_size for p in pretrain.glob("*.txt"))
        print(
            f"model hf_tiny: {params['total']:,} parameters, LoRA trains {params['lora_qv_trainable']:,} (q, v) "
            f"or {params['lora_qkvo_trainable']:,} (q, k, v, o); corpus {len(DOCS)} files, {corpus_bytes:,} bytes; "
            f"pretraining text {len(other_docs())} files, {pretrain_bytes:,} bytes",
            flush=True,
        )
        lrs = {"qv": args.lora_lrs, "qkvo": args.qkvo_lrs, "full": args.full_lrs}
        phases: dict[str, dict[str, Any]] = {}
        pre = None
        for phase in args.phases:
            base = None
            if phase == "pretrained":
                # the base: full training from the config's weights on the other descriptions (iid over 4 nodes)
                overrides = lm_overrides(
                    pretrain, "none", args.pretrain_lr, args, partition="iid", rounds=args.pretrain_rounds
                )
                pre = run_one("pretrain", overrides, root, args.nodes, args.timeout)
                print(
                    f"pretrain   {pre['wall_s']:5.0f} s  perplexity on its own held-out split "
                    + " ".join(fmt(x.get("perplexity"), ".2f") for x in pre["rows"]),
                    flush=True,
                )
                base = root / "runs" / "pretrain" / "hf" / "merged"
                if not (base / "config.json").exists():
                    raise RuntimeError(f"the pretraining run exported no model at {base}")
            phases[phase] = compare(phase, corpus, root, args, base, lrs)
        cls_runs = {}
        for peft, lr in zip(("lora", "none"), args.cls_lrs, strict=True):
            name = f"seqcls-{'full' if peft == 'none' else peft}-lr{lr:g}"
            cls_runs[name] = run_one(name, cls_overrides(labelled, peft, lr, args), root, args.nodes, args.timeout)
            print(f"{name:27s} {cls_runs[name]['wall_s']:5.0f} s", flush=True)
        labels = [json.loads(line)["label"] for line in (labelled / "texts.jsonl").open()]
        n_labelled, majority = len(labels), max(labels.count(c) for c in set(labels)) / len(labels)

        for phase, result in phases.items():
            report(phase, result)
        print(
            f"\nsequence classification: {n_labelled} labelled sentences, {len(CLASS_DOCS)} classes "
            f"(majority {majority:.3f}), iid, from the config's random weights"
        )
        for name, cls in cls_runs.items():
            print(
                f"  {name:20s} accuracy "
                + " ".join(fmt(x.get("accuracy"), ".3f") for x in cls["rows"])
                + f"; bytes per reply {fmt(final(cls, 'bytes_up'), ',')}"
            )
        total_s = time.monotonic() - started
        print(f"total {total_s:.0f} s")
        out = {
            "how": "python bench/adapters.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "engine": "flwr run (simulation), client-resources-num-cpus=1",
            "model": {"conf": "conf/model/hf_tiny.yaml", "layers": 2, **params},
            "corpus": {"source": "scikit-learn dataset descriptions", "files": list(DOCS), "bytes": corpus_bytes},
            "pretraining_text": {"files": other_docs(), "bytes": pretrain_bytes},
            "labelled": {"files": list(CLASS_DOCS), "examples": n_labelled, "majority_fraction": majority},
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "phases": phases,
            "pretrain": pre,
            "sequence_classification": cls_runs,
            "total_s": round(total_s),
        }
        if args.json:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        if args.plot:
            plot(phases, args.plot)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU check for shared and multiplied GPUs (issue 15): one command, one JSON file of figures.

What it runs, on the GPU, each check on its own (one failure does not stop the rest):

    amp_resnet18         ResNet-18 on random 3x32x32 images through `train()`: samples/s and peak
                         memory with amp off (fp32), bf16 and fp16, and each mode's ratio to fp32
    client_loop_vs_plain the app's loop against a plain PyTorch loop (scripts/gpu_smoke.py's check)
    capped_clients       4 ClientApp processes at once on one GPU, each capped at a 0.2 share with
                         train.batch_size=auto: the batch each probed, its cap, its peak (must stay
                         under the cap), NVML telemetry in every reply, and a second task per node
                         that reads the probed size from the node's state instead of probing
    oom_recovered        a ClientApp capped at ~1.5 GiB training ResNet-18 with batch 1024: real
                         CUDA out-of-memory errors, recovered with smaller micro-batches
    ddp_nccl             train.local_devices=2 over NCCL against one device (needs two GPUs)
    aggregation_cuda_vs_cpu  FedAvg / Krum / median on the GPU against the CPU (gpu_smoke's check)

    python bench/gpu_check.py --out DIR [--device cuda:0]      # a few minutes on one GPU
    python bench/gpu_check.py --out DIR --quick --device cpu   # what a CPU can run (tests do this)

Writes DIR/gpu_check.json ({"machine", "device", "checks": {name: {"verdict", "why", ...}}})
and a table on stdout; exit status 1 when a check failed. The figures go to
docs/benchmarks.md ("GPU check (many clients per GPU)"). The harness (verdicts,
machine info, the table) is scripts/gpu_smoke.py's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's `app`, ahead of any installed copy

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _load_smoke():  # noqa: ANN202 - a module
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = module
    spec.loader.exec_module(module)
    return module


smoke = _load_smoke()
Ctx, Skip, expect, needs_gpu = smoke.Ctx, smoke.Skip, smoke.expect, smoke.needs_gpu
RESNET_SPEC = smoke.RESNET_SPEC
GiB, MiB = 2**30, 2**20


def client_task(npz: str, overrides: str, tasks: int = 2) -> dict[str, Any]:
    """Worker: the ClientApp's train handler on this process's GPU, `tasks` times on one node
    (its state kept between them), with the data at `npz`; the replies' metrics and times."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from app.client_app import app as client_app
    from app.config.compose import load_config
    from app.protocol import DATA_PATH, to_client_record
    from app.simulation.local_grid import act_as_server
    from app.task.data import spec_to_record
    from app.task.models import build_model

    act_as_server()  # messages are built here, as the ServerApp would
    cfg, _ = load_config(overrides)
    torch.manual_seed(0)
    state = build_model(cfg.model, RESNET_SPEC).state_dict()
    config = ConfigRecord({**to_client_record(cfg), **spec_to_record(RESNET_SPEC), "server-round": 1})
    context = Context(run_id=1, node_id=1, node_config={DATA_PATH: npz}, state=RecordDict(), run_config={})
    replies, seconds = [], []
    for _ in range(tasks):
        msg = Message(RecordDict({"arrays": ArrayRecord(state), "config": config}), dst_node_id=1, message_type="train")
        t0 = time.perf_counter()
        reply = client_app(msg, context)
        seconds.append(time.perf_counter() - t0)
        if reply.has_error():
            raise RuntimeError(f"the ClientApp failed: {reply.error.reason}")
        replies.append(dict(reply.content["metrics"]))
    return {"metrics": replies, "task_s": seconds}


def write_images(path: Path, n: int) -> str:
    """n random uint8 3x32x32 images and labels, as a deployed node's data-path .npz."""
    data = smoke.random_images(n)
    np.savez(path, x=data.x.numpy(), y=data.y.numpy())
    return str(path)


def start_clients(npz: str, overrides: list[str], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One worker process per entry of `overrides`, all at once; their JSON answers in order."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--out", "-", "--worker-npz", npz, "--worker-overrides", o],
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for o in overrides
    ]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"client process exited {proc.returncode}: {err.strip()[-800:]}")
        answers.append(json.loads(out.strip().splitlines()[-1]))
    return answers


def check_amp_resnet18(ctx: Ctx, fig: dict[str, Any]) -> None:
    """samples/s and peak memory of ResNet-18 per AMP mode, each mode's ratio to fp32."""
    needs_gpu(ctx, "AMP speed and memory are GPU figures")
    from app.config.schema import TrainConfig
    from app.task.training import train

    data, modes = smoke.random_images(ctx.sizes.resnet_n), ("off", "bf16", "fp16")
    cfg = TrainConfig(epochs=ctx.sizes.resnet_epochs, batch_size=ctx.sizes.resnet_batch)
    peaks: dict[str, float] = {}

    def runner(amp: str):  # noqa: ANN202
        def run() -> float:
            model, precision = smoke.app_model("resnet18", RESNET_SPEC, amp, ctx.device)
            stats = train(model, data, cfg, precision, seed=0)
            peaks[amp] = stats.peak_gpu_mem_mb
            return stats.samples_per_s

        return run

    rates = smoke.interleaved({amp: runner(amp) for amp in modes}, ctx.sizes.reps)
    med = {amp: statistics.median(r) for amp, r in rates.items()}
    fig.update(
        samples=len(data),
        batch_size=cfg.batch_size,
        samples_per_s=med,
        peak_mem_mb=peaks,
        speedup_vs_fp32={amp: med[amp] / med["off"] for amp in modes},
        memory_vs_fp32={amp: peaks[amp] / peaks["off"] for amp in modes},
        headline=f"bf16 {med['bf16'] / med['off']:.2f}x, fp16 {med['fp16'] / med['off']:.2f}x fp32's samples/s",
    )


def check_capped_clients(ctx: Ctx, fig: dict[str, Any]) -> None:
    """4 capped ClientApps on one GPU at once, batch_size=auto; each peak under its cap."""
    needs_gpu(ctx, "memory caps act on a GPU")
    share, clients = 0.2, 4
    with tempfile.TemporaryDirectory() as tmp:
        npz = write_images(Path(tmp) / "node.npz", ctx.sizes.resnet_n)
        overrides = (
            f"model=resnet18 train.epochs=1 train.batch_size=auto train.max_batch_size=8192 "
            f"train.gpu_memory_fraction={share}"
        )
        t0 = time.perf_counter()
        answers = start_clients(npz, [overrides] * clients, {"CUDA_VISIBLE_DEVICES": str(ctx.index)})
        wall = time.perf_counter() - t0
    first = [a["metrics"][0] for a in answers]
    total_mb = torch.cuda.get_device_properties(ctx.device).total_memory / MiB
    fig.update(
        clients=clients,
        share=share,
        wall_s=wall,
        batch_size=[m["batch-size"] for m in first],
        cap_mb=[m["gpu-mem-cap-mb"] for m in first],
        peak_mb=[m.get("peak-gpu-mem-mb") for m in first],
        device_mem_used_max_mb=max(m.get("gpu-device-mem-used-max-mb", 0) for m in first),
        device_total_mb=total_mb,
        samples_per_s=[m["samples-per-s"] for m in first],
        task_s=[a["task_s"] for a in answers],
        oom_retries=[m["oom-retries"] for a in answers for m in a["metrics"]],
        headline=f"{clients} x share {share}: batch {first[0]['batch-size']}, peak/cap "
        f"{max((m.get('peak-gpu-mem-mb') or 0) / m['gpu-mem-cap-mb'] for m in first):.2f}",
    )
    for m in first:
        expect(m["gpu-telemetry"] == 1.0, "NVML telemetry missing from a reply")
        expect(m["gpu-mem-share"] == share, f"reported share {m['gpu-mem-share']}")
        peak = m.get("peak-gpu-mem-mb")
        expect(peak is None or peak <= m["gpu-mem-cap-mb"], f"peak {peak} MiB over the cap {m['gpu-mem-cap-mb']} MiB")
    expect(fig["device_mem_used_max_mb"] <= total_mb, "the device ran out")
    expect(all(a["metrics"][1]["batch-size"] == a["metrics"][0]["batch-size"] for a in answers), "batch changed")


def check_oom_recovered(ctx: Ctx, fig: dict[str, Any]) -> None:
    """Real out-of-memory errors under a small cap, recovered with smaller micro-batches."""
    needs_gpu(ctx, "a real CUDA out-of-memory error")
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    fraction = (1.5 * GiB + 512 * MiB) / total  # ~1.5 GiB for PyTorch after the CUDA context
    with tempfile.TemporaryDirectory() as tmp:
        npz = write_images(Path(tmp) / "node.npz", 2200)
        overrides = f"model=resnet18 train.epochs=1 train.batch_size=1024 train.gpu_memory_fraction={fraction:.5f}"
        (answer,) = start_clients(npz, [overrides], {"CUDA_VISIBLE_DEVICES": str(ctx.index)})
    m = answer["metrics"][0]
    fig.update(
        fraction=fraction,
        cap_mb=m["gpu-mem-cap-mb"],
        batch_size=m["batch-size"],
        oom_retries=m["oom-retries"],
        micro_batch_size=m.get("micro-batch-size"),
        train_loss=m["train-loss"],
        headline=f"batch 1024 under {m['gpu-mem-cap-mb']:.0f} MiB: {m['oom-retries']} OOM retries, "
        f"micro-batch {m.get('micro-batch-size')}",
    )
    expect(m["oom-retries"] >= 1, "no out-of-memory error happened: the cap did not bind")
    expect(np.isfinite(m["train-loss"]), "the loss is not finite")


def check_client_reply(ctx: Ctx, fig: dict[str, Any]) -> None:
    """One ClientApp process with batch_size=auto on this device: the reply's memory keys."""
    with tempfile.TemporaryDirectory() as tmp:
        npz = write_images(Path(tmp) / "node.npz", 64 if ctx.quick else 1024)
        model = "cnn" if ctx.quick else "resnet18"
        overrides = f"model={model} train.epochs=1 train.batch_size=auto train.device={ctx.device.type}"
        env = {"CUDA_VISIBLE_DEVICES": str(ctx.index) if ctx.gpu else ""}
        (answer,) = start_clients(npz, [overrides], env)
    m = answer["metrics"][0]
    fig.update(metrics=m, task_s=answer["task_s"], headline=f"batch {m['batch-size']}, {m['oom-retries']} OOM")
    expect(m["batch-size"] >= 1 and m["oom-retries"] == 0, f"batch {m['batch-size']}, retries {m['oom-retries']}")
    if not ctx.gpu:
        expect(m["batch-size"] == 32 and m["gpu-telemetry"] == 0.0, "auto on a CPU is 32, without telemetry")


def check_ddp_nccl(ctx: Ctx, fig: dict[str, Any]) -> None:
    """train.local_devices=2 over NCCL equals one-device training with the same batch."""
    needs_gpu(ctx, "NCCL")
    if torch.cuda.device_count() < 2:
        raise Skip(f"needs two GPUs; this machine shows {torch.cuda.device_count()}")
    from app.config.schema import ModelConfig, TaskConfig, TrainConfig
    from app.task.distributed import Work, local_devices, train_on_devices
    from app.task.training import train

    data, cfg = smoke.random_images(2048 + 30), TrainConfig(epochs=1, batch_size=256, lr=0.05)
    single, precision = smoke.app_model("cnn", RESNET_SPEC, "off", ctx.device)
    ddp, _ = smoke.app_model("cnn", RESNET_SPEC, "off", ctx.device)
    one = train(single, data, cfg, precision, seed=3)
    work = Work(ModelConfig(), RESNET_SPEC, TaskConfig(), cfg, precision, 3, None)
    two = train_on_devices(ddp, data, work, local_devices(2, ctx.device))
    diff = max(
        (a - b).abs().max().item() for a, b in zip(single.state_dict().values(), ddp.state_dict().values(), strict=True)
    )
    fig.update(max_abs_diff=diff, samples_per_s={"one": one.samples_per_s, "two": two.samples_per_s})
    fig["headline"] = f"max |diff| {diff:.2e}; samples/s 1 GPU {one.samples_per_s:.0f}, 2 GPUs {two.samples_per_s:.0f}"
    expect(diff < 1e-3, f"DDP differs from one device by {diff}")


CHECKS = {
    "amp_resnet18": check_amp_resnet18,
    "client_loop_vs_plain": smoke.check_client_loop_vs_plain,
    "capped_clients": check_capped_clients,
    "oom_recovered": check_oom_recovered,
    "client_reply": check_client_reply,
    "ddp_nccl": check_ddp_nccl,
    "aggregation_cuda_vs_cpu": smoke.check_aggregation_cuda_vs_cpu,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json (created)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    p.add_argument("--quick", action="store_true", help="small data and few repetitions (for a CPU)")
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    p.add_argument("--worker-npz", help=argparse.SUPPRESS)  # a ClientApp process of a check
    p.add_argument("--worker-overrides", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_npz:
        with smoke.quiet_logs():
            print(json.dumps(smoke.jsonable(client_task(args.worker_npz, args.worker_overrides))))
        return 0
    from app.simulation.local_grid import act_as_server
    from app.task.training import resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CHECKS)
    if unknown := [n for n in names if n not in CHECKS]:
        print(f"error: unknown check(s) {unknown}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    act_as_server()  # the aggregation check builds replies outside a run
    ctx = Ctx(device=device, sizes=smoke.QUICK if args.quick else smoke.FULL, out=out, quick=args.quick)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"machine": smoke.machine_info(device), "device": str(device), "quick": args.quick}
    print(f"GPU check on {device} ({report['machine'].get('gpu', report['machine']['cpu'])})", flush=True)
    checks: dict[str, dict[str, Any]] = {}
    with smoke.quiet_logs():
        for name in names:
            checks[name] = smoke.run_check(CHECKS[name], ctx)
            print(f"  {name}: {checks[name]['verdict']} ({checks[name]['seconds']:.1f} s)", flush=True)
    report["checks"] = checks
    for verdict, key in (("pass", "passed"), ("fail", "failed"), ("skipped", "skipped")):
        report[key] = [n for n, r in checks.items() if r["verdict"] == verdict]
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    path = out / "gpu_check.json"
    path.write_text(json.dumps(smoke.jsonable(report), indent=2) + "\n")
    print()
    smoke.print_table(checks)
    print(f"\n{len(report['passed'])} passed, {len(report['failed'])} failed, {len(report['skipped'])} skipped; {path}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

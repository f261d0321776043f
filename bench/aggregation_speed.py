"""Server aggregation: our FedAvg / Krum / Multi-Krum vs Flower's built-ins, in one run.

What it measures
    Replies: `--clients` (default 20) real Flower reply Messages, each with an
    ArrayRecord of Arrays and a MetricRecord holding `num-examples`, built as a
    ServerApp receives them (`Message(content, reply_to=instruction)`, cf.
    app/simulation/messages.py::make_reply). The arrays have the shapes and dtypes of
    ResNet-18's state_dict (`app.task.models.build_model`, width 64, 3x32x32 inputs, 10
    classes: 122 arrays, 11.18 M values, 44.7 MB, including the int64
    `num_batches_tracked` buffers). The global model is one random state; each client
    model is global + a small random update (honest clients with update scales 1e-3
    .. 2e-3, two Byzantine clients with 1e-2, so Krum has one well-defined winner).
    Integer buffers advance by the same count on every client (equal local schedules),
    so Flower's distances, which include them, see the same geometry as ours.

    On the SAME replies, each method is timed end to end (median of `--reps`, after one
    warm-up of each; methods interleaved rep by rep, order reversed every other rep, so
    machine noise hits all of them alike):
      * ours FedAvg     `strategies.fedavg.FedAvg.aggregate_train(1, replies)`, with the
                        global-model specs and views set as `configure_train` sets them:
                        screening (zero-copy views; keys, shapes, dtypes, weights; NaN is
                        found lazily in the output), weighted mean, output ArrayRecord,
                        metrics.
      * Flower FedAvg   `aggregate_arrayrecords([r.content for r in replies],
                        "num-examples")` alone (no validation, no metrics: the most
                        favourable slice of Flower's FedAvg).
      * ours Krum / Multi-Krum (f=2; m=1 / 4): `strategies.krum.Krum / MultiKrum
                        .aggregate_train` (screening, block-wise Gram of the updates,
                        scores, selection, weighted mean of the selected, output record).
      * Flower Krum / Multi-Krum: `flwr.serverapp.strategy.MultiKrum(
                        num_malicious_nodes=2, num_nodes_to_select=1 / 4)
                        .aggregate_train(1, replies)` (its checks, selection, averaging).
    Headline: Flower time / our time.

    Bandwidth: two reference operations are timed in the same interleaved reps over
    float32 buffers of the same total size as the client models (n x model bytes): a
    plain copy `dst.copy_(src)` (torch, same intra-op threads), reported as bytes copied
    / time (each byte read once and written once), and a read-only pass `src.sum()`.
    Our effective bandwidth is update bytes read (n x model bytes) / our time.

    Memory: peak extra resident memory beyond the replies, per method, each in a fresh
    subprocess: the child builds the same replies, runs the method once (warm-up:
    imports, thread pools, caches), frees the result, runs `gc.collect()` and glibc
    `malloc_trim(0)` (freed heap pages go back to the kernel and must be touched again
    to count), reads VmRSS as the baseline, resets the kernel's peak-RSS counter (`echo
    5 > /proc/self/clear_refs`), runs the method again and reads VmHWM. Extra = VmHWM -
    baseline with the method's result still alive. This counts everything the process
    touches (NumPy, torch, Python objects, BLAS workspaces), unlike tracemalloc, which
    sees no torch memory. Each child runs twice:
      * 4 KiB pages (the figure the goal is judged on): NUMPY_MADVISE_HUGEPAGE=0. NumPy
        otherwise madvises its large allocations for transparent huge pages; building
        the replies does that to heap regions that torch later reuses, so RSS then grows
        in 2 MiB steps and the same code measures a few MB more or less from run to run.
      * default settings (transparent huge pages as NumPy asks), printed alongside.
    Where clear_refs is not writable, a 1 ms RSS sampler thread stands in (it can miss
    short spikes; the output says which was used).

    Correctness: ours vs Flower's FedAvg output per array (within 1e-6 absolute;
    Flower returns int64 buffers as float64 averages, ours rounds them back to int64:
    compared after rounding), and for Krum / Multi-Krum the selected nodes (Flower's
    from `select_multikrum`) and the averaged models.

    Device: `--device` (default cpu) is where ours aggregate (auto, cpu, cuda, cuda:N);
    Flower's built-ins always run on the CPU. On CUDA each of our runs is bracketed by
    `torch.cuda.synchronize()` (so the clock sees the finished work), its peak device
    memory is `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, and
    its result is checked against the same method on the CPU (FedAvg within 1e-6, the
    same Krum / Multi-Krum picks). The memory children aggregate on the same device.

    Busy machine: `--load N` runs N background processes that train a small conv layer
    with torch (default intra-op threads, like simulated ClientApps sharing the CPU)
    while timing. "other processes used X% of the CPU" is printed in every run, from
    /proc/stat minus this process's own CPU time, so a noisy run shows itself.

Goals (from the issue): FedAvg >= 3x faster than Flower's, with effective bandwidth
>= 40% of the copy bandwidth; Krum >= 5x faster than Flower's MultiKrum; extra
memory beyond the received updates <= two model copies plus one block
(`strategies.robust_ops.DEFAULT_BLOCK_BYTES`).

Run from the repository root:
    python bench/aggregation_speed.py [--clients 20] [--reps 7] [--json out.json]
    python bench/aggregation_speed.py --only fedavg,krum --load 1 --threads 1 --no-memory
    python bench/aggregation_speed.py --device cuda --no-memory
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from machine import cpu_model  # bench/machine.py (bench/ is on sys.path when run as a script)

# Make `import app` / `import strategies` work as `python bench/aggregation_speed.py`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, Message  # noqa: E402
from flwr.serverapp.strategy import MultiKrum as FlowerMultiKrum  # noqa: E402
from flwr.serverapp.strategy.multikrum import select_multikrum  # noqa: E402
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords  # noqa: E402

from app.config.schema import ModelConfig  # noqa: E402
from app.simulation.local_grid import act_as_server  # noqa: E402
from app.simulation.messages import make_reply  # noqa: E402
from app.task.data import DataSpec  # noqa: E402
from app.task.models import build_model  # noqa: E402
from app.task.training import resolve_device  # noqa: E402
from strategies.fedavg import FedAvg, RoundReport  # noqa: E402
from strategies.krum import KrumRule, MultiKrumRule  # noqa: E402
from strategies.replies import specs_of  # noqa: E402
from strategies.robust import RobustStrategy
from strategies.robust_ops import DEFAULT_BLOCK_BYTES  # noqa: E402
from strategies.tensor_ops import record_to_tensors  # noqa: E402

# Replies are built outside a Flower runtime: Message() needs a task identity.
act_as_server()

NUM_BYZANTINE = 2
MULTI_M = 4
GOAL_FEDAVG_SPEEDUP = 3.0
GOAL_FEDAVG_BW_FRACTION = 0.40
GOAL_KRUM_SPEEDUP = 5.0
FEDAVG_ATOL = 1e-6
CPU = torch.device("cpu")

PAIRS = {  # short name -> (label, ours, Flower's, speed-up goal)
    "fedavg": ("FedAvg", "ours_fedavg", "flower_fedavg", GOAL_FEDAVG_SPEEDUP),
    "krum": (f"Krum (f={NUM_BYZANTINE})", "ours_krum", "flower_krum", GOAL_KRUM_SPEEDUP),
    "multikrum": (
        f"Multi-Krum (f={NUM_BYZANTINE}, m={MULTI_M})",
        "ours_multikrum",
        "flower_multikrum",
        GOAL_KRUM_SPEEDUP,
    ),
}
METHODS = tuple(name for _, ours_name, flower_name, _ in PAIRS.values() for name in (ours_name, flower_name))

# A background "client": trains a conv layer forever with torch's default threads.
LOAD_CODE = (
    "import torch\n"
    "x = torch.randn(64, 3, 32, 32)\n"
    "conv = torch.nn.Conv2d(3, 64, 3)\n"
    "while True:\n"
    "    conv(x).square().mean().backward()\n"
)


# --------------------------------------------------------------------------- replies


def model_layout() -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    state = build_model(ModelConfig(name="resnet18", width=64), DataSpec((3, 32, 32), 10)).state_dict()
    return {k: (tuple(t.shape), t.numpy().dtype) for k, t in state.items()}


def build_replies(n: int, seed: int = 0) -> tuple[ArrayRecord, list[Message], dict[str, Any]]:
    """The global model's ArrayRecord and n client replies (deterministic for a seed)."""
    layout = model_layout()
    rng = np.random.default_rng(seed)
    glob: dict[str, np.ndarray] = {}
    for key, (shape, dtype) in layout.items():
        if np.issubdtype(dtype, np.floating):
            glob[key] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)).astype(dtype)
        else:
            glob[key] = np.full(shape, 1000, dtype=dtype)
    honest_scales = 1e-3 * (1.0 + np.arange(n - NUM_BYZANTINE) / max(n - NUM_BYZANTINE - 1, 1))
    scales = np.concatenate([honest_scales, np.full(NUM_BYZANTINE, 1e-2)])
    scales = scales[rng.permutation(n)]
    # Equal counts: our Multi-Krum averages with equal weights (counts are claims), Flower's
    # weighs by them, so only equal counts make the two comparable. FedAvg's weighting is
    # checked against Flower's with unequal counts in tests/test_aggregation.py.
    weights = np.full(n, 500)
    replies = []
    for i in range(n):
        arrays = {}
        for key, g in glob.items():
            if np.issubdtype(g.dtype, np.floating):
                upd = rng.standard_normal(g.shape, dtype=np.float32)
                upd *= np.float32(scales[i])
                upd += g
                arrays[key] = upd
            else:
                arrays[key] = np.asarray(g + 50, dtype=g.dtype)
        replies.append(make_reply(i + 1, arrays, {"num-examples": int(weights[i]), "train_loss": 1.0 / (i + 1)}))
        del arrays
    model_bytes = sum(v.nbytes for v in glob.values())
    meta = {
        "model_bytes": model_bytes,
        "model_values": sum(v.size for v in glob.values()),
        "num_arrays": len(glob),
        "update_scales": scales.tolist(),
        "weights": weights.tolist(),
    }
    return ArrayRecord({k: Array(v) for k, v in glob.items()}), replies, meta


# --------------------------------------------------------------------------- methods


def quiet_logs() -> None:
    for name in ("flwr", "flwr.fedgpu"):
        logging.getLogger(name).setLevel(logging.WARNING)


def ours(strategy: FedAvg, global_record: ArrayRecord) -> Callable[[list[Message]], ArrayRecord | None]:
    specs, global_views = specs_of(global_record), record_to_tensors(global_record)

    def run(replies: list[Message]) -> ArrayRecord | None:
        # What configure_train records for the round (without a Grid to sample from).
        strategy._specs, strategy._global = specs, global_views
        strategy.train_report = RoundReport(sampled=len(replies))
        arrays, _metrics = strategy.aggregate_train(1, replies)
        return arrays

    return run


def flower_fedavg(replies: list[Message]) -> ArrayRecord:
    return aggregate_arrayrecords([r.content for r in replies], "num-examples")


def flower_multikrum(m: int) -> Callable[[list[Message]], ArrayRecord | None]:
    strategy = FlowerMultiKrum(num_malicious_nodes=NUM_BYZANTINE, num_nodes_to_select=m)

    def run(replies: list[Message]) -> ArrayRecord | None:
        arrays, _metrics = strategy.aggregate_train(1, replies)
        return arrays

    return run


def on_device(fn: Callable, device: torch.device, peaks: list[int]) -> Callable[[list[Message]], Any]:
    """`fn` with the device synchronised before and after (the caller's clock sees the
    finished work); appends its peak device memory beyond what was allocated before."""

    def run(replies: list[Message]) -> Any:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn(replies)
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - before)
        return out

    return run


def make_methods(
    global_record: ArrayRecord,
    names: tuple[str, ...] = METHODS,
    device: torch.device = CPU,
    peaks: dict[str, list[int]] | None = None,
) -> dict[str, tuple[Callable, Any]]:
    """name -> (callable on replies, our strategy object or None). Ours aggregate on
    `device`; on CUDA they are synchronised and their peak memory goes to `peaks`."""
    fedavg = FedAvg(device=device)
    krum = RobustStrategy(rule=KrumRule(num_byzantine=NUM_BYZANTINE, device=device), device=device)
    multikrum = RobustStrategy(
        rule=MultiKrumRule(num_byzantine=NUM_BYZANTINE, num_selected=MULTI_M, device=device), device=device
    )
    methods = {
        "ours_fedavg": (ours(fedavg, global_record), fedavg),
        "flower_fedavg": (flower_fedavg, None),
        "ours_krum": (ours(krum, global_record), krum),
        "flower_krum": (flower_multikrum(1), None),
        "ours_multikrum": (ours(multikrum, global_record), multikrum),
        "flower_multikrum": (flower_multikrum(MULTI_M), None),
    }
    if device.type == "cuda":
        peaks = {} if peaks is None else peaks
        for name, (fn, strategy) in methods.items():
            if strategy is not None:
                methods[name] = (on_device(fn, device, peaks.setdefault(name, [])), strategy)
    return {name: methods[name] for name in names}


# --------------------------------------------------------------------------- timing


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far, from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle, sum(fields[:8])


def time_methods(
    methods: dict[str, tuple[Callable, Any]], replies: list[Message], reps: int, copy_bytes: int
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]], dict[str, Any], float]:
    """Per method: wall times and median user/sys CPU seconds; the warm-up results; and
    the share of the machine's CPU time that other processes used while we timed.

    Two reference operations are timed in every rep alongside the methods, over float32
    buffers of `copy_bytes` each: "copy" (`dst.copy_(src)`) and "read" (`src.sum()`).
    """
    src = torch.empty(copy_bytes // 4, dtype=torch.float32)
    src.normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page before timing
    ops: dict[str, Callable[[], Any]] = {name: (lambda fn=fn: fn(replies)) for name, (fn, _) in methods.items()}
    ops["copy"] = lambda: dst.copy_(src)
    ops["read"] = lambda: src.sum()
    times: dict[str, list[float]] = {name: [] for name in ops}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in ops}
    results: dict[str, Any] = {}
    for name, op in ops.items():  # warm-up; keep one result of each method for the checks
        results[name] = op()
    tick = os.sysconf("SC_CLK_TCK")
    busy0, total0 = machine_busy_ticks()
    own0 = os.times()
    for rep in range(reps):
        order = list(ops) if rep % 2 == 0 else list(reversed(ops))
        for name in order:
            gc.collect()
            c0 = os.times()
            t0 = time.perf_counter()
            out = ops[name]()
            times[name].append(time.perf_counter() - t0)
            c1 = os.times()
            cpu[name].append((c1.user - c0.user, c1.system - c0.system))
            del out
    busy1, total1 = machine_busy_ticks()
    own1 = os.times()
    own_ticks = (own1.user + own1.system - own0.user - own0.system) * tick
    others = max(0.0, (busy1 - busy0) - own_ticks) / max(total1 - total0, 1)
    cpu_med = {
        name: {"user_s": statistics.median(u for u, _ in c), "sys_s": statistics.median(s for _, s in c)}
        for name, c in cpu.items()
    }
    return times, cpu_med, {k: v for k, v in results.items() if k in methods}, others


class BackgroundLoad:
    """`count` background processes training with torch (stopped on exit)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> BackgroundLoad:
        self.procs = [subprocess.Popen([sys.executable, "-c", LOAD_CODE]) for _ in range(self.count)]
        if self.procs:
            time.sleep(3.0)  # let them import torch and start training
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait()


# --------------------------------------------------------------------------- memory


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_child(method: str, clients: int, device: torch.device = CPU) -> None:
    """Runs in a fresh process: print {"extra_bytes": ..., "how": ...} for one method."""
    quiet_logs()
    global_record, replies, _ = build_replies(clients)
    fn, _ = make_methods(global_record, (method,), device)[method]
    out = fn(replies)  # warm-up
    del out
    _trim()
    base = _status_kb("VmRSS") * 1024
    file_before = _status_kb("RssFile") * 1024
    try:
        Path("/proc/self/clear_refs").write_text("5")
        sampler = None
        how = "VmHWM after clear_refs"
    except OSError:
        how = "1 ms RSS sampler"
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _status_kb("VmRSS") * 1024)
                time.sleep(0.001)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
    out = fn(replies)
    if sampler is None:
        top = _status_kb("VmHWM") * 1024
    else:
        stop.set()
        sampler.join()
        top = max(peak[0], _status_kb("VmRSS") * 1024)
    # Under memory pressure the kernel may drop file-backed pages (shared libraries) from
    # RSS mid-run, which would hide part of the peak: such a figure is flagged.
    file_dropped = file_before - _status_kb("RssFile") * 1024
    result = {"extra_bytes": top - base, "baseline_rss_bytes": base, "how": how, "file_pages_dropped": file_dropped}
    print(json.dumps(result))
    del out


def measure_memory(
    methods: tuple[str, ...], clients: int, threads: int, device: torch.device = CPU
) -> dict[str, dict[str, Any]]:
    """Per method: {"4k": child result, "thp": child result} (see the module docstring)."""
    out: dict[str, dict[str, Any]] = {}
    for method in methods:
        out[method] = {}
        for mode, env in (("4k", {"NUMPY_MADVISE_HUGEPAGE": "0"}), ("thp", {})):
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--memory-child",
                    method,
                    "--clients",
                    str(clients),
                    "--threads",
                    str(threads),
                    *(["--device", str(device)] if device != CPU else []),
                ],
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, **env},
            )
            if proc.returncode != 0:
                raise RuntimeError(f"memory child {method} ({mode}) failed:\n{proc.stderr[-3000:]}")
            out[method][mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# --------------------------------------------------------------------------- checks


def _max_abs_diff(ours_rec: ArrayRecord, flower_rec: ArrayRecord) -> tuple[float, set[str]]:
    """Largest |ours - Flower| over all arrays (integer arrays: Flower's floats rounded)."""
    worst, notes = 0.0, set()
    for key in ours_rec.keys():
        a, b = ours_rec[key].numpy(), flower_rec[key].numpy()
        if a.dtype != b.dtype:
            notes.add(f"{a.dtype} (ours) vs {b.dtype} (Flower)")
        if np.issubdtype(a.dtype, np.integer):
            b = np.rint(b)
        worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0)))
    return worst, notes


def check_results(
    results: dict[str, Any], methods: dict[str, tuple[Callable, Any]], replies: list[Message], pairs: list[str]
) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    if "fedavg" in pairs:
        ours_rec, flower_rec = results["ours_fedavg"], results["flower_fedavg"]
        same_keys = list(ours_rec.keys()) == list(flower_rec.keys())
        worst, notes = _max_abs_diff(ours_rec, flower_rec)
        checks["fedavg"] = {
            "max_abs_diff": worst,
            "same_keys": same_keys,
            "dtype_differences": sorted(notes),
            "ok": same_keys and worst <= FEDAVG_ATOL,
        }
    contents = [r.content for r in replies]
    node_of = {id(c): r.metadata.src_node_id for c, r in zip(contents, replies, strict=True)}
    for label, m in (("krum", 1), ("multikrum", MULTI_M)):
        if label not in pairs:
            continue
        flower_nodes = [node_of[id(c)] for c in select_multikrum(contents, NUM_BYZANTINE, m)]
        ours_nodes = list(methods[f"ours_{label}"][1].train_report.accepted)
        worst, _ = _max_abs_diff(results[f"ours_{label}"], results[f"flower_{label}"])
        same = sorted(ours_nodes) == sorted(flower_nodes)
        checks[label] = {
            "ours_selected": ours_nodes,
            "flower_selected": flower_nodes,
            "same_selection": same,
            "max_abs_diff": worst,
            "ok": same and worst <= FEDAVG_ATOL,
        }
    return checks


def check_device(
    results: dict[str, Any],
    methods: dict[str, tuple[Callable, Any]],
    global_record: ArrayRecord,
    replies: list[Message],
    pairs: list[str],
) -> dict[str, Any]:
    """Ours on the device vs ours on the CPU: FedAvg within FEDAVG_ATOL, the same picks."""
    checks: dict[str, Any] = {}
    names = tuple(PAIRS[p][1] for p in pairs)
    on_cpu = make_methods(global_record, names, CPU)
    for p, name in zip(pairs, names, strict=True):
        fn, strategy = on_cpu[name]
        worst, _ = _max_abs_diff(results[name], fn(replies))
        row: dict[str, Any] = {"max_abs_diff": worst, "ok": worst <= FEDAVG_ATOL}
        if p != "fedavg":
            row["device_selected"] = list(methods[name][1].train_report.accepted)
            row["cpu_selected"] = list(strategy.train_report.accepted)
            row["ok"] = row["ok"] and sorted(row["device_selected"]) == sorted(row["cpu_selected"])
        checks[p] = row
    return checks


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=20, help="number of client replies (default 20)")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per method (default 7)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="also write every number to this JSON file")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-method memory subprocesses")
    parser.add_argument(
        "--only", default=",".join(PAIRS), help=f"comma-separated comparisons to run (default {','.join(PAIRS)})"
    )
    parser.add_argument(
        "--load", type=int, default=0, help="background torch-training processes while timing (default 0)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where ours aggregate: auto, cpu, cuda or cuda:N (default cpu; Flower's built-ins stay on the CPU)",
    )
    parser.add_argument("--memory-child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    pairs = [p.strip() for p in args.only.split(",") if p.strip()]
    if not pairs or any(p not in PAIRS for p in pairs):
        parser.error(f"--only takes a comma-separated subset of {','.join(PAIRS)}")
    if args.clients < max(2 * NUM_BYZANTINE + 3, NUM_BYZANTINE + MULTI_M):
        parser.error(f"--clients must be >= {max(2 * NUM_BYZANTINE + 3, NUM_BYZANTINE + MULTI_M)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.memory_child:
        memory_child(args.memory_child, args.clients, device)
        return
    threads = torch.get_num_threads()
    quiet_logs()
    names = tuple(name for p in pairs for name in PAIRS[p][1:3])

    t0 = time.perf_counter()
    global_record, replies, meta = build_replies(args.clients)
    model_bytes = meta["model_bytes"]
    update_bytes = args.clients * model_bytes
    print(
        f"{args.clients} replies x {meta['num_arrays']} arrays, {meta['model_values'] / 1e6:.2f} M values "
        f"= {model_bytes / 1e6:.1f} MB per model ({update_bytes / 1e6:.0f} MB in all), "
        f"built in {time.perf_counter() - t0:.1f} s"
    )
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__}, {threads} intra-op threads; "
        f"numpy {np.__version__}; Python {platform.python_version()}"
        + (f"; {args.load} background torch-training processes while timing" if args.load else "")
    )
    if device != CPU:
        gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
        print(f"ours aggregate on {device}{gpu}; Flower's built-ins on the CPU")

    peaks: dict[str, list[int]] = {}
    methods = make_methods(global_record, names, device, peaks)
    with BackgroundLoad(args.load):
        times, cpu_times, results, others_share = time_methods(methods, replies, args.reps, update_bytes)
    checks = check_results(results, methods, replies, pairs)
    device_checks = check_device(results, methods, global_record, replies, pairs) if device != CPU else None
    del results
    memory = None if args.no_memory else measure_memory(names, args.clients, threads, device)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    bw = {
        "bytes": update_bytes,
        "copy_GBps": update_bytes / med["copy"] / 1e9,
        "read_GBps": update_bytes / med["read"] / 1e9,
    }
    print(f"\ntimes: median of {args.reps} after one warm-up (min..max); CPU seconds of this process (median)")
    for name in (*names, "copy", "read"):
        c = cpu_times[name]
        print(
            f"  {name:17s} {med[name] * 1e3:9.1f} ms   ({min(times[name]) * 1e3:.1f}..{max(times[name]) * 1e3:.1f})"
            f"   user {c['user_s']:.2f}, sys {c['sys_s']:.2f}"
        )
    expected = args.load / max(os.cpu_count() or 1, 1)
    note = ""
    if others_share > expected + 0.10:
        note = "  <- unexpected load: ratios less trustworthy, rerun on a quiet machine"
    print(f"  other processes used {others_share:.0%} of the machine's CPU time while we timed{note}")
    print(
        f"\nbandwidth over {update_bytes / 1e6:.0f} MB: copy {bw['copy_GBps']:.2f} GB/s (dst.copy_(src), "
        f"bytes copied / time), read-only {bw['read_GBps']:.2f} GB/s (src.sum())"
    )

    block = DEFAULT_BLOCK_BYTES
    mem_budget = 2 * model_bytes + block
    summary: dict[str, Any] = {}
    print("\nours vs Flower (Flower time / our time; effective bandwidth = update bytes / time)")
    for p in pairs:
        label, mine, theirs, goal = PAIRS[p]
        speedup = med[theirs] / med[mine]
        eff = update_bytes / med[mine] / 1e9
        row = {
            "ours_s": med[mine],
            "flower_s": med[theirs],
            "speedup": speedup,
            "speedup_goal": goal,
            "speedup_ok": speedup >= goal,
            "ours_effective_GBps": eff,
            "ours_effective_over_copy": eff / bw["copy_GBps"],
            "flower_effective_GBps": update_bytes / med[theirs] / 1e9,
        }
        line = (
            f"  {label:22s} {speedup:6.2f}x (goal >= {goal:g}x: {'met' if speedup >= goal else 'MISSED'}); "
            f"ours {eff:5.2f} GB/s = {eff / bw['copy_GBps']:.0%} of copy"
        )
        if mine == "ours_fedavg":
            ok = eff / bw["copy_GBps"] >= GOAL_FEDAVG_BW_FRACTION
            row["bandwidth_ok"] = ok
            line += f" (goal >= {GOAL_FEDAVG_BW_FRACTION:.0%}: {'met' if ok else 'MISSED'})"
        print(line + f"; Flower {row['flower_effective_GBps']:5.2f} GB/s")
        summary[p] = row

    if memory is not None:
        how = memory[names[0]]["4k"]["how"]
        print(
            f"\npeak extra resident memory beyond the replies ({how}, fresh process per method);\n"
            f"goal <= 2 models + 1 block = {mem_budget / 1e6:.1f} MB, judged at 4 KiB pages"
        )
        print(f"  {'':17s} {'4 KiB pages':>24s}   {'default (THP)':>24s}")
        for name in names:
            exact, thp = memory[name]["4k"]["extra_bytes"], memory[name]["thp"]["extra_bytes"]
            verdict = ""
            if name.startswith("ours"):
                ok = exact <= mem_budget
                memory[name]["ok"] = ok
                verdict = f"  goal: {'met' if ok else 'MISSED'}"
            dropped = max(memory[name][mode]["file_pages_dropped"] for mode in ("4k", "thp"))
            if dropped > 1 << 20:
                verdict += f"  (unreliable: {dropped / 1e6:.0f} MB of file pages reclaimed mid-run; rerun)"
            print(
                f"  {name:17s} {exact / 1e6:8.1f} MB = {exact / model_bytes:5.2f} models"
                f"   {thp / 1e6:8.1f} MB = {thp / model_bytes:5.2f} models{verdict}"
            )

    if peaks:
        print(f"\npeak {device} memory per run (max_memory_allocated beyond what was allocated before; max of runs)")
        for name, values in peaks.items():
            print(f"  {name:17s} {max(values) / 1e6:8.1f} MB = {max(values) / model_bytes:5.2f} models")

    print("\nresults: ours vs Flower")
    if "fedavg" in checks:
        c = checks["fedavg"]
        print(
            f"  FedAvg: max |ours - Flower| = {c['max_abs_diff']:.2e} (tolerance {FEDAVG_ATOL:g}): "
            f"{'equal' if c['ok'] else 'DIFFERENT'}"
            + (
                f"; dtypes differ: {', '.join(c['dtype_differences'])} (Flower averages int buffers into floats; "
                "compared after rounding)"
                if c["dtype_differences"]
                else ""
            )
        )
    for label in ("krum", "multikrum"):
        if label in checks:
            c = checks[label]
            print(
                f"  {PAIRS[label][0]}: ours selected {sorted(c['ours_selected'])}, Flower "
                f"{sorted(c['flower_selected'])} ({'same' if c['same_selection'] else 'DIFFERENT'}); "
                f"averaged model max |diff| = {c['max_abs_diff']:.2e}: {'equal' if c['ok'] else 'DIFFERENT'}"
            )

    if device_checks is not None:
        print(f"\nresults: ours on {device} vs ours on the CPU")
        for p, c in device_checks.items():
            picks = (
                f"; selected {sorted(c['device_selected'])} vs {sorted(c['cpu_selected'])}"
                if "cpu_selected" in c
                else ""
            )
            print(
                f"  {PAIRS[p][0]}: max |{device} - cpu| = {c['max_abs_diff']:.2e}{picks}: "
                f"{'equal' if c['ok'] else 'DIFFERENT'}"
            )

    if args.json:
        payload = {
            "clients": args.clients,
            "reps": args.reps,
            "load": args.load,
            "machine": {
                "cpu": cpu_model(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "threads": threads,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
            "model": {k: v for k, v in meta.items() if k in ("model_bytes", "model_values", "num_arrays")},
            "block_bytes": block,
            "times_s": times,
            "median_s": med,
            "cpu_s": cpu_times,
            "other_processes_cpu_share": others_share,
            "bandwidth": bw,
            "comparison": summary,
            "memory": memory,
            "memory_budget_bytes": mem_budget,
            "checks": checks,
        }
        if device != CPU:
            payload |= {"device": str(device), "device_peak_bytes": peaks, "device_checks": device_checks}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

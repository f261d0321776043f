"""The ClientApp: trains and evaluates the global model on this node's data.

Everything it needs arrives in the message: the global model's arrays and a
ConfigRecord with the dataset, partition, model and train settings plus the data
spec (`data.*`). Simulation nodes find their partition through `partition-id` /
`num-partitions` in their node config; deployed SuperNodes point `data-path` at
their own .npz file or save_to_disk directory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from app.protocol import (
    AMP_SKIPPED_STEPS,
    ARRAYS,
    BASE_DIGEST,
    BATCH_SIZE,
    CONFIG,
    DATA_PATH,
    DEVICE_S,
    DITTO_LAMBDA,
    DOWNLINK,
    ENCODE_S,
    EVAL_LOSS,
    EVAL_PREFIX,
    FROZEN,
    GPU_UTIL_MEAN_PCT,
    LEDGER_ON,
    METRICS,
    MICRO_BATCH_SIZE,
    NAME,
    NODE,
    NUM_EXAMPLES,
    NUM_PARTITIONS,
    OOM_RETRIES,
    PARTITION_ID,
    PEAK_GPU_MEM_MB,
    PROXIMAL_MU,
    RECEIPT_HASH,
    RECEIPT_REPLY,
    RECEIPT_STEP,
    REGION_SUPERLINK,
    ROUNDS_KEY,
    SCAFFOLD_C,
    SCAFFOLD_DELTA,
    SECAGG,
    SERVER_ROUND,
    STATE_DIR,
    STEPS,
    TASK,
    TRAIN_METRICS,
    WALL_TIME_S,
    WORK,
    WORK_KEY,
    WORK_KEY_ENV,
    WORK_NONCE,
    WORK_RUN,
    ClientSettings,
)
from app.simulation.attacks import MODEL_POISONING, flip_labels, is_malicious, poison, reported_examples
from app.status.node import watched
from app.task.batch_size import resolve_batch_size
from app.task.data import (
    DatasetUnavailableError,
    DataSpec,
    Examples,
    check_spec,
    load_local_data,
    load_splits,
    materialize,
    partition_indices,
    partition_key,
    spec_from_record,
    split_validation,
)
from app.task.distributed import Work, local_devices, train_on_devices
from app.task.ditto import PERSONAL, keep_personal, personal_file, personal_model, personal_state, train_personal
from app.task.gpu_memory import MemoryCap, cap_memory, memory_share, release
from app.task.kept import save_kept
from app.task.metrics import Task
from app.task.models import build_model, freeze, trainable_keys
from app.task.scaffold import corrections, keep, new_variate, node_variate, variate_file
from app.task.telemetry import GpuTelemetry, log_hidden_gpus_once
from app.task.training import (
    Precision,
    Steps,
    evaluate,
    prepare_model,
    resolve_device,
    resolve_precision,
    round_lr,
    train,
    with_layout,
)
from strategies.replies import arrays_digest  # the ledger's reply hash: the node computes it too

log = logging.getLogger("flwr.fedgpu." + __name__)

app = ClientApp()
SCALER_STATE = "amp-grad-scaler"  # ConfigRecord in context.state: the fp16 GradScaler's state between rounds


@lru_cache(maxsize=8)
def _node_data(settings: ClientSettings, node_key: tuple[str, int, int], spec: DataSpec) -> tuple[Examples, Examples]:
    data_path, partition_id, num_partitions = node_key
    if data_path:
        data = materialize(
            load_local_data(settings.dataset, data_path, settings.seed, settings.model, settings.task.type)
        )
        where = f"data-path={data_path}"
    else:
        train_source, _ = load_splits(settings.dataset, settings.seed, settings.model, settings.task.type)
        key = partition_key(train_source, settings.partition)
        idx = partition_indices(key, num_partitions, partition_id, settings.partition, settings.seed)
        data = materialize(train_source, idx)
        where = f"partition {partition_id}/{num_partitions} of dataset={settings.dataset.name}"
    check_spec(data, spec, where)
    return split_validation(data, settings.dataset.val_fraction, settings.seed + partition_id)


def node_data(context: Context, settings: ClientSettings, spec: DataSpec) -> tuple[Examples, Examples]:
    """(train, validation) data of this node, cached for the life of the process."""
    cfg = context.node_config
    data_path = str(cfg.get(DATA_PATH, "") or "")
    if not data_path and (PARTITION_ID not in cfg or NUM_PARTITIONS not in cfg):
        raise ValueError("node config needs partition-id and num-partitions (simulation) or data-path (deployment)")
    node_key = (data_path, int(cfg.get(PARTITION_ID, 0)), int(cfg.get(NUM_PARTITIONS, 1)))
    try:
        return _node_data(settings, node_key, spec)
    except DatasetUnavailableError as err:  # the server sees it as this node's error reply
        raise DatasetUnavailableError(f"node {context.node_id}: {err}") from None


def client_seed(seed: int, server_round: int, partition_id: int, task: int = 0) -> int:
    """Per node and round, reproducible: same seed, round and partition give the same shuffle.

    Asynchronous strategies number their tasks (`task`): a node that trains twice on
    one model version must not repeat the same batches.
    """
    entropy = [seed, server_round, partition_id] + ([task] if task else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


@dataclass
class Job:
    """What both handlers need: settings, precision, this node's data and the global model."""

    record: dict
    settings: ClientSettings
    spec: DataSpec
    precision: Precision
    train_data: Examples
    val_data: Examples
    model: torch.nn.Module
    task: Task  # the loss and the metrics
    received: dict[str, torch.Tensor]  # the global model's trainable tensors, as received
    sent_keys: list[str]  # the tensors the server aggregates (model.trainable): the only ones a reply carries
    cap: MemoryCap | None  # this client's share of a shared GPU (app/task/gpu_memory.py)
    local_dp: bool  # privacy=local: DP-SGD, its own model variant, no exact statistics (decided once, here)


def prepare_job(msg: Message, context: Context) -> Job:
    record = dict(msg.content[CONFIG])
    settings, spec = ClientSettings.from_record(record), spec_from_record(record)
    device = resolve_device(settings.train.device)
    if device.type == "cpu" and settings.train.device == "auto":
        log_hidden_gpus_once()
    cap = cap_memory(device, memory_share(settings.train.gpu_memory_fraction))  # before anything is allocated
    train_data, val_data = node_data(context, settings, spec)
    model = build_model(settings.model, spec)
    freeze(model, settings.model.trainable)  # before Opacus's fix, as on the server
    if settings.train.gradient_checkpointing:
        from app.task.checkpointing import enable_checkpointing

        log.debug("gradient checkpointing: %s", enable_checkpointing(model))
    local_dp = settings.privacy.name == "local"
    if local_dp:
        from app.privacy.dp_sgd import make_private_compatible  # imported here: Opacus adds ~1.4 s to a process start

        model = make_private_compatible(model)  # the server's global model went through it too
    frozen = own_base(model, record, settings) if BASE_DIGEST in record else {}
    if FROZEN in msg.content:
        frozen = msg.content[FROZEN].to_torch_state_dict()
    arrays = received_model(msg, context, {k: v for k, v in model.state_dict().items() if k not in frozen}, settings)
    model.load_state_dict({**frozen, **arrays})  # strict: together they are the whole model
    images = len(spec.input_shape) == 3
    precision = with_layout(resolve_precision(settings.train.amp, device), model, settings.train.channels_last, images)
    task = Task.from_config(settings.task, spec)
    model = prepare_model(model, precision)
    return Job(
        record, settings, spec, precision, train_data, val_data, model, task, arrays, list(arrays), cap, local_dp
    )


def own_base(model: torch.nn.Module, record: dict, settings: ClientSettings) -> dict[str, torch.Tensor]:
    """The frozen base of a model every node builds itself (model=hf): never sent, so this node's
    own, checked against the server's digest before it is trained on."""
    from app.task.hf import check_base  # transformers' side: only for model=hf

    trained = set(trainable_keys(model, settings.model.trainable))
    base = {k: v for k, v in model.state_dict().items() if k not in trained}
    check_base(base, str(record[BASE_DIGEST]), settings.model)
    return base


def received_model(
    msg: Message, context: Context, like: dict[str, torch.Tensor], settings: ClientSettings
) -> dict[str, torch.Tensor]:
    """The global model's trainable tensors as the task carries them: as they are, or encoded
    (`compression.downlink`; `like` gives names, shapes and dtypes, the node's state a delta's base)."""
    if DOWNLINK not in msg.content[CONFIG]:
        return msg.content[ARRAYS].to_torch_state_dict()
    from app.compression.downlink import receive  # imported here: most runs send the model as it is

    return receive(msg.content[ARRAYS], msg.content[CONFIG], context.state, like, settings.compression)


def released(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """Empty PyTorch's GPU cache once a task is over (its tensors are gone with the handler's
    frame), so the memory goes back to the other clients sharing the GPU (Flower #1942)."""

    @functools.wraps(handler)
    def run(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        finally:
            release()

    return run


def node_batch_size(job: Job, context: Context, data: Examples) -> int:
    """train.batch_size, with `auto` resolved for this node's GPU (probed once, kept in its state)."""
    cfg = job.settings.train
    return resolve_batch_size(
        context.state,
        lambda c: Steps(job.model, c, job.precision, torch.Generator(), job.task),
        cfg,
        job.settings.model,
        data,
        job.cap,
    )


def partition_of(context: Context) -> int | None:
    """This node's partition id in simulation; None for a deployed node with its own data."""
    cfg = context.node_config
    return None if cfg.get(DATA_PATH) or PARTITION_ID not in cfg else int(cfg[PARTITION_ID])


def about_node(context: Context) -> dict[str, ConfigRecord]:
    """The reply's record of this node's `name` (its node config's, e.g. a site's), for the server's
    logs: none without one. The server escapes and cuts it and shows it beside the node id."""
    name = context.node_config.get(NAME)
    return {NODE: ConfigRecord({NAME: str(name)})} if name not in (None, "") else {}


def load_scaler_state(state: RecordDict) -> dict[str, float | int] | None:
    """This node's fp16 GradScaler state from its previous round, if any."""
    return dict(state[SCALER_STATE]) if SCALER_STATE in state else None


def save_scaler_state(state: RecordDict, scaler_state: dict[str, float | int]) -> None:
    if scaler_state:
        state[SCALER_STATE] = ConfigRecord(scaler_state)


def state_dir_of(context: Context) -> str:
    """This node's `state-dir` (node config): where it keeps what must outlive a restart; "" without one."""
    return str(context.node_config.get(STATE_DIR, "") or "")


def reply_arrays(
    job: Job, state: dict[str, torch.Tensor], context: Context, seed: int, metrics: dict[str, Any]
) -> ArrayRecord:
    """The trained tensors, or with compression their encoded update (after any attack and local-DP
    noise: compression is post-processing) on the training device, error feedback kept in the
    node's state; the encoding time goes into `metrics` (ENCODE_S)."""
    cfg = job.settings.compression
    if cfg.name == "none" and cfg.downlink == "none":
        return ArrayRecord(state)  # with a downlink the update is sent (exactly): the server adds it to its fp32 model
    from app.compression.packing import pack, residual_file  # imported here: most runs send the model as it is

    started = time.perf_counter()
    device = job.precision.device
    on_device = {k: v.to(device) for k, v in state.items()}
    state_dir = state_dir_of(context)
    saved = residual_file(state_dir, context.run_id) if state_dir else None
    arrays = pack(on_device, job.received, cfg, context.state, torch.Generator(device).manual_seed(seed), saved)
    metrics[ENCODE_S] = time.perf_counter() - started
    return arrays


RECEIPTS = "ledger-receipts"  # ConfigRecord in context.state: ledger step -> the entry hash first received for it
RECEIPT_CONFLICTS = "ledger-receipt-conflicts"  # step -> the other entry hashes received for it (never overwritten)
RECEIPT_MISMATCHES = "ledger-receipt-mismatches"  # step -> a recorded reply hash that is none of this node's replies
SENT = "ledger-replies"  # ConfigRecord in context.state: "sha256" -> this node's last SENT_KEPT reply hashes
SENT_KEPT = 64


def receipts_file(context: Context) -> Path | None:
    """`state-dir/ledger-receipts-run<run id>.jsonl`, where a site keeps its receipts and the
    hashes of its replies (`python -m app.ledger receipts RUN_DIR --check FILE` reads it)."""
    state_dir = state_dir_of(context)
    return Path(state_dir) / f"ledger-receipts-run{context.run_id}.jsonl" if state_dir else None


def _keep_line(context: Context, line: dict[str, Any]) -> None:
    if (path := receipts_file(context)) is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")


def _state_record(context: Context, key: str) -> dict[str, Any]:
    """A copy of the ConfigRecord `key` in the node's state ({} when it has none yet)."""
    return dict(context.state[key]) if key in context.state else {}


def sent_hashes(context: Context) -> list[str]:
    """This node's recent reply hashes, newest last."""
    return list(context.state[SENT]["sha256"]) if SENT in context.state else []


def remember_reply(digest: str, record: dict, context: Context) -> None:
    """With the ledger on, keep `digest`, the hash of the reply's arrays as they go on the wire (the
    server ledger's `reply_sha256`), in the node's state and `state-dir`, for the receipt to come."""
    if not record.get(LEDGER_ON):
        return
    context.state[SENT] = ConfigRecord({"sha256": [*sent_hashes(context), digest][-SENT_KEPT:]})
    _keep_line(context, {"node_id": context.node_id, "sent_sha256": digest, "round": int(record.get(SERVER_ROUND, 0))})


def keep_receipt(record: dict, context: Context) -> None:
    """Keep the receipt a task carries (the ledger entry that recorded this node's last reply, and
    that reply's hash as recorded) in the node's state and, with a `state-dir`, in
    `ledger-receipts-run<id>.jsonl` there, so the site can later show what the server acknowledged
    (docs/ledger.md#receipts). Checked against what the node holds: a recorded reply hash that is
    none of its own replies, or a second entry hash for a step it already has a receipt for, is
    logged and kept next to the first, never in its place."""
    if RECEIPT_HASH not in record:
        return
    step, digest = int(record[RECEIPT_STEP]), str(record[RECEIPT_HASH])
    reply = str(record.get(RECEIPT_REPLY, ""))
    held = _state_record(context, RECEIPTS)
    line: dict[str, Any] = {"node_id": context.node_id, "step": step, "hash": digest, "reply_sha256": reply}
    if held.get(str(step)) == digest:
        return
    if str(step) in held:
        conflicts = _state_record(context, RECEIPT_CONFLICTS)
        others = list(conflicts.get(str(step), []))
        if digest in others:
            return
        conflicts[str(step)] = [*others, digest]
        context.state[RECEIPT_CONFLICTS] = ConfigRecord(conflicts)
        line["conflict"] = True
        log.warning(
            "ledger receipt: step %d was acknowledged as entry %s before, now as %s: the server's ledger changed "
            "after it acknowledged this node's reply (both kept)",
            step,
            held[str(step)][:12],
            digest[:12],
        )
    else:
        held[str(step)] = digest
        context.state[RECEIPTS] = ConfigRecord(held)
    own = sent_hashes(context)
    if reply and own and reply not in own:
        mismatches = _state_record(context, RECEIPT_MISMATCHES)
        mismatches[str(step)] = reply
        context.state[RECEIPT_MISMATCHES] = ConfigRecord(mismatches)
        line["mismatch"] = True
        log.warning(
            "ledger receipt: entry %s (step %d) records reply %s, which is none of this node's last %d replies: "
            "the server recorded something this node did not send",
            digest[:12],
            step,
            reply[:12],
            len(own),
        )
    _keep_line(context, line)


Scaffold = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor], Path | None]


def ditto_file(context: Context) -> Path | None:
    """Where this node keeps Ditto's personal model, with a state-dir."""
    state_dir = state_dir_of(context)
    return personal_file(state_dir, context.run_id) if state_dir else None


def scaffold_start(msg: Message, context: Context, job: Job) -> Scaffold | None:
    """A SCAFFOLD task (it carries the server's c): (c, this node's c_i, the correction c - c_i of
    each trainable parameter, the file c_i is kept in with a state-dir); None for any other task."""
    if SCAFFOLD_C not in msg.content:
        return None
    server_c = msg.content[SCAFFOLD_C].to_torch_state_dict()
    state_dir = state_dir_of(context)
    saved = variate_file(state_dir, context.run_id) if state_dir else None
    variate = node_variate(context.state, saved, server_c)
    return server_c, variate, corrections(job.model, server_c, variate, job.precision.device), saved


def scaffold_finish(
    scaffold: Scaffold, job: Job, trained: dict[str, torch.Tensor], steps: int, lr: float, context: Context
) -> dict[str, torch.Tensor]:
    """After training: c_i+ kept (state, and the file), and the reply's arrays of c_i+ - c_i."""
    server_c, variate, correction, saved = scaffold
    new, delta = new_variate(variate, server_c, job.received, trained, set(correction), steps, lr)
    keep(context.state, new)
    if saved is not None:
        save_kept(saved, new)
    return {SCAFFOLD_DELTA + k: d.detach().cpu().contiguous() for k, d in delta.items()}


def trained(msg: Message, context: Context) -> tuple[Job, dict[str, torch.Tensor], dict[str, Any], int]:
    """Train on a task: the job, the tensors the server aggregates (after any simulated attack),
    the reply's metrics and the task's seed."""
    job = prepare_job(msg, context)
    keep_receipt(job.record, context)
    settings, attack = job.settings, job.settings.attack
    partition = partition_of(context)
    seed = client_seed(
        settings.seed, int(job.record.get(SERVER_ROUND, 0)), partition or 0, int(job.record.get(TASK, 0))
    )
    torch.manual_seed(seed)
    malicious = is_malicious(attack, settings.seed, partition, int(context.node_config.get(NUM_PARTITIONS, 1)))
    train_data = job.train_data
    if malicious and attack.name == "label_flip":
        train_data = Examples(train_data.x, flip_labels(train_data.y, job.spec.num_classes))
    global_state = {k: v.detach().cpu().clone() for k, v in job.model.state_dict().items()} if malicious else {}
    rounds = int(job.record.get(ROUNDS_KEY, 0))
    lr = round_lr(settings.train, int(job.record.get(SERVER_ROUND, 0)), rounds)
    cfg = replace(settings.train, batch_size=node_batch_size(job, context, train_data), lr=lr)
    mu = float(job.record.get(PROXIMAL_MU, 0.0))  # FedProx (strategy.proximal_mu; refused with local DP)
    scaffold = scaffold_start(msg, context, job)  # strategy=scaffold: (c, c_i, the correction, its file)
    correction = scaffold[2] if scaffold else None
    cpu_started = time.process_time()
    with GpuTelemetry(job.precision.device, settings.train.telemetry_interval_s) as telemetry:
        if job.local_dp:
            from app.privacy.accounting import history_key
            from app.privacy.dp_sgd import train_private

            stats, dp_metrics = train_private(
                job.model,
                train_data,
                cfg,
                settings.privacy,
                job.precision,
                context.state,
                job.record,
                keys=(history_key(partition, context.node_id), history_key(None, context.node_id)),
                task=job.task,
            )
        else:
            scaler_state = load_scaler_state(context.state)
            devices = local_devices(cfg.local_devices, job.precision.device)
            if len(devices) > 1:
                work = Work(
                    settings.model, job.spec, settings.task, cfg, job.precision, seed, scaler_state, mu, correction
                )
                stats = train_on_devices(job.model, train_data, work, devices)
            else:
                stats = train(
                    job.model,
                    train_data,
                    cfg,
                    job.precision,
                    seed,
                    scaler_state,
                    job.task,
                    proximal_mu=mu,
                    correction=correction,
                )
            dp_metrics = {}
            save_scaler_state(context.state, stats.scaler_state)
    metrics: dict[str, float | int | list[float] | list[int]] = {
        NUM_EXAMPLES: reported_examples(attack, stats.num_examples) if malicious else stats.num_examples,
        WALL_TIME_S: stats.wall_time_s,
        STEPS: stats.steps,
        **telemetry.metrics(),
        **dp_metrics,
    }
    util = metrics.get(GPU_UTIL_MEAN_PCT)
    busy = stats.wall_time_s * float(util) / 100 if isinstance(util, float) else time.process_time() - cpu_started
    metrics[DEVICE_S] = busy
    if not job.local_dp or settings.privacy.report_exact:
        # Local DP: exact statistics of the private batches, which no epsilon covers (docs/privacy.md).
        metrics |= dict(zip(TRAIN_METRICS, (stats.loss, stats.accuracy, stats.samples_per_s), strict=True))
    if stats.peak_gpu_mem_mb is not None:
        metrics[PEAK_GPU_MEM_MB] = stats.peak_gpu_mem_mb
    metrics |= {BATCH_SIZE: cfg.batch_size, OOM_RETRIES: stats.oom_retries}
    if stats.oom_retries:
        metrics[MICRO_BATCH_SIZE] = stats.micro_batch_size
    if job.cap is not None:
        metrics |= job.cap.metrics()
    if job.precision.amp == "fp16":
        metrics[AMP_SKIPPED_STEPS] = stats.skipped_steps
    if partition is not None:
        metrics[PARTITION_ID] = partition
    trained = job.model.state_dict()
    state = {k: trained[k].detach().cpu().contiguous() for k in job.sent_keys}  # frozen tensors stay here
    if scaffold is not None:
        # SGD with momentum b moves about lr / (1 - b) per unit gradient: the variate's step size
        state |= scaffold_finish(scaffold, job, trained, stats.steps, cfg.lr / (1 - cfg.momentum), context)
    if (lam := float(job.record.get(DITTO_LAMBDA, 0.0))) > 0:  # Ditto: this node's personal model too
        saved = ditto_file(context)
        personal = personal_state(context.state, saved, job.received)
        personal, _ = train_personal(
            job.model, personal, job.received, train_data, cfg, job.precision, seed, job.task, lam
        )
        keep_personal(context.state, saved, personal)
    if malicious and attack.name in MODEL_POISONING:
        state = {k: v.contiguous() for k, v in poison(state, global_state, attack, seed).items()}
    return job, state, metrics, seed


@app.train()
@watched("train")
@released
def train_handler(msg: Message, context: Context) -> Message:
    if REGION_SUPERLINK in context.node_config:  # a regional aggregator: its region's sub-run trains
        from app.regions.aggregator import region_update  # imported here: most nodes are sites

        record = dict(msg.content[CONFIG])
        keep_receipt(record, context)
        arrays, metrics = region_update(msg, context)
    else:
        job, state, metrics, seed = trained(msg, context)
        record, arrays = job.record, reply_arrays(job, state, context, seed, metrics)
    key = work_key_path(context)
    digest = arrays_digest(arrays) if record.get(LEDGER_ON) or key else ""  # hashed once, used by both
    remember_reply(digest, record, context)
    content = RecordDict(
        {
            ARRAYS: arrays,
            METRICS: MetricRecord(metrics),
            **about_node(context),
            **work_record(record, context, key, digest, metrics),
        }
    )
    return Message(content=content, reply_to=msg)


def work_key_path(context: Context) -> str | None:
    """This node's work key: node config `work-key`, else (simulation, where node config is Flower's)
    the FEDGPU_WORK_KEY environment variable; `{partition-id}` in it becomes the node's partition."""
    path = str(context.node_config.get(WORK_KEY, "") or os.environ.get(WORK_KEY_ENV, ""))
    if not path:
        return None
    return path.replace("{partition-id}", str(context.node_config.get(PARTITION_ID, "")))


def work_record(
    record: dict, context: Context, path: str | None, digest: str, metrics: dict[str, Any]
) -> dict[str, ConfigRecord]:
    """With a work key at `path`, the reply's signed record of its work (app/ledger/work.py): the
    task's run and nonce, this node, the reply's counts and seconds and its arrays' sha256 `digest`."""
    if path is None or REGION_SUPERLINK in context.node_config:
        return {}
    from app.ledger.work import load_private_key, sign_work  # imported here: most nodes sign nothing

    claims = {
        "run": str(record.get(WORK_RUN, "")),
        "nonce": str(record.get(WORK_NONCE, "")),
        "step": int(record.get(SERVER_ROUND, 0)),
        "task": int(record.get(TASK, 0)),
        "node": int(context.node_id),
        "examples": float(metrics.get(NUM_EXAMPLES, 0)),
        "steps": int(metrics.get(STEPS, 0)),
        "wall_s": float(metrics.get(WALL_TIME_S, 0.0)),
        "device_s": float(metrics.get(DEVICE_S, 0.0)),
        "arrays_sha256": digest,
    }
    return {WORK: ConfigRecord(sign_work(load_private_key(path), claims))}


# secagg=plus (app/secagg/node.py): the four stages of SecAgg+, the third one training.


@app.query("secagg_keys")
def secagg_keys_handler(msg: Message, context: Context) -> Message:
    from app.secagg.node import advertise

    reply = advertise(msg.content[SECAGG], context, msg.metadata.dst_node_id)
    return Message(content=RecordDict({SECAGG: reply}), reply_to=msg)


@app.query("secagg_shares")
def secagg_shares_handler(msg: Message, context: Context) -> Message:
    from app.secagg.node import share

    return Message(content=RecordDict({SECAGG: share(msg.content[SECAGG], context)}), reply_to=msg)


@app.train("secagg")
@watched("train")
@released
def secagg_train_handler(msg: Message, context: Context) -> Message:
    """Train, then send only the masked ring vector and the complaints about shares that did not
    open (its shares are checked before training)."""
    from flwr.app import Array

    from app.protocol import SECAGG_CLEAR, SECAGG_MASKED, SECAGG_MODULUS
    from app.secagg.encode import node_vector
    from app.secagg.node import complaints, mask, receive_shares

    record = msg.content[SECAGG]
    state = receive_shares(record, context)
    job, tensors, metrics, seed = trained(msg, context)
    loss, accuracy = float(metrics.get(TRAIN_METRICS[0], 0.0)), float(metrics.get(TRAIN_METRICS[1], 0.0))
    generator = torch.Generator().manual_seed(seed)
    vector = node_vector(tensors, job.received, int(metrics[NUM_EXAMPLES]), loss, accuracy, record, generator)
    masked = mask(state, vector, int(record[SECAGG_MODULUS]), context)
    clear = {k: v for k, v in metrics.items() if k in SECAGG_CLEAR}  # no figure that gives the count
    content = RecordDict(
        {
            ARRAYS: ArrayRecord({SECAGG_MASKED: Array(masked)}),
            METRICS: MetricRecord(clear),
            SECAGG: complaints(state),  # the neighbours whose shares did not open here, with proofs
            **about_node(context),
        }
    )
    return Message(content=content, reply_to=msg)


@app.query("secagg_unmask")
def secagg_unmask_handler(msg: Message, context: Context) -> Message:
    from app.secagg.node import reveal

    return Message(content=RecordDict({SECAGG: reveal(msg.content[SECAGG], context)}), reply_to=msg)


@app.evaluate()
@watched("evaluate")
@released
def evaluate_handler(msg: Message, context: Context) -> Message:
    job = prepare_job(msg, context)
    loss, values = evaluate(job.model, job.val_data, job.precision, job.task)
    metrics = {NUM_EXAMPLES: len(job.val_data), EVAL_LOSS: loss, **{EVAL_PREFIX + k: v for k, v in values.items()}}
    if float(job.record.get(DITTO_LAMBDA, 0.0)) > 0:  # Ditto: the personal model on the same split
        twin = personal_model(job.model, personal_state(context.state, ditto_file(context), job.received))
        loss, values = evaluate(twin, job.val_data, job.precision, job.task)
        metrics |= {EVAL_PREFIX + PERSONAL + k: v for k, v in {"loss": loss, **values}.items()}
    if (partition := partition_of(context)) is not None:
        metrics[PARTITION_ID] = partition  # the server caps num-examples at its partition's validation size
    return Message(content=RecordDict({METRICS: MetricRecord(metrics), **about_node(context)}), reply_to=msg)


@app.query()
def query_handler(msg: Message, context: Context) -> Message:
    """Which partition this node simulates (the server's fleet profiles are per partition:
    app/simulation/virtual_clock.py); a deployed node answers without one."""
    partition = partition_of(context)
    metrics = {PARTITION_ID: partition} if partition is not None else {}
    return Message(content=RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)

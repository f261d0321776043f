"""Every metric key a ClientApp reply carries is declared in app/protocol.py (issue 34): the real
train, evaluate and query handlers run in process on the digits task, plain, with local DP, with a
compressed uplink, and with every optional branch forced (GPU share, telemetry, OOM retries, fp16).
That app/protocol.py stays free of torch and Hydra is tests/test_packaging.py's stdlib-only check."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

import app.client_app as client_module
from app import protocol
from app.client_app import app as client_app
from app.config.compose import load_config
from app.config.schema import Config
from app.privacy.dp_sgd import make_private_compatible
from app.protocol import METRICS, SERVER_ROUND, is_reply_metric, to_client_record
from app.task.data import DataSpec, spec_to_record
from app.task.gpu_memory import MemoryCap
from app.task.models import build_model
from app.task.telemetry import GpuTelemetry
from app.task.training import train as real_train
from tests.helpers import context_for

DIGITS = DataSpec((1, 8, 8), 10)
FAST = "train.epochs=1 seed=3 "


def _ask(cfg: Config, message_type: str, context: Context | None = None) -> MetricRecord:
    """The MetricRecord of the real ClientApp's reply to one task on the server's initial model."""
    torch.manual_seed(0)
    model = build_model(cfg.model, DIGITS)
    if cfg.privacy.name == "local":
        model = make_private_compatible(model)  # the server's global model goes through it too
    record = {**to_client_record(cfg), **spec_to_record(DIGITS), SERVER_ROUND: 1, protocol.ROUNDS_KEY: 2}
    ins = Message(
        RecordDict({protocol.ARRAYS: ArrayRecord(model.state_dict()), protocol.CONFIG: ConfigRecord(record)}),
        dst_node_id=1000,
        message_type=message_type,
    )
    ins.metadata.__dict__["_message_id"] = message_type
    reply = client_app(ins, context or context_for(0, 3))
    assert not reply.has_error(), reply.error
    assert list(reply.content.metric_records) == [METRICS]
    return reply.content[METRICS]


def _undeclared(metrics: MetricRecord) -> list[str]:
    return sorted(k for k in metrics if not is_reply_metric(k))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ("", {protocol.TRAIN_LOSS, protocol.WALL_TIME_S, protocol.GPU_TELEMETRY, protocol.PARTITION_ID}),
        ("privacy=local privacy.noise_multiplier=1.1", {protocol.DP_EPSILON, *protocol.HISTORY_METRICS}),
        ("privacy=local privacy.noise_multiplier=1.1 privacy.report_exact=true", {protocol.TRAIN_ACCURACY}),
        ("compression=int8", {protocol.ENCODE_S}),
    ],
    ids=["plain", "local-dp", "local-dp-exact", "compression"],
)
def test_every_train_reply_metric_is_declared_in_the_protocol(overrides, expected):
    cfg, _ = load_config(FAST + overrides)
    metrics = _ask(cfg, "train")
    assert expected <= set(metrics), sorted(metrics)  # the case took the branch it is about
    assert not _undeclared(metrics), f"reply metrics not declared in app/protocol.py: {_undeclared(metrics)}"


def test_every_optional_train_metric_is_declared_too(monkeypatch):
    """The branches a CPU never takes, forced: a GPU share, NVML telemetry with every quantity,
    out-of-memory retries, a peak allocation and fp16's skipped steps."""

    class Telemetry(GpuTelemetry):
        def __enter__(self) -> GpuTelemetry:
            self.available = True
            for samples in vars(self.samples).values():
                samples.append(1.0)
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    def prepare(msg: Message, context: Context) -> client_module.Job:
        job = prepare_job(msg, context)
        job.precision = replace(job.precision, amp="fp16")  # what the reply reports, not what trains
        return job

    def train(model, data, cfg, precision, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        stats = real_train(model, data, cfg, replace(precision, amp="off"), *args, **kwargs)
        return replace(stats, peak_gpu_mem_mb=12.5, oom_retries=1, micro_batch_size=8, skipped_steps=1)

    prepare_job = client_module.prepare_job
    monkeypatch.setattr(client_module, "prepare_job", prepare)
    monkeypatch.setattr(client_module, "cap_memory", lambda device, share: MemoryCap(0.5, 2**30))
    monkeypatch.setattr(client_module, "GpuTelemetry", Telemetry)
    monkeypatch.setattr(client_module, "train", train)
    cfg, _ = load_config(FAST + "compression=topk compression.ratio=0.1")
    metrics = _ask(cfg, "train")
    forced = {
        protocol.GPU_MEM_SHARE,
        protocol.GPU_MEM_CAP_MB,
        *protocol.GPU_DEVICE_METRICS,
        protocol.PEAK_GPU_MEM_MB,
        protocol.MICRO_BATCH_SIZE,
        protocol.AMP_SKIPPED_STEPS,
        protocol.ENCODE_S,
    }
    assert forced <= set(metrics), sorted(forced - set(metrics))
    assert not _undeclared(metrics), f"reply metrics not declared in app/protocol.py: {_undeclared(metrics)}"


def test_every_evaluate_and_query_reply_metric_is_declared_in_the_protocol():
    cfg, _ = load_config(FAST + "task.metrics=[accuracy,f1_macro]")
    metrics = _ask(cfg, "evaluate")
    assert {protocol.EVAL_LOSS, "eval-accuracy", "eval-f1_macro", protocol.NUM_EXAMPLES} <= set(metrics)
    assert not _undeclared(metrics), f"reply metrics not declared in app/protocol.py: {_undeclared(metrics)}"
    assert not _undeclared(_ask(cfg, "query"))


def test_the_declarations_are_consistent_and_catch_an_undeclared_key():
    assert all(k.startswith(protocol.GPU_DEVICE_PREFIX) for k in protocol.GPU_DEVICE_METRICS)
    assert set(protocol.TRAIN_METRICS) | set(protocol.HISTORY_METRICS) <= protocol.REPLY_METRICS
    assert not is_reply_metric("brand-new-key") and not is_reply_metric(protocol.EVAL_PREFIX)
    assert is_reply_metric("eval-auroc") and is_reply_metric(protocol.NUM_EXAMPLES)
    assert _undeclared(MetricRecord({protocol.STEPS: 1, "brand-new-key": 2.0})) == ["brand-new-key"]

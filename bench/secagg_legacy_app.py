"""What `bench/secagg.py` runs under `flwr run` as its `flower` variant: Flower 1.42's own SecAgg+
(the legacy workflow, its only server side) on our learning task, so that our SecAgg+
(`secagg=plus`) has a baseline doing the same work.

- `legacy_server`: `DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))` driven with a
  `LegacyContext` around Flower's legacy `flwr.server.strategy.FedAvg`, the shape of Flower's
  `examples/flower-secure-aggregation`. It composes our Hydra config from the run config's
  `overrides` (as app/server_app.py does), builds the same data, test split and initial model
  (`app.run.factory.global_model`, same seed), evaluates the global model centrally after every
  round with our `app.task.training.evaluate`, and writes one JSON line per round to
  `<output-dir>/<name>/metrics.jsonl` (`round`, the task's metrics, `loss`, `round_time_s`,
  `bytes_down_total`, `bytes_up_total`, ...), then `summary.json`. The grid's push and pull are
  wrapped (`count_messages`) so that every message of all four SecAgg+ stages is counted.
- `counted_server`: our own ServerApp (`app.server_app`) with the same counting, so that the
  `fedavg` and `secagg` variants' bytes are measured the same way as Flower's
  (`bench-wire-bytes.json` in the run's directory).
- `legacy_client`: `ClientApp(client_fn, mods=[secaggplus_mod])`, `client_fn` returning a
  `NumPyClient` whose `fit` is our ClientApp's training path (`app.client_app.prepare_job`:
  the node's partition, the model, AMP; `app.task.training.train`; the same per-round seed and
  learning rate), so the work per client equals our `train_handler`'s.
- `resnet18_sized_mlp`: the benchmark's second model, a wide MLP with as many parameters as
  ResNet-18 (11.17 M) that is cheap to train, so the masking and crypto cost dominates.

SecAgg+ settings come from the run config (keys the harness adds to the copied app's
pyproject.toml; Flower's defaults when absent): `secagg-num-shares`,
`secagg-reconstruction-threshold`, `secagg-clipping-range`, `secagg-quantization-range`,
`secagg-modulus-range`, `secagg-max-weight` (0 = automatic: the most training examples a node
holds, the largest weight any reply carries, as `max_weight=0` means in our `secagg=plus`),
`secagg-timeout` (0 = none).

Bytes are counted as our `strategies.replies.payload_bytes` counts them (the array bytes of a
message), extended to what SecAgg+ carries in ConfigRecords: every `bytes` value (public keys,
encrypted shares, the masked vectors, which Flower sends as lists of .npy bytes) and every
numeric list (8 bytes an entry: node id lists). Scalars and strings (the settings, the stage
names) are not counted, as ours does not count its settings record.

Imported by every ClientApp of the benchmark's runs (for `resnet18_sized_mlp`): torch and Flower's
client side at the top, the server's modules inside `legacy_main`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.serverapp import Grid, ServerApp
from torch import nn

from bench.flwr_runs import two_layer_mlp

KEYS = "bench.array-keys"  # fit config: JSON list of the model's tensor names, in the order of the parameters
LISTS = "bench.json-keys"  # fit config: JSON list of the keys whose list values travel as JSON text

# Run config keys and Flower's defaults (SecAggPlusWorkflow's signature).
RUN_CONFIG_DEFAULTS: dict[str, int | float] = {
    "secagg-num-shares": 3,
    "secagg-reconstruction-threshold": 2,
    "secagg-clipping-range": 8.0,
    "secagg-quantization-range": 4194304,
    "secagg-modulus-range": 4294967296,
    "secagg-max-weight": 1000.0,
    "secagg-timeout": 0.0,
}


def resnet18_sized_mlp(
    input_shape: tuple[int, ...], num_classes: int, hidden: int = 4096, hidden2: int = 1938
) -> nn.Module:
    """in -> 4096 -> 1938 -> classes: 11.17 M parameters on 28x28 inputs (ResNet-18 for CIFAR-10:
    11.17 M)."""
    return two_layer_mlp(input_shape, num_classes, hidden, hidden2)


# ----------------------------------------------------------------------------- bytes


def content_bytes(content: RecordDict) -> int:
    """The payload of a message: its arrays' bytes plus every `bytes` value and numeric list
    entry (8 bytes each) in its ConfigRecords (see the module docstring)."""
    total = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            total += sum(len(a.data) for a in record.values())
        elif isinstance(record, ConfigRecord):
            for value in record.values():
                if isinstance(value, bytes):
                    total += len(value)
                elif isinstance(value, list):
                    total += sum(len(v) if isinstance(v, bytes) else 8 if not isinstance(v, str) else 0 for v in value)
    return total


class MessageCounter:
    """Payload bytes and message counts of everything a grid pushes and pulls, by the messages'
    `group_id` (the round, in our strategies, in our SecAgg+ and in Flower's workflow: a reply
    carries its message's), so every stage of a round is counted."""

    FIELDS = ("bytes_down_total", "bytes_up_total", "messages_down", "messages_up", "reply_errors")

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, int]] = {}

    def _group(self, message: Message) -> dict[str, int]:
        return self.groups.setdefault(str(message.metadata.group_id), dict.fromkeys(self.FIELDS, 0))

    def pushed(self, messages: list[Message]) -> None:
        for m in messages:
            g = self._group(m)
            g["bytes_down_total"] += content_bytes(m.content)
            g["messages_down"] += 1

    def pulled(self, replies: list[Message]) -> None:
        for r in replies:
            g = self._group(r)
            g["messages_up"] += 1
            if r.has_error():
                g["reply_errors"] += 1
            else:
                g["bytes_up_total"] += content_bytes(r.content)

    def of(self, group: int | str) -> dict[str, int]:
        return dict(self.groups.get(str(group), dict.fromkeys(self.FIELDS, 0)))


def count_messages(grid: Grid) -> MessageCounter:
    """Count what `grid` pushes and pulls from now on. The grid itself is kept (its class too: our
    ServerApp tells simulated nodes by it) and only its `push_messages` / `pull_messages` are
    wrapped on the instance, which its own `send_and_receive` calls as well."""
    counter = MessageCounter()
    push, pull = grid.push_messages, grid.pull_messages

    def push_messages(messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        counter.pushed(messages)
        return push(messages)

    def pull_messages(message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(pull(message_ids))
        counter.pulled(replies)
        return replies

    grid.push_messages = push_messages  # type: ignore[method-assign]
    grid.pull_messages = pull_messages  # type: ignore[method-assign]
    return counter


WIRE_FILE = "bench-wire-bytes.json"  # in a run's directory: {round: MessageCounter fields}


# ----------------------------------------------------------------------------- our ServerApp, counted

counted_server = ServerApp()


@counted_server.main()
def counted_main(grid: Grid, context: Context) -> None:
    """Our ServerApp (`app.server_app`) as it is, with every message counted by round; the counts go
    to `<output-dir>/<name>/bench-wire-bytes.json` (our own rows count the training messages'
    arrays only)."""
    from app.config.compose import load_config
    from app.run.results import output_root
    from app.server_app import main

    counter = count_messages(grid)
    try:
        main(grid, context)
    finally:
        cfg, _ = load_config(str(context.run_config.get("overrides", "")))
        run_dir = output_root(str(context.run_config.get("output-dir", ""))) / str(cfg.name)
        if cfg.name is not None and run_dir.is_dir():
            (run_dir / WIRE_FILE).write_text(json.dumps(counter.groups, indent=1) + "\n")


# ----------------------------------------------------------------------------- ClientApp


class LegacyClient(NumPyClient):
    """Our ClientApp's training path behind Flower's NumPyClient interface (no local DP, no
    compression, no attack: the benchmark's runs use none)."""

    def __init__(self, context: Context) -> None:
        self.node_context = context

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        from dataclasses import replace

        from app.client_app import (
            client_seed,
            load_scaler_state,
            node_batch_size,
            partition_of,
            prepare_job,
            save_scaler_state,
        )
        from app.protocol import ARRAYS, CONFIG, ROUNDS_KEY, SERVER_ROUND
        from app.task.gpu_memory import release
        from app.task.training import round_lr, train

        context = self.node_context
        lists = set(json.loads(str(config.get(LISTS, "[]"))))
        record = {k: json.loads(str(v)) if k in lists else v for k, v in config.items() if k not in (KEYS, LISTS)}
        keys = json.loads(str(config[KEYS]))
        tensors = {k: torch.from_numpy(np.asarray(a)) for k, a in zip(keys, parameters, strict=True)}
        # Flower's SecAgg+ hands back the aggregate in float64: our model's dtype, as our nodes receive it.
        tensors = {k: t.float() if t.is_floating_point() else t for k, t in tensors.items()}
        message = SimpleNamespace(
            content=RecordDict({CONFIG: ConfigRecord(record), ARRAYS: ArrayRecord(torch_state_dict=tensors)})
        )
        try:
            job = prepare_job(message, context)  # type: ignore[arg-type]  # it reads only .content
            settings = job.settings
            rnd = int(record.get(SERVER_ROUND, 0))
            seed = client_seed(settings.seed, rnd, partition_of(context) or 0)
            torch.manual_seed(seed)
            lr = round_lr(settings.train, rnd, int(record.get(ROUNDS_KEY, 0)))
            cfg = replace(settings.train, batch_size=node_batch_size(job, context, job.train_data), lr=lr)
            stats = train(
                job.model, job.train_data, cfg, job.precision, seed, load_scaler_state(context.state), job.task
            )
            save_scaler_state(context.state, stats.scaler_state)
            trained = job.model.state_dict()
            out = [trained[k].detach().cpu().float().numpy() for k in job.sent_keys]
            return out, stats.num_examples, {"loss": stats.loss, "accuracy": stats.accuracy}
        finally:
            release()


def client_fn(context: Context) -> Any:  # noqa: ANN401
    return LegacyClient(context).to_client()


legacy_client = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])


# ----------------------------------------------------------------------------- ServerApp

legacy_server = ServerApp()


def secagg_settings(run_config: dict[str, Any]) -> dict[str, Any]:
    """SecAggPlusWorkflow's keyword arguments from the run config (Flower's defaults when absent)."""
    get = lambda key: run_config.get(key, RUN_CONFIG_DEFAULTS[key])  # noqa: E731
    timeout = float(get("secagg-timeout"))
    return {
        "num_shares": int(get("secagg-num-shares")),
        "reconstruction_threshold": int(get("secagg-reconstruction-threshold")),
        "clipping_range": float(get("secagg-clipping-range")),
        "quantization_range": int(get("secagg-quantization-range")),
        "modulus_range": int(get("secagg-modulus-range")),
        "max_weight": float(get("secagg-max-weight")),
        "timeout": timeout if timeout > 0 else None,
    }


@legacy_server.main()
def legacy_main(grid: Grid, context: Context) -> None:
    """Flower's SecAgg+ over `federation.rounds` rounds of our task, one row per round."""
    import logging
    import random

    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    from app.config.compose import load_config
    from app.config.schema import ConfigError
    from app.protocol import ROUNDS_KEY, SERVER_ROUND, to_client_record
    from app.run.factory import global_model
    from app.run.results import new_run_dir, output_root
    from app.task.data import (
        data_spec,
        load_splits,
        materialize,
        partition_indices,
        partition_key,
        spec_to_record,
        validation_size,
    )
    from app.task.metrics import Task
    from app.task.models import trainable_keys
    from app.task.training import evaluate, model_inputs, resolve_device, resolve_precision

    log = logging.getLogger("flwr.fedgpu.bench.secagg_legacy")
    cfg, _ = load_config(str(context.run_config.get("overrides", "")))
    root = output_root(str(context.run_config.get("output-dir", "")))
    settings = secagg_settings(dict(context.run_config))
    f = cfg.federation
    if cfg.model.trainable or cfg.privacy.name != "none" or cfg.compression.name != "none":
        raise ConfigError("bench.secagg_legacy_app: whole-model training only, privacy=none, compression=none")

    device = resolve_device(cfg.server_device)
    precision = resolve_precision("off", device)
    train_source, test_source = load_splits(cfg.dataset, cfg.seed, cfg.model, cfg.task.type)
    spec = data_spec(train_source, test_source, cfg.task.type == "causal_lm")
    test_data = materialize(test_source)
    task = Task.from_config(cfg.task, spec)
    torch.manual_seed(cfg.seed)  # as app/run/assemble.py: the same initial model as our runs
    random.seed(cfg.seed)
    module = global_model(cfg, spec, model_inputs(test_data.x[:2], precision)).to(device)
    if settings["max_weight"] <= 0:  # automatic: the largest training partition of this federation
        deadline = time.monotonic() + f.node_wait_timeout_s
        while len(nodes := list(grid.get_node_ids())) < f.min_available_nodes and time.monotonic() < deadline:
            time.sleep(0.25)
        key = partition_key(train_source, cfg.partition)
        sizes = [len(partition_indices(key, len(nodes), p, cfg.partition, cfg.seed)) for p in range(len(nodes))]
        settings["max_weight"] = float(max(n - validation_size(n, cfg.dataset.val_fraction) for n in sizes))
    keys = trainable_keys(module, [])
    state = module.state_dict()
    initial = [state[k].detach().cpu().numpy() for k in keys]
    client_config: dict[str, Any] = {**to_client_record(cfg), **spec_to_record(spec), ROUNDS_KEY: f.rounds}
    # A legacy fit config holds scalars only (flwr.common.Scalar): lists (the data spec's input shape) as JSON.
    lists = sorted(k for k, v in client_config.items() if isinstance(v, list))
    client_config = {k: json.dumps(v) if k in lists else v for k, v in client_config.items()}
    client_config |= {KEYS: json.dumps(keys), LISTS: json.dumps(lists)}

    run_dir = new_run_dir(root, cfg.name, "secagg-legacy", cfg.dataset.name, reuse=True)
    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.write_text("")
    counter = count_messages(grid)
    started = time.time()
    last: dict[str, Any] = {"t": started, "model": None}
    rows: list[dict[str, Any]] = []

    def evaluate_fn(rnd: int, ndarrays: list[np.ndarray], _config: dict) -> tuple[float, dict[str, float]]:
        module.load_state_dict({k: torch.from_numpy(np.asarray(a)) for k, a in zip(keys, ndarrays, strict=True)})
        loss, values = evaluate(module, test_data, precision, task)
        now = time.time()
        counts = counter.of(rnd)
        arrays = [np.asarray(a) for a in ndarrays]
        updated = last["model"] is None or not all(map(np.array_equal, arrays, last["model"]))
        last["model"] = [a.copy() for a in arrays]
        if rnd > 0:  # round 0: Flower's evaluation of the initial model, before any round
            dtypes = sorted({str(np.asarray(a).dtype) for a in ndarrays})
            row = {
                "round": rnd,
                **values,
                "loss": loss,
                "wall_time_s": now - started,
                "round_time_s": now - last["t"],
                **counts,
                "model_updated": bool(updated),  # False: the SecAgg+ round halted (too few nodes or shares)
                "global_dtypes": dtypes,
            }
            rows.append(row)
            with metrics_path.open("a") as out:
                out.write(json.dumps(row) + "\n")
            log.info(
                "[round %d/%d] %s  loss %.4f  %.1fs  down %d B  up %d B  reply errors %d",
                rnd,
                f.rounds,
                "  ".join(f"{k} {v:.4f}" for k, v in values.items()),
                loss,
                row["round_time_s"],
                counts["bytes_down_total"],
                counts["bytes_up_total"],
                counts["reply_errors"],
            )
        last["t"] = time.time()  # the next round starts after this evaluation
        return loss, dict(values)

    strategy = FedAvg(
        fraction_fit=f.fraction_train,
        fraction_evaluate=0.0,  # central evaluation only, as our default runs
        min_fit_clients=f.min_train_nodes,
        min_available_clients=f.min_available_nodes,
        evaluate_fn=evaluate_fn,
        on_fit_config_fn=lambda rnd: {**client_config, SERVER_ROUND: rnd},
        initial_parameters=ndarrays_to_parameters(initial),
    )
    log.info("Flower SecAgg+ (legacy workflow): %s; results: %s", settings, run_dir)
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=f.rounds), strategy=strategy)
    DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(**settings))(grid, legacy)

    summary = {
        "status": "completed" if len(rows) == f.rounds else "incomplete",
        "rounds": len(rows),
        "secagg": settings,
        "final": rows[-1] if rows else None,
        "wall_time_s": time.time() - started,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if len(rows) != f.rounds:
        raise RuntimeError(f"Flower's SecAgg+ workflow evaluated {len(rows)} of {f.rounds} rounds")

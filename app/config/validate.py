"""Range checks on a typed config, one function per section: bad values fail before any
work starts, all of them in one ConfigError (`Problems`), each on its own line naming the key,
the value and what is allowed."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.config.schema import (
    AGGREGATIONS,
    AMP_MODES,
    ATTACKS,
    AVAILABILITY,
    BUFFER_AGGREGATORS,
    BUILTIN_METRICS,
    CHANNELS_LAST_MODES,
    COMPRESSIONS,
    CONTRIBUTIONS,
    DATASETS,
    DISTRIBUTED_PRIVACY,
    DOWNLINKS,
    FLEET_SPEEDS,
    LEDGERS,
    LM_METRICS,
    LR_SCHEDULES,
    MODELS,
    NORM_BOUND_ACTIONS,
    OPTIMIZERS,
    PARTITIONS,
    PEFT_METHODS,
    PRIVACY,
    REGION_RULES,
    ROBUST_POLICIES,
    ROBUST_RULES,
    ROW_COLUMNS,
    SECAGG_POLICIES,
    SECAGGS,
    STRAGGLERS,
    STRATEGIES,
    TASK_TYPES,
    TOPOLOGIES,
    WAN_CODECS,
    Config,
    ConfigError,
    StrategyConfig,
    metric_name,
)
from strategies.server_opt import SERVER_OPTIMIZERS
from strategies.staleness import STALENESS_FUNCTIONS

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_TARGET_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
# One directory name that stays under its root: not empty, no '/', '\\' or control character
# (NUL included), not '.', '..' or hidden. '=' and ',' stay: a sweep job is named after its overrides.
_DIR_NAME_RE = re.compile(r"[^./\\\x00-\x1f\x7f][^/\\\x00-\x1f\x7f]*")


def problem_block(problems: list[str]) -> str:
    """One problem on the line; several as a list under a count. Every ConfigError that names
    more than one problem reads this way: unknown keys and wrong types (app/config/compose.py),
    and the range checks here."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)


class Problems:
    """The invalid keys of one config, collected so that `validate` names them all in one
    ConfigError (as Opacus's ModuleValidator does) rather than one per try.

    One problem per key: the first check of a key that fails is the one reported, and a key
    that already failed is not checked again (a later check of it assumes the earlier one
    passed). A check whose value needs another key to be valid (a path of the chosen dataset,
    a name made from a metric's target) asks first: `require` and `one_of` return whether the
    key is valid, `ok` whether keys checked before are.
    """

    def __init__(self) -> None:
        self._found: dict[str, str] = {}  # key -> its problem, in the order found

    def require(self, ok: object, key: str, value: Any, allowed: str) -> bool:  # noqa: ANN401
        """Record `key=value is invalid: allowed` unless `ok`; whether `key` is valid so far."""
        if key in self._found:
            return False
        if not ok:
            self._found[key] = f"{key}={value!r} is invalid: {allowed}"
        return bool(ok)

    def one_of(self, key: str, value: Any, options: tuple[str, ...]) -> bool:  # noqa: ANN401
        return self.require(value in options, key, value, "allowed: " + ", ".join(options))

    def ok(self, *keys: str) -> bool:
        """None of `keys` has failed a check so far."""
        return not any(key in self._found for key in keys)

    def __len__(self) -> int:
        return len(self._found)

    def raise_if_any(self) -> None:
        """One ConfigError naming every problem found (each on its own line), if any was."""
        if self._found:
            raise ConfigError(problem_block(list(self._found.values())))


def check_dir_name(key: str, value: str, problems: Problems | None = None) -> bool:
    """A name that becomes a directory under a root (`name`, `sweep.name`) must be one safe
    path component: '../x' or '/abs' would write outside the root. Raises ConfigError at once,
    or, given `problems`, records the problem there; returns whether the name is safe."""
    p = Problems() if problems is None else problems
    ok = p.require(
        isinstance(value, str) and _DIR_NAME_RE.fullmatch(value) is not None,
        key,
        value,
        "must be a single directory name under its root: not empty, no '/', '\\' or control "
        "characters, not starting with '.'",
    )
    if problems is None:
        p.raise_if_any()
    return ok


def validate(cfg: Config) -> Config:
    """Reject values that cannot work, before any training starts: one ConfigError names
    every invalid key (`Problems`), so a user fixes them all in one try."""
    p = Problems()
    s = cfg.strategy
    p.one_of("strategy.name", s.name, STRATEGIES)
    p.require(s.num_byzantine >= 0, "strategy.num_byzantine", s.num_byzantine, "must be >= 0")
    p.require(s.num_selected >= 1, "strategy.num_selected", s.num_selected, "must be >= 1")
    if s.name == "krum":
        p.require(
            s.num_selected == 1,
            "strategy.num_selected",
            s.num_selected,
            "Krum selects 1; use strategy=multikrum for m > 1",
        )
    p.require(
        0.0 <= s.trim_ratio < 0.5,
        "strategy.trim_ratio",
        s.trim_ratio,
        "must be in [0, 0.5): 0.5 or more trims everything",
    )
    p.one_of("strategy.on_too_few", s.on_too_few, ROBUST_POLICIES)
    p.require(
        s.norm_bound == 0 or 1 < s.norm_bound < float("inf"),
        "strategy.norm_bound",
        s.norm_bound,
        "must be a multiple > 1 of the median accepted update norm (at or below 1 it rejects half the honest "
        "updates), or 0 (off)",
    )
    p.one_of("strategy.norm_bound_action", s.norm_bound_action, NORM_BOUND_ACTIONS)
    _validate_fedbuff(p, s)
    _validate_server_optimizer(p, cfg)
    _validate_scaffold(p, cfg)
    _validate_ditto(p, cfg)
    if s.name == "fedbuff":
        p.require(
            cfg.federation.fraction_evaluate == 0,
            "federation.fraction_evaluate",
            cfg.federation.fraction_evaluate,
            "strategy=fedbuff evaluates centrally every federation.eval_every versions; set it to 0",
        )

    c = cfg.compression
    p.one_of("compression.name", c.name, COMPRESSIONS)
    p.require(0 < c.ratio <= 1, "compression.ratio", c.ratio, "must be in (0, 1]: the fraction of entries sent")
    p.one_of("compression.downlink", c.downlink, DOWNLINKS)
    p.require(c.downlink_nodes >= 1, "compression.downlink_nodes", c.downlink_nodes, "must be >= 1")
    if c.downlink == "delta":
        p.require(
            c.name != "none",
            "compression.downlink",
            c.downlink,
            "delta encodes the model's change with compression.name's codec; set compression=int8 (or fp16, "
            "bf16, topk), or use compression.downlink=fp16",
        )

    p.one_of("ledger", cfg.ledger.name, LEDGERS)
    led = cfg.ledger
    if p.one_of("ledger.contribution", led.contribution, CONTRIBUTIONS) and led.contribution != "none":
        p.require(
            led.name == "on", "ledger.contribution", led.contribution, "the scores go into the ledger: set ledger=on"
        )
        p.require(
            cfg.privacy.name not in ("central", "central_adaptive"),
            "ledger.contribution",
            led.contribution,
            "per-node scores from raw updates are outside central DP's epsilon; use privacy=local or none",
        )
        p.one_of("ledger.contribution_value", led.contribution_value, ("loss", "metric"))
        p.require(
            led.shapley_permutations >= 1, "ledger.shapley_permutations", led.shapley_permutations, "must be >= 1"
        )
        p.require(led.shapley_tolerance >= 0, "ledger.shapley_tolerance", led.shapley_tolerance, "must be >= 0")
        p.require(led.validation_examples >= 1, "ledger.validation_examples", led.validation_examples, "must be >= 1")
    if led.work_keys:
        p.require(led.name == "on", "ledger.work_keys", led.work_keys, "the records go into the ledger: set ledger=on")
        p.require(
            cfg.secagg.name == "none",
            "ledger.work_keys",
            led.work_keys,
            "under secagg=plus the server folds masked inputs in SecAgg+'s own stages, which do not check work "
            "records; use secagg=none, or ledger.work_keys=null",
        )
    m = cfg.monitoring
    if (q := m.mqtt).host:
        p.require(1 <= q.port <= 65535, "monitoring.mqtt.port", q.port, "a TCP port")
        p.require(q.qos in (0, 1, 2), "monitoring.mqtt.qos", q.qos, "0, 1 or 2")
        p.require(
            q.queue >= 1, "monitoring.mqtt.queue", q.queue, "must be >= 1 (messages held while the broker is away)"
        )
        p.require(q.flush_s >= 0, "monitoring.mqtt.flush_s", q.flush_s, "must be >= 0")
        p.require(q.close_s >= 0, "monitoring.mqtt.close_s", q.close_s, "must be >= 0")
        p.require(bool(q.cert) == bool(q.key), "monitoring.mqtt.cert", q.cert, "a client certificate needs its key")
        p.require(
            bool(q.topic_prefix) and not set("#+") & set(q.topic_prefix),
            "monitoring.mqtt.topic_prefix",
            q.topic_prefix,
            "a topic without the wildcards # and +",
        )
    p.require(0 <= m.prometheus_port <= 65535, "monitoring.prometheus_port", m.prometheus_port, "0 (off) or a TCP port")
    p.require(m.max_node_labels >= 1, "monitoring.max_node_labels", m.max_node_labels, "must be >= 1")

    _validate_privacy(p, cfg)
    _validate_secagg(p, cfg)

    g = cfg.stragglers
    p.one_of("stragglers.name", g.name, STRAGGLERS)
    p.require(
        all(x >= 1 for x in g.factors), "stragglers.factors", g.factors, "slowdowns must be >= 1 (1 = full speed)"
    )
    if g.name == "fixed":
        p.require(bool(g.factors), "stragglers.factors", g.factors, "stragglers=fixed needs a list, e.g. [5,5,5]")
    p.require(g.sigma >= 0, "stragglers.sigma", g.sigma, "must be >= 0")
    p.require(0 <= g.dropout < 1, "stragglers.dropout", g.dropout, "must be in [0, 1)")
    _validate_fleet(p, cfg)
    _validate_topology(p, cfg)

    a = cfg.attack
    p.one_of("attack.name", a.name, ATTACKS)
    p.require(a.num_malicious >= 0, "attack.num_malicious", a.num_malicious, "must be >= 0")
    p.require(a.scale > 0, "attack.scale", a.scale, "must be > 0")
    p.require(
        0 < a.claimed_examples < float("inf"),
        "attack.claimed_examples",
        a.claimed_examples,
        "must be a finite number > 0 (the server rejects any other count outright)",
    )

    d = cfg.dataset
    p.one_of("dataset.name", d.name, DATASETS)
    if d.name == "npz":
        if p.require(bool(d.path), "dataset.path", d.path, "dataset=npz needs dataset.path=/abs/path/data.npz"):
            p.require(Path(d.path).is_file(), "dataset.path", d.path, "no such .npz file")
    if d.name == "hf_disk":
        if p.require(bool(d.path), "dataset.path", d.path, "dataset=hf_disk needs dataset.path=<save_to_disk dir>"):
            p.require(Path(d.path).is_dir(), "dataset.path", d.path, "no such directory")
    if d.name == "hf":
        p.require(
            bool(d.hf_name), "dataset.hf_name", d.hf_name, "dataset=hf needs dataset.hf_name=<user/name on the Hub>"
        )
    if d.name == "python":
        _require_target(p, "dataset._target_", d.target)
    p.require(0.0 < d.test_fraction < 1.0, "dataset.test_fraction", d.test_fraction, "must be in (0, 1)")
    p.require(0.0 <= d.val_fraction < 1.0, "dataset.val_fraction", d.val_fraction, "must be in [0, 1)")

    part = cfg.partition
    p.one_of("partition.name", part.name, PARTITIONS)
    p.require(part.alpha > 0, "partition.alpha", part.alpha, "must be > 0 (smaller = more label skew)")
    p.require(part.min_partition_size >= 1, "partition.min_partition_size", part.min_partition_size, "must be >= 1")

    _validate_model(p, cfg)

    t = cfg.train
    p.require(t.epochs >= 1, "train.epochs", t.epochs, "must be >= 1")
    p.require(t.grad_accum_steps >= 1, "train.grad_accum_steps", t.grad_accum_steps, "must be >= 1")
    p.require(t.max_steps >= 0, "train.max_steps", t.max_steps, "must be >= 0 (0 = train.epochs passes)")
    p.one_of("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    p.require(t.warmup_rounds >= 0, "train.warmup_rounds", t.warmup_rounds, "must be >= 0")
    p.require(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    if cfg.privacy.name == "local":
        p.require(
            not t.gradient_checkpointing,
            "train.gradient_checkpointing",
            True,
            "not with privacy=local: Opacus's per-example gradient hooks would see every recomputed block twice",
        )
        for key, value, neutral in (("grad_accum_steps", t.grad_accum_steps, 1), ("max_steps", t.max_steps, 0)):
            p.require(
                value == neutral,
                f"train.{key}",
                value,
                "not with privacy=local: DP-SGD's steps are Poisson batches planned and accounted from train.epochs",
            )
    p.require(
        t.batch_size == "auto" or (type(t.batch_size) is int and t.batch_size >= 1),
        "train.batch_size",
        t.batch_size,
        "must be an integer >= 1 or auto",
    )
    p.require(
        not (t.batch_size == "auto" and cfg.privacy.name == "local"),
        "train.batch_size",
        t.batch_size,
        "privacy=local needs a fixed batch size: it sets DP-SGD's sampling rate and so epsilon, "
        "which must not depend on a node's GPU",
    )
    p.require(t.max_batch_size >= 1, "train.max_batch_size", t.max_batch_size, "must be >= 1")
    _validate_local_devices(p, cfg)
    p.require(
        0.0 <= t.gpu_memory_fraction <= 1.0,
        "train.gpu_memory_fraction",
        t.gpu_memory_fraction,
        "must be in [0, 1] (0 = the simulation's GPU share, or no cap)",
    )
    p.require(t.lr > 0, "train.lr", t.lr, "must be > 0")
    p.one_of("train.optimizer", t.optimizer, OPTIMIZERS)
    p.require(0.0 <= t.momentum < 1.0, "train.momentum", t.momentum, "must be in [0, 1)")
    p.require(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
    p.one_of("train.amp", t.amp, AMP_MODES)
    p.require(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 disables clipping)")
    p.require(bool(_DEVICE_RE.match(t.device)), "train.device", t.device, "allowed: auto, cpu, cuda, cuda:N")
    p.require(t.telemetry_interval_s > 0, "train.telemetry_interval_s", t.telemetry_interval_s, "must be > 0")
    p.one_of("train.channels_last", t.channels_last, CHANNELS_LAST_MODES)
    p.require(
        not (t.deterministic and t.cudnn_benchmark),
        "train.cudnn_benchmark",
        t.cudnn_benchmark,
        "train.deterministic=true needs it off (autotuning picks kernels by timing, run to run)",
    )

    f = cfg.federation
    p.require(f.rounds >= 1, "federation.rounds", f.rounds, "must be >= 1")
    p.require(
        f.eval_every >= 1, "federation.eval_every", f.eval_every, "must be >= 1 (the last round is always evaluated)"
    )
    p.require(0.0 < f.fraction_train <= 1.0, "federation.fraction_train", f.fraction_train, "must be in (0, 1]")
    train_nodes_ok = p.require(f.min_train_nodes >= 1, "federation.min_train_nodes", f.min_train_nodes, "must be >= 1")
    p.require(
        0.0 <= f.fraction_evaluate <= 1.0, "federation.fraction_evaluate", f.fraction_evaluate, "must be in [0, 1]"
    )
    p.require(f.min_evaluate_nodes >= 0, "federation.min_evaluate_nodes", f.min_evaluate_nodes, "must be >= 0")
    p.require(
        not train_nodes_ok or f.min_available_nodes >= f.min_train_nodes,
        "federation.min_available_nodes",
        f.min_available_nodes,
        f"must be >= federation.min_train_nodes ({f.min_train_nodes})",
    )
    p.require(f.node_wait_timeout_s > 0, "federation.node_wait_timeout_s", f.node_wait_timeout_s, "must be > 0")
    p.require(f.round_wait_timeout_s > 0, "federation.round_wait_timeout_s", f.round_wait_timeout_s, "must be > 0")
    timeout_ok = p.require(f.round_timeout_s > 0, "federation.round_timeout_s", f.round_timeout_s, "must be > 0")
    p.require(
        not timeout_ok or f.message_ttl_s >= f.round_timeout_s,
        "federation.message_ttl_s",
        f.message_ttl_s,
        f"must be >= federation.round_timeout_s ({f.round_timeout_s}) or messages expire mid-round",
    )

    p.require(f.max_wall_time_s >= 0, "federation.max_wall_time_s", f.max_wall_time_s, "must be >= 0 (0 = no limit)")
    p.require(f.stall_rounds >= 0, "federation.stall_rounds", f.stall_rounds, "must be >= 0 (0 = never stop for it)")
    p.require(
        f.max_examples_per_node >= 1,
        "federation.max_examples_per_node",
        f.max_examples_per_node,
        "must be an integer >= 1 (the most examples one node's reply may count for)",
    )
    if p.one_of("federation.aggregation", f.aggregation, AGGREGATIONS) and f.aggregation == "stream":
        p.require(
            cfg.strategy.name not in ROBUST_RULES,
            "federation.aggregation",
            f.aggregation,
            f"strategy={cfg.strategy.name} compares every reply with the others, so it must gather them; use auto "
            "or gather (federation.server_memory_gb caps what it holds)",
        )
        p.require(
            cfg.ledger.contribution == "none",
            "federation.aggregation",
            f.aggregation,
            f"ledger.contribution={cfg.ledger.contribution} scores every reply against the others, so the round "
            "must gather them; use auto or gather",
        )
        p.require(
            cfg.strategy.name != "fedbuff"
            or (cfg.strategy.buffer_aggregator == "mean" and not cfg.privacy.name.startswith("central")),
            "federation.aggregation",
            f.aggregation,
            "strategy=fedbuff streams only its plain mean buffer (a robust buffer_aggregator compares the K updates, "
            "central DP clips each in its release); use auto or gather",
        )
    p.require(f.server_memory_gb >= 0, "federation.server_memory_gb", f.server_memory_gb, "must be >= 0 (0 = no cap)")
    _validate_task(p, cfg)

    m = cfg.simulation
    p.require(m.num_supernodes >= 1, "simulation.num_supernodes", m.num_supernodes, "must be >= 1")
    p.require(m.client_cpus >= 1, "simulation.client_cpus", m.client_cpus, "must be >= 1 (whole CPUs)")
    p.require(m.client_gpus >= 0, "simulation.client_gpus", m.client_gpus, "must be >= 0 (0 = CPU only)")
    p.require(bool(cfg.tracking.mlflow_experiment), "tracking.mlflow_experiment", "", "must not be empty")
    check_dir_name("sweep.name", cfg.sweep.name, p)
    p.require(cfg.sweep.timeout_s >= 0, "sweep.timeout_s", cfg.sweep.timeout_s, "must be >= 0 (0 = no limit)")

    p.require(cfg.seed >= 0, "seed", cfg.seed, "must be >= 0")
    name_ok = cfg.name is None or check_dir_name("name", cfg.name, p)
    if cfg.resume == "auto":
        p.require(
            not name_ok or bool(cfg.name),  # a bad name is named once, as name=...
            "resume",
            cfg.resume,
            "auto needs a run name (name=...): it resumes <output-dir>/<name>",
        )
    elif cfg.resume is not None:
        p.require(Path(cfg.resume).is_file(), "resume", cfg.resume, "no such checkpoint file (or use resume=auto)")
    p.require(
        bool(_DEVICE_RE.match(cfg.server_device)),
        "server_device",
        cfg.server_device,
        "allowed: auto, cpu, cuda, cuda:N",
    )
    p.raise_if_any()
    return cfg


def _validate_local_devices(p: Problems, cfg: Config) -> None:
    d = cfg.train.local_devices
    ok = (
        d == "auto"
        or (type(d) is int and d >= 1)
        or (isinstance(d, list) and d and all(type(i) is int and i >= 0 for i in d))
    )
    p.require(ok, "train.local_devices", d, "allowed: auto (every visible GPU), N >= 1, or a list of CUDA indices")
    p.require(
        d == 1 or cfg.privacy.name != "local",
        "train.local_devices",
        d,
        "privacy=local trains on one device: DP-SGD's accounting assumes one Poisson-sampled "
        "batch per step, which ranks sampling apart would break",
    )


def _require_target(p: Problems, key: str, value: str | None) -> bool:
    """A `_target_` must be a dotted path; whether it imports is checked where it is called,
    before round 1 (app/task/user_code.py)."""
    return p.require(
        bool(value) and _TARGET_RE.fullmatch(str(value)) is not None,
        key,
        value,
        "give the dotted path of a callable, e.g. my_pkg.module.function",
    )


# A metric's name becomes a metrics.jsonl column and a reply key (eval-<name>): a plain word,
# and not one of the row's other columns (ROW_COLUMNS), which would overwrite it.
_METRIC_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


def _metric_names(p: Problems, metrics: list[Any], builtins: tuple[str, ...] = BUILTIN_METRICS) -> list[str]:
    """The name of each valid `task.metrics` entry (`metric_name`); each invalid one is recorded
    in `p` instead (an entry with no usable name, such as an unknown built-in or a name taken
    from a bad `_target_`, has its name left unchecked)."""
    names = []
    for i, entry in enumerate(metrics):
        key = f"task.metrics[{i}]"
        if isinstance(entry, Mapping):
            target_ok = _require_target(p, f"{key}._target_", entry.get("_target_"))
            name = entry.get("name")
            if not p.require(name is None or isinstance(name, str), f"{key}.name", name, "must be a string"):
                continue
            if name is None and not target_ok:
                continue  # the name would be made from the bad target
            name = metric_name(entry)
        elif p.require(
            entry in builtins,
            key,
            entry,
            f"allowed: {', '.join(builtins)}, or {{_target_: my_pkg.module.metric, name: ...}}"
            if builtins is BUILTIN_METRICS
            else f"task.type=causal_lm reports {', '.join(builtins)} (its logits are too large to keep for other metrics)",
        ):
            name = entry
        else:
            continue
        ok = p.require(
            _METRIC_NAME_RE.fullmatch(name) is not None,
            f"{key}.name",
            name,
            "a metric's name is a metrics.jsonl column: letters, digits, '_', '.', '-', starting with a letter",
        ) and p.require(
            name not in ROW_COLUMNS,
            f"{key}.name",
            name,
            f"{name!r} is already a metrics.jsonl column of every run (it would be overwritten); name the metric "
            f"otherwise, e.g. {{_target_: ..., name: my_{name}}}",
        )
        if ok:
            names.append(name)
    return names


def _validate_task(p: Problems, cfg: Config) -> None:
    """task.loss, task.metrics and the stopping target they define. Normalises the target:
    afterwards federation.target_metric names a metric (the primary one when unset) and
    federation.target_value holds the value to reach (federation.target_accuracy, the older
    spelling, moved there). Idempotent: validating twice accepts what the first pass set.
    The target is checked against the metrics only when every metric is valid."""
    t = cfg.task
    p.one_of("task.type", t.type, TASK_TYPES)
    if t.loss.target is not None and p.require(
        t.type != "causal_lm", "task.loss._target_", t.loss.target, "task.type=causal_lm has its own loss (next tokens)"
    ):
        _require_target(p, "task.loss._target_", t.loss.target)
    metrics = list(t.metrics)
    before = len(p)
    p.require(
        bool(metrics), "task.metrics", metrics, "name at least one metric, e.g. [accuracy] (the first is primary)"
    )
    causal = t.type == "causal_lm"
    names = _metric_names(p, metrics, LM_METRICS if causal else BUILTIN_METRICS)
    if causal and names:
        p.require(
            names[0] != "perplexity",
            "task.metrics",
            metrics,
            "perplexity is lower-is-better and the primary (first) metric must be higher-is-better: put "
            "token_accuracy first (perplexity is still reported)",
        )
    metrics_ok = len(p) == before
    dupes = sorted({n for n in names if names.count(n) > 1})
    p.require(
        not dupes, "task.metrics", metrics, f"metric names must be unique ({', '.join(dupes)}); set each one's name"
    )

    f = cfg.federation
    if (
        p.require(
            0 <= f.target_accuracy <= 1, "federation.target_accuracy", f.target_accuracy, "must be in [0, 1] (0 = off)"
        )
        and f.target_accuracy > 0
    ):
        spelled_once = p.require(
            f.target_value in (0, f.target_accuracy) and f.target_metric in (None, "accuracy"),
            "federation.target_accuracy",
            f.target_accuracy,
            "it is the older spelling of federation.target_metric=accuracy federation.target_value=...; set one or the "
            f"other (federation.target_metric={f.target_metric!r}, federation.target_value={f.target_value!r})",
        )
        if (
            spelled_once
            and metrics_ok
            and p.require(
                "accuracy" in names,
                "federation.target_accuracy",
                f.target_accuracy,
                f"needs accuracy among task.metrics ({', '.join(names)}); "
                "use federation.target_metric=<name> federation.target_value=...",
            )
        ):
            f.target_metric, f.target_value = "accuracy", f.target_accuracy
    if metrics_ok:
        if f.target_metric is None:
            f.target_metric = names[0]
        p.require(
            f.target_metric in names,
            "federation.target_metric",
            f.target_metric,
            f"allowed: the names of task.metrics ({', '.join(names)}); unset = the first (primary) one",
        )
    if p.require(
        0 <= f.target_value < float("inf"),
        "federation.target_value",
        f.target_value,
        f"must be a finite number >= 0: stop once {f.target_metric} reaches it (metrics are higher-is-better); 0 = off",
    ) and p.ok("federation.target_metric"):
        p.require(
            f.target_value <= 1 or f.target_metric not in BUILTIN_METRICS,
            "federation.target_value",
            f.target_value,
            f"{f.target_metric} is at most 1, so the run would never stop for it; 0 = off",
        )


def _validate_model(p: Problems, cfg: Config) -> None:
    m = cfg.model
    p.one_of("model.name", m.name, MODELS)
    p.require(m.width >= 1, "model.width", m.width, "must be >= 1")
    if m.name == "resnet18":
        p.require(m.width == 64, "model.width", m.width, "model=resnet18 is 64 wide (torchvision)")
    if m.name == "torchvision":
        p.require(
            bool(m.arch),
            "model.arch",
            m.arch,
            "model=torchvision needs a torchvision model name, e.g. mobilenet_v3_small",
        )
    if m.name == "custom":
        _require_target(p, "model._target_", m.target)
    _validate_text(p, cfg)
    if m.init_weights is not None:
        p.require(
            Path(m.init_weights).is_file(),
            "model.init_weights",
            m.init_weights,
            "no such file (a torch.save'd state_dict)",
        )
    p.require(
        all(isinstance(p, str) and p and not p.startswith(".") and not p.endswith(".") for p in m.trainable),
        "model.trainable",
        m.trainable,
        "a list of parameter-name prefixes such as [fc] or [net.9]; [] trains the whole model",
    )


def _validate_text(p: Problems, cfg: Config) -> None:
    """model=hf, dataset=text and task.type must agree: transformers take token ids, and a task
    type other than classification needs one."""
    m, d, t = cfg.model, cfg.dataset, cfg.task
    if m.name == "hf":
        if (
            p.require(
                (m.path is None) != (m.config is None),
                "model.path",
                m.path,
                "model=hf needs one of model.path (a local transformers directory) or model.config (a dict or JSON file)",
            )
            and m.path is not None
        ):
            p.require(Path(m.path).expanduser().is_dir(), "model.path", m.path, "no such directory")
        p.one_of("model.peft", m.peft, PEFT_METHODS)
        p.one_of("model.dtype", m.dtype, ("float32", "bfloat16"))
        if m.peft == "lora":
            p.require(m.lora_r >= 1, "model.lora_r", m.lora_r, "must be >= 1")
            p.require(m.lora_alpha > 0, "model.lora_alpha", m.lora_alpha, "must be > 0")
            p.require(0 <= m.lora_dropout < 1, "model.lora_dropout", m.lora_dropout, "must be in [0, 1)")
        p.require(
            t.type != "classification",
            "task.type",
            t.type,
            "model=hf needs task.type=causal_lm or sequence_classification (task=causal_lm, task=sequence_classification)",
        )
        p.require(d.name == "text", "dataset.name", d.name, "model=hf reads token ids: use dataset=text")
    elif t.type != "classification":
        p.require(False, "task.type", t.type, f"task.type={t.type} needs model=hf (a transformers model)")
    if d.name == "text":
        p.require(d.block_size >= 2, "dataset.block_size", d.block_size, "must be >= 2 tokens")
        if p.require(bool(d.path), "dataset.path", d.path, "dataset=text needs dataset.path (.txt / .jsonl files)"):
            p.require(Path(d.path).expanduser().exists(), "dataset.path", d.path, "no such file or directory")
        p.require(m.name == "hf", "model.name", m.name, "dataset=text gives token ids: use model=hf")
    if cfg.partition.name == "by_file":
        p.require(d.name == "text", "partition.name", "by_file", "partition=by_file splits text files: dataset=text")
    if t.type == "causal_lm":
        p.require(
            cfg.partition.name != "dirichlet",
            "partition.name",
            "dirichlet",
            "task.type=causal_lm has no labels to skew: partition=iid or by_file",
        )


def _validate_fedbuff(p: Problems, s: StrategyConfig) -> None:
    p.require(s.buffer_size >= 0, "strategy.buffer_size", s.buffer_size, "must be >= 1, or 0 (auto: half the nodes)")
    p.require(s.concurrency >= 0, "strategy.concurrency", s.concurrency, "must be >= 0 (0 = every connected node)")
    p.require(s.max_staleness >= 0, "strategy.max_staleness", s.max_staleness, "must be >= 0")
    p.one_of("strategy.staleness_fn", s.staleness_fn, STALENESS_FUNCTIONS)
    p.require(s.staleness_a >= 0, "strategy.staleness_a", s.staleness_a, "must be >= 0 (< 0 favours stale updates)")
    p.require(s.staleness_b >= 0, "strategy.staleness_b", s.staleness_b, "must be >= 0")
    p.require(s.server_lr >= 0, "strategy.server_lr", s.server_lr, "must be > 0, or 0 for the default")
    p.require(0 <= s.server_momentum < 1, "strategy.server_momentum", s.server_momentum, "must be in [0, 1)")
    p.one_of("strategy.buffer_aggregator", s.buffer_aggregator, BUFFER_AGGREGATORS)


def _validate_ditto(p: Problems, cfg: Config) -> None:
    """strategy=ditto: its personal models show only in federated evaluation."""
    if cfg.strategy.name != "ditto":
        return
    s = cfg.strategy
    p.require(
        s.ditto_lambda > 0, "strategy.ditto_lambda", s.ditto_lambda, "must be > 0 (the pull towards the global model)"
    )
    p.require(
        cfg.federation.fraction_evaluate > 0,
        "federation.fraction_evaluate",
        cfg.federation.fraction_evaluate,
        "Ditto's personal models are evaluated by their nodes only (eval-personal-<metric>): set it > 0",
    )
    p.require(
        cfg.privacy.name != "local",
        "privacy.name",
        cfg.privacy.name,
        "a personal model trains without DP-SGD, and its evaluation metrics would leave the node unaccounted: "
        "use privacy=none or central with strategy=ditto",
    )


def _validate_scaffold(p: Problems, cfg: Config) -> None:
    """strategy=scaffold: a node's change of its control variate travels in the clear, beside a
    model the server reads as it is; what would hide, compress or regroup either is refused."""
    if cfg.strategy.name != "scaffold":
        return
    why = "SCAFFOLD's server reads each node's change of its control variate c_i in the clear"
    p.require(
        cfg.privacy.name == "none",
        "privacy.name",
        cfg.privacy.name,
        f"{why}, an exact statistic of its training that no epsilon covers (and DP-SGD's noisy steps would "
        "need their own variate): use privacy=none, or strategy=fedavg with privacy",
    )
    p.require(cfg.secagg.name == "none", "secagg.name", cfg.secagg.name, f"{why}: use secagg=none")
    p.require(
        cfg.train.optimizer == "sgd",
        "train.optimizer",
        cfg.train.optimizer,
        "SCAFFOLD estimates a node's mean gradient as (x - y) / (steps x lr), which holds for SGD (with momentum b: "
        "lr / (1 - b)), not for Adam's per-coordinate steps: use train.optimizer=sgd",
    )
    p.require(
        cfg.compression.name == "none" and cfg.compression.downlink == "none",
        "compression",
        f"{cfg.compression.name}/{cfg.compression.downlink}",
        "SCAFFOLD's variates and models travel uncompressed (a codec for the variates is not built yet): "
        "use compression=none",
    )
    p.require(
        cfg.topology.name == "flat",
        "topology.name",
        cfg.topology.name,
        "SCAFFOLD over regions would need a variate per region: not built yet; use topology=flat",
    )
    p.require(
        cfg.ledger.contribution == "none",
        "ledger.contribution",
        cfg.ledger.contribution,
        "contribution scores recompute FedAvg's aggregate from the replies, which under SCAFFOLD also carry "
        "the variates: not built yet; use ledger.contribution=none",
    )
    p.require(
        cfg.model.name != "hf",
        "model.name",
        cfg.model.name,
        "model=hf sends its adapters under peft's names, not the parameters' own: SCAFFOLD's per-parameter "
        "correction is not built for it yet",
    )


def _validate_server_optimizer(p: Problems, cfg: Config) -> None:
    """strategy.server_optimizer and strategy.proximal_mu, and what they compose with."""
    s = cfg.strategy
    p.require(s.proximal_mu >= 0, "strategy.proximal_mu", s.proximal_mu, "must be >= 0 (0: no proximal term)")
    p.require(
        s.proximal_mu == 0 or cfg.privacy.name != "local",
        "strategy.proximal_mu",
        s.proximal_mu,
        "privacy=local trains with Opacus, whose optimizer builds each step's gradient from the clipped "
        "per-example gradients and noise: a proximal term there is not built yet; use proximal_mu=0",
    )
    if not p.one_of("strategy.server_optimizer", s.server_optimizer, SERVER_OPTIMIZERS) or s.server_optimizer == "none":
        return
    p.require(0 <= s.server_beta1 < 1, "strategy.server_beta1", s.server_beta1, "must be in [0, 1)")
    p.require(0 <= s.server_beta2 < 1, "strategy.server_beta2", s.server_beta2, "must be in [0, 1)")
    p.require(s.server_tau > 0, "strategy.server_tau", s.server_tau, "must be > 0")
    p.require(
        s.server_optimizer != "momentum" or s.server_momentum > 0,
        "strategy.server_momentum",
        s.server_momentum,
        "server_optimizer=momentum (FedAvgM) needs a momentum β > 0, e.g. strategy.server_momentum=0.9",
    )
    p.require(
        s.name != "fedbuff" or not cfg.privacy.name.startswith("central"),
        "strategy.server_optimizer",
        s.server_optimizer,
        "FedBuff with central DP steps by its release's own rule (server_lr / K): a server optimizer there is "
        "not built yet; use server_optimizer=none",
    )
    p.require(
        cfg.ledger.contribution == "none",
        "ledger.contribution",
        cfg.ledger.contribution,
        "contribution scores value each reply's share of the round's aggregate; a server optimizer's step "
        "is not a share of it: use strategy.server_optimizer=none with contribution scores",
    )


def _validate_privacy(p: Problems, cfg: Config) -> None:
    dp = cfg.privacy
    if not p.one_of("privacy.name", dp.name, PRIVACY) or dp.name == "none":
        return
    p.require(dp.noise_multiplier >= 0, "privacy.noise_multiplier", dp.noise_multiplier, "must be >= 0")
    p.require(dp.clip_norm > 0, "privacy.clip_norm", dp.clip_norm, "must be > 0")
    p.require(0 < dp.delta < 1, "privacy.delta", dp.delta, "must be in (0, 1)")
    p.require(dp.max_epsilon >= 0, "privacy.max_epsilon", dp.max_epsilon, "must be > 0, or 0 for no budget")
    p.require(0 < dp.target_quantile < 1, "privacy.target_quantile", dp.target_quantile, "must be in (0, 1)")
    p.require(dp.clip_lr > 0, "privacy.clip_lr", dp.clip_lr, "must be > 0")
    p.require(dp.count_noise >= 0, "privacy.count_noise", dp.count_noise, "must be >= 0 (0 = expected cohort / 20)")
    p.require(dp.target_epsilon >= 0, "privacy.target_epsilon", dp.target_epsilon, "must be > 0, or 0 to use the noise")
    if dp.name.startswith("central"):
        s = cfg.strategy.name
        aggregator = cfg.strategy.buffer_aggregator if s == "fedbuff" else s
        known = p.ok("strategy.name") and (s != "fedbuff" or p.ok("strategy.buffer_aggregator"))
        p.require(
            not known or aggregator in ("fedavg", "mean"),  # an unknown one is named as strategy.*
            "privacy.name",
            dp.name,
            f"central DP has no standard sensitivity bound for {aggregator} (a robust rule's output can move by "
            "more than one clipped update); use strategy=fedavg or fedbuff with buffer_aggregator=mean, or privacy=local",
        )
        p.require(
            dp.noise_multiplier > 0, "privacy.noise_multiplier", dp.noise_multiplier, "central DP needs noise > 0"
        )
        p.require(
            not (s == "fedbuff" and dp.poisson_sampling),
            "privacy.poisson_sampling",
            True,
            "FedBuff releases are accounted with q = 1 (its cohort is whoever answers first)",
        )
        st = cfg.strategy
        p.require(
            not (s == "fedbuff" and 0 < st.concurrency < st.buffer_size),
            "strategy.buffer_size",
            st.buffer_size,
            f"a central-DP buffer takes one update per node, but strategy.concurrency={st.concurrency} train at once",
        )
    if dp.name == "local":
        p.require(
            not (cfg.strategy.name == "fedbuff" and dp.target_epsilon > 0),
            "privacy.target_epsilon",
            dp.target_epsilon,
            "plans each client's noise over federation.rounds tasks, but a FedBuff node may train more often; "
            "with strategy=fedbuff set privacy.noise_multiplier instead (epsilon is still reported per client)",
        )
        p.require(
            dp.noise_multiplier > 0 or dp.target_epsilon > 0,
            "privacy.noise_multiplier",
            dp.noise_multiplier,
            "local DP-SGD needs noise > 0 or privacy.target_epsilon > 0",
        )


def _validate_topology(p: Problems, cfg: Config) -> None:
    """topology=flat|regions (app/regions/) and the WAN links of the fleet; under regions, what
    needs every update at the server, or a per-node link, is refused with the reason."""
    t, f = cfg.topology, cfg.fleet
    p.one_of("topology.name", t.name, TOPOLOGIES)
    p.one_of("topology.region_rule", t.region_rule, REGION_RULES)
    p.one_of("topology.wan_compression", t.wan_compression, WAN_CODECS)
    p.require(t.region_byzantine >= 0, "topology.region_byzantine", t.region_byzantine, "must be >= 0")
    p.require(t.regions >= 0, "topology.regions", t.regions, "a count of regions >= 1, or 0 to give them otherwise")
    p.require(all(r >= 0 for r in t.assignment), "topology.assignment", t.assignment, "region ids are 0, 1, ...")
    given = [k for k, v in (("regions", t.regions), ("assignment", t.assignment), ("csv", t.csv)) if v]
    p.require(
        len(given) <= 1,
        "topology",
        given,
        "give the regions one way: topology.regions (a count), topology.assignment (a list) or topology.csv",
    )
    if t.name == "regions":
        p.require(
            bool(given),
            "topology.regions",
            t.regions,
            "topology=regions needs the regions: a count (topology.regions=5), a list (topology.assignment=[0,0,1,1]) "
            "or a CSV of partition,region (topology.csv=...)",
        )
    wan = {"fleet.wan_downlink_mbps": f.wan_downlink_mbps, "fleet.wan_uplink_mbps": f.wan_uplink_mbps}
    for key, rates in wan.items():
        p.require(all(x > 0 for x in rates), key, rates, "Mbit/s must be > 0")
    p.require(all(x >= 0 for x in f.wan_latency_ms), "fleet.wan_latency_ms", f.wan_latency_ms, "must be >= 0")
    links = [f.wan_downlink_mbps, f.wan_uplink_mbps, f.wan_latency_ms]
    p.require(
        all(links) or not any(links),
        "fleet.wan_*",
        links,
        "give fleet.wan_downlink_mbps, wan_uplink_mbps and wan_latency_ms together (per region, cycled), or none",
    )
    if any(links):
        p.require(
            bool(given),
            "fleet.wan_*",
            links,
            "WAN links belong to regions: place the sites with topology.regions (or assignment, csv); under "
            "topology=flat the sites of a region share its link",
        )
    if t.name != "regions":
        return
    why = "topology=regions combines each region's replies at its aggregator"
    if cfg.strategy.name == "fedbuff":
        p.require(
            cfg.privacy.name == "none",
            "privacy.name",
            cfg.privacy.name,
            "FedBuff over regions buffers one update per region: central DP would clip a region's update, not a "
            "client's, and local DP's per-site accounts do not travel with it yet; use privacy=none, or a "
            "synchronous strategy with regions",
        )
        p.require(
            cfg.ledger.contribution == "none",
            "ledger.contribution",
            cfg.ledger.contribution,
            "FedBuff over regions buffers regions, not sites: per-site scores are not defined there",
        )
    if cfg.secagg.name != "none":  # SecAgg+ inside each region: its aggregator learns the region's sums only
        p.require(
            t.region_rule == "mean",
            "topology.region_rule",
            t.region_rule,
            f"{why}, and under secagg=plus it learns only their sum: a robust rule inside a region needs each "
            "update in the clear; use topology.region_rule=mean (the top level sees regions' models: any rule "
            "there would be sound, but secagg=plus runs with strategy=fedavg)",
        )
        p.require(
            cfg.privacy.name not in DISTRIBUTED_PRIVACY,
            "privacy.name",
            cfg.privacy.name,
            "distributed DP's noise is planned so that the whole cohort's sum carries the mechanism; with SecAgg+ "
            "inside each region an aggregator unmasks its region's sum, which carries only its sites' share of "
            "the noise: not built yet, use privacy=none (or topology=flat)",
        )
    p.require(
        cfg.compression.downlink == "none",
        "compression.downlink",
        cfg.compression.downlink,
        f"{why}, and the aggregator forwards one model to its sites: a per-node downlink codec would have to run "
        "there; use topology.wan_compression for the wide-area leg",
    )
    if cfg.privacy.name.startswith("central"):
        p.require(
            t.region_rule == "mean" and t.wan_compression == "none",
            "topology",
            f"region_rule={t.region_rule} wan_compression={t.wan_compression}",
            "central DP bounds one client's effect on a plain sum of clipped updates (its sensitivity); a robust "
            "rule inside a region, or a regional sum re-encoded for the WAN, changes what one client moves: use "
            "topology.region_rule=mean topology.wan_compression=none",
        )
    p.require(
        cfg.ledger.contribution == "none"
        or (t.region_rule == "mean" and t.wan_compression == "none" and cfg.strategy.name == "fedavg"),
        "ledger.contribution",
        cfg.ledger.contribution,
        "contribution scores recompute the flat aggregate, which equals the regions' only for means at both levels "
        "without WAN compression: use strategy=fedavg topology.region_rule=mean topology.wan_compression=none",
    )


def _validate_secagg(p: Problems, cfg: Config) -> None:
    """secagg=plus and what it composes with: whatever needs one node's update in the clear is refused."""
    sa, dp = cfg.secagg, cfg.privacy
    if not p.one_of("secagg.name", sa.name, SECAGGS):
        return
    if sa.name == "none":
        p.require(
            dp.name not in DISTRIBUTED_PRIVACY,
            "privacy.name",
            dp.name,
            "distributed DP has each node noise its own update, which only hides it inside a secure sum: set secagg=plus",
        )
        return
    why = "the server sees only the sum of the round's updates under secure aggregation"
    p.require(
        cfg.strategy.name in ("fedavg", "ditto"),
        "strategy.name",
        cfg.strategy.name,
        f"{why}: a robust rule (and FedBuff's buffer, SCAFFOLD's variates) needs each update in the clear; use "
        "strategy=fedavg (or ditto)",
    )
    p.require(
        not dp.name.startswith("central"),
        "privacy.name",
        dp.name,
        f"{why}, so it cannot clip and noise each one: use privacy=distributed (each node clips and adds its share "
        "of the noise) or distributed_adaptive",
    )
    p.require(
        cfg.ledger.contribution == "none",
        "ledger.contribution",
        cfg.ledger.contribution,
        f"{why}: per-node scores need each update; the ledger records the round's survivors and the sum's hash",
    )
    p.require(
        cfg.compression.name in ("none", "int8") and cfg.compression.downlink == "none",
        "compression",
        f"{cfg.compression.name}/{cfg.compression.downlink}",
        "the ring fixes what a masked update takes on the wire: compression=int8 quantizes once, into a "
        "2-byte ring; another codec would quantize twice (or, topk, leave coordinates the masks cover "
        "anyway), and a compressed downlink changes each node's base",
    )
    p.require(
        not (cfg.compression.name == "int8" and dp.name in DISTRIBUTED_PRIVACY),
        "compression",
        cfg.compression.name,
        "distributed DP's noise needs room the 2-byte ring of compression=int8 does not have: use compression=none",
    )
    p.require(sa.threshold >= 0, "secagg.threshold", sa.threshold, "must be >= 2, or 0 for the default")
    p.require(
        sa.threshold not in (1, 2),
        "secagg.threshold",
        sa.threshold,
        "a round could finish with that many contributors, and with 2 each learns the other's update from the sum "
        "(with 1 a share is the secret): use >= 3, or 0 for the default",
    )
    p.require(sa.degree >= 0, "secagg.degree", sa.degree, "must be >= 1, or 0 for the default")
    p.require(sa.clipping_range > 0, "secagg.clipping_range", sa.clipping_range, "must be > 0")
    p.require(sa.quantization_range >= 2, "secagg.quantization_range", sa.quantization_range, "must be >= 2")
    p.require(
        sa.modulus_range >= 4 and sa.modulus_range & (sa.modulus_range - 1) == 0 and sa.modulus_range <= 2**62,
        "secagg.modulus_range",
        sa.modulus_range,
        "must be a power of two in [4, 2^62] (masks are uniform in Z_M only for a power of two)",
    )
    p.require(
        sa.max_weight >= 0, "secagg.max_weight", sa.max_weight, "must be >= 1, or 0 = federation.max_examples_per_node"
    )
    p.one_of("secagg.on_too_few", sa.on_too_few, SECAGG_POLICIES)
    if dp.name in DISTRIBUTED_PRIVACY:
        p.require(
            dp.noise_multiplier > 0, "privacy.noise_multiplier", dp.noise_multiplier, "distributed DP needs noise > 0"
        )
        p.require(
            dp.clip_norm <= sa.clipping_range,
            "privacy.clip_norm",
            dp.clip_norm,
            f"must be <= secagg.clipping_range={sa.clipping_range}, the largest coordinate the ring carries",
        )


def _validate_fleet(p: Problems, cfg: Config) -> None:
    """The fleet profile (app/simulation/fleet.py); stragglers=... is its short form, not a second one."""
    f = cfg.fleet
    if f.name == "none":
        return
    p.require(
        cfg.stragglers.name == "none" and cfg.stragglers.dropout == 0,
        "stragglers",
        cfg.stragglers.name,
        f"stragglers is the short form of a fleet profile; with fleet={f.name} set the slowdowns in "
        "fleet.speed / fleet.factors / fleet.sigma and drop-outs in fleet.completion_p",
    )
    p.one_of("fleet.speed", f.speed, FLEET_SPEEDS)
    p.one_of("fleet.availability", f.availability, AVAILABILITY)
    p.require(f.reference_samples_per_s > 0, "fleet.reference_samples_per_s", f.reference_samples_per_s, "must be > 0")
    if f.speed == "fixed":
        p.require(bool(f.factors), "fleet.factors", f.factors, "fleet.speed=fixed needs slowdowns, e.g. [5,5,5]")
    p.require(all(x > 0 for x in f.factors), "fleet.factors", f.factors, "slowdowns must be > 0")
    p.require(f.sigma >= 0, "fleet.sigma", f.sigma, "must be >= 0")
    if f.speed == "devices":
        p.require(
            bool(f.devices), "fleet.devices", f.devices, "fleet.speed=devices needs device classes, e.g. [rtx4090,t4]"
        )
    p.require(all(v > 0 for v in f.device_speeds.values()), "fleet.device_speeds", f.device_speeds, "must be > 0")
    for key in ("downlink_mbps", "uplink_mbps"):
        values = getattr(f, key)
        p.require(bool(values) and all(v > 0 for v in values), f"fleet.{key}", values, "a non-empty list of rates > 0")
    p.require(bool(f.latency_ms) and all(v >= 0 for v in f.latency_ms), "fleet.latency_ms", f.latency_ms, "values >= 0")
    p.require(f.link_sigma >= 0, "fleet.link_sigma", f.link_sigma, "must be >= 0")
    p.require(0 < f.completion_p <= 1, "fleet.completion_p", f.completion_p, "must be in (0, 1]")
    if f.availability == "trace":
        p.require(bool(f.trace), "fleet.trace", f.trace, "fleet.availability=trace needs a CSV file (docs/fleet.md)")

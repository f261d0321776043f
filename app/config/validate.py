"""Range checks on a typed config, one function per section: a bad value fails before any
work starts, with a message that names the key, the value and what is allowed."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.config.schema import (
    AMP_MODES,
    ATTACKS,
    AVAILABILITY,
    BUFFER_AGGREGATORS,
    BUILTIN_METRICS,
    CHANNELS_LAST_MODES,
    COMPRESSIONS,
    CONTRIBUTIONS,
    DATASETS,
    DOWNLINKS,
    FLEET_SPEEDS,
    LEDGERS,
    MODELS,
    OPTIMIZERS,
    PARTITIONS,
    PRIVACY,
    ROBUST_POLICIES,
    ROW_COLUMNS,
    STRAGGLERS,
    STRATEGIES,
    Config,
    ConfigError,
    StrategyConfig,
    metric_name,
)
from strategies.staleness import STALENESS_FUNCTIONS

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_TARGET_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
# One directory name that stays under its root: not empty, no '/', '\\' or control character
# (NUL included), not '.', '..' or hidden. '=' and ',' stay: a sweep job is named after its overrides.
_DIR_NAME_RE = re.compile(r"[^./\\\x00-\x1f\x7f][^/\\\x00-\x1f\x7f]*")


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


def _one_of(key: str, value: Any, options: tuple[str, ...]) -> None:
    _require(value in options, key, value, "allowed: " + ", ".join(options))


def check_dir_name(key: str, value: str) -> None:
    """A name that becomes a directory under a root (`name`, `sweep.name`) must be one safe
    path component: '../x' or '/abs' would write outside the root."""
    _require(
        _DIR_NAME_RE.fullmatch(value) is not None,
        key,
        value,
        "must be a single directory name under its root: not empty, no '/', '\\' or control "
        "characters, not starting with '.'",
    )


def validate(cfg: Config) -> Config:
    """Reject values that cannot work, before any training starts."""
    s = cfg.strategy
    _one_of("strategy.name", s.name, STRATEGIES)
    _require(s.num_byzantine >= 0, "strategy.num_byzantine", s.num_byzantine, "must be >= 0")
    _require(s.num_selected >= 1, "strategy.num_selected", s.num_selected, "must be >= 1")
    if s.name == "krum":
        _require(
            s.num_selected == 1,
            "strategy.num_selected",
            s.num_selected,
            "Krum selects 1; use strategy=multikrum for m > 1",
        )
    _require(
        0.0 <= s.trim_ratio < 0.5,
        "strategy.trim_ratio",
        s.trim_ratio,
        "must be in [0, 0.5): 0.5 or more trims everything",
    )
    _one_of("strategy.on_too_few", s.on_too_few, ROBUST_POLICIES)
    _validate_fedbuff(s)
    if s.name == "fedbuff":
        _require(
            cfg.federation.fraction_evaluate == 0,
            "federation.fraction_evaluate",
            cfg.federation.fraction_evaluate,
            "strategy=fedbuff evaluates centrally every federation.eval_every versions; set it to 0",
        )

    c = cfg.compression
    _one_of("compression.name", c.name, COMPRESSIONS)
    _require(0 < c.ratio <= 1, "compression.ratio", c.ratio, "must be in (0, 1]: the fraction of entries sent")
    _one_of("compression.downlink", c.downlink, DOWNLINKS)
    _require(c.downlink_nodes >= 1, "compression.downlink_nodes", c.downlink_nodes, "must be >= 1")
    if c.downlink == "delta":
        _require(
            c.name != "none",
            "compression.downlink",
            c.downlink,
            "delta encodes the model's change with compression.name's codec; set compression=int8 (or fp16, "
            "bf16, topk), or use compression.downlink=fp16",
        )

    _one_of("ledger", cfg.ledger.name, LEDGERS)
    led = cfg.ledger
    _one_of("ledger.contribution", led.contribution, CONTRIBUTIONS)
    if led.contribution != "none":
        _require(
            led.name == "on", "ledger.contribution", led.contribution, "the scores go into the ledger: set ledger=on"
        )
        _require(
            cfg.privacy.name not in ("central", "central_adaptive"),
            "ledger.contribution",
            led.contribution,
            "per-node scores from raw updates are outside central DP's epsilon; use privacy=local or none",
        )
        _one_of("ledger.contribution_value", led.contribution_value, ("loss", "metric"))
        _require(led.shapley_permutations >= 1, "ledger.shapley_permutations", led.shapley_permutations, "must be >= 1")
        _require(led.shapley_tolerance >= 0, "ledger.shapley_tolerance", led.shapley_tolerance, "must be >= 0")
        _require(led.validation_examples >= 1, "ledger.validation_examples", led.validation_examples, "must be >= 1")
    m = cfg.monitoring
    _require(0 <= m.prometheus_port <= 65535, "monitoring.prometheus_port", m.prometheus_port, "0 (off) or a TCP port")
    _require(m.max_node_labels >= 1, "monitoring.max_node_labels", m.max_node_labels, "must be >= 1")

    _validate_privacy(cfg)

    g = cfg.stragglers
    _one_of("stragglers.name", g.name, STRAGGLERS)
    _require(all(x >= 1 for x in g.factors), "stragglers.factors", g.factors, "slowdowns must be >= 1 (1 = full speed)")
    if g.name == "fixed":
        _require(bool(g.factors), "stragglers.factors", g.factors, "stragglers=fixed needs a list, e.g. [5,5,5]")
    _require(g.sigma >= 0, "stragglers.sigma", g.sigma, "must be >= 0")
    _require(0 <= g.dropout < 1, "stragglers.dropout", g.dropout, "must be in [0, 1)")
    _validate_fleet(cfg)

    a = cfg.attack
    _one_of("attack.name", a.name, ATTACKS)
    _require(a.num_malicious >= 0, "attack.num_malicious", a.num_malicious, "must be >= 0")
    _require(a.scale > 0, "attack.scale", a.scale, "must be > 0")
    _require(
        0 < a.claimed_examples < float("inf"),
        "attack.claimed_examples",
        a.claimed_examples,
        "must be a finite number > 0 (the server rejects any other count outright)",
    )

    d = cfg.dataset
    _one_of("dataset.name", d.name, DATASETS)
    if d.name == "npz":
        _require(bool(d.path), "dataset.path", d.path, "dataset=npz needs dataset.path=/abs/path/data.npz")
        _require(Path(d.path).is_file(), "dataset.path", d.path, "no such .npz file")
    if d.name == "hf_disk":
        _require(bool(d.path), "dataset.path", d.path, "dataset=hf_disk needs dataset.path=<save_to_disk dir>")
        _require(Path(d.path).is_dir(), "dataset.path", d.path, "no such directory")
    if d.name == "hf":
        _require(
            bool(d.hf_name), "dataset.hf_name", d.hf_name, "dataset=hf needs dataset.hf_name=<user/name on the Hub>"
        )
    if d.name == "python":
        _require_target("dataset._target_", d.target)
    _require(0.0 < d.test_fraction < 1.0, "dataset.test_fraction", d.test_fraction, "must be in (0, 1)")
    _require(0.0 <= d.val_fraction < 1.0, "dataset.val_fraction", d.val_fraction, "must be in [0, 1)")

    p = cfg.partition
    _one_of("partition.name", p.name, PARTITIONS)
    _require(p.alpha > 0, "partition.alpha", p.alpha, "must be > 0 (smaller = more label skew)")
    _require(p.min_partition_size >= 1, "partition.min_partition_size", p.min_partition_size, "must be >= 1")

    _validate_model(cfg)

    t = cfg.train
    _require(t.epochs >= 1, "train.epochs", t.epochs, "must be >= 1")
    _require(
        t.batch_size == "auto" or (type(t.batch_size) is int and t.batch_size >= 1),
        "train.batch_size",
        t.batch_size,
        "must be an integer >= 1 or auto",
    )
    _require(
        not (t.batch_size == "auto" and cfg.privacy.name == "local"),
        "train.batch_size",
        t.batch_size,
        "privacy=local needs a fixed batch size: it sets DP-SGD's sampling rate and so epsilon, "
        "which must not depend on a node's GPU",
    )
    _require(t.max_batch_size >= 1, "train.max_batch_size", t.max_batch_size, "must be >= 1")
    _validate_local_devices(cfg)
    _require(
        0.0 <= t.gpu_memory_fraction <= 1.0,
        "train.gpu_memory_fraction",
        t.gpu_memory_fraction,
        "must be in [0, 1] (0 = the simulation's GPU share, or no cap)",
    )
    _require(t.lr > 0, "train.lr", t.lr, "must be > 0")
    _one_of("train.optimizer", t.optimizer, OPTIMIZERS)
    _require(0.0 <= t.momentum < 1.0, "train.momentum", t.momentum, "must be in [0, 1)")
    _require(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
    _one_of("train.amp", t.amp, AMP_MODES)
    _require(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 disables clipping)")
    _require(bool(_DEVICE_RE.match(t.device)), "train.device", t.device, "allowed: auto, cpu, cuda, cuda:N")
    _require(t.telemetry_interval_s > 0, "train.telemetry_interval_s", t.telemetry_interval_s, "must be > 0")
    _one_of("train.channels_last", t.channels_last, CHANNELS_LAST_MODES)
    _require(
        not (t.deterministic and t.cudnn_benchmark),
        "train.cudnn_benchmark",
        t.cudnn_benchmark,
        "train.deterministic=true needs it off (autotuning picks kernels by timing, run to run)",
    )

    f = cfg.federation
    _require(f.rounds >= 1, "federation.rounds", f.rounds, "must be >= 1")
    _require(
        f.eval_every >= 1, "federation.eval_every", f.eval_every, "must be >= 1 (the last round is always evaluated)"
    )
    _require(0.0 < f.fraction_train <= 1.0, "federation.fraction_train", f.fraction_train, "must be in (0, 1]")
    _require(f.min_train_nodes >= 1, "federation.min_train_nodes", f.min_train_nodes, "must be >= 1")
    _require(
        0.0 <= f.fraction_evaluate <= 1.0, "federation.fraction_evaluate", f.fraction_evaluate, "must be in [0, 1]"
    )
    _require(f.min_evaluate_nodes >= 0, "federation.min_evaluate_nodes", f.min_evaluate_nodes, "must be >= 0")
    _require(
        f.min_available_nodes >= f.min_train_nodes,
        "federation.min_available_nodes",
        f.min_available_nodes,
        f"must be >= federation.min_train_nodes ({f.min_train_nodes})",
    )
    _require(f.node_wait_timeout_s > 0, "federation.node_wait_timeout_s", f.node_wait_timeout_s, "must be > 0")
    _require(f.round_wait_timeout_s > 0, "federation.round_wait_timeout_s", f.round_wait_timeout_s, "must be > 0")
    _require(f.round_timeout_s > 0, "federation.round_timeout_s", f.round_timeout_s, "must be > 0")
    _require(
        f.message_ttl_s >= f.round_timeout_s,
        "federation.message_ttl_s",
        f.message_ttl_s,
        f"must be >= federation.round_timeout_s ({f.round_timeout_s}) or messages expire mid-round",
    )

    _require(f.max_wall_time_s >= 0, "federation.max_wall_time_s", f.max_wall_time_s, "must be >= 0 (0 = no limit)")
    _require(
        f.max_examples_per_node >= 1,
        "federation.max_examples_per_node",
        f.max_examples_per_node,
        "must be an integer >= 1 (the most examples one node's reply may count for)",
    )
    _validate_task(cfg)

    m = cfg.simulation
    _require(m.num_supernodes >= 1, "simulation.num_supernodes", m.num_supernodes, "must be >= 1")
    _require(m.client_cpus >= 1, "simulation.client_cpus", m.client_cpus, "must be >= 1 (whole CPUs)")
    _require(m.client_gpus >= 0, "simulation.client_gpus", m.client_gpus, "must be >= 0 (0 = CPU only)")
    _require(bool(cfg.tracking.mlflow_experiment), "tracking.mlflow_experiment", "", "must not be empty")
    check_dir_name("sweep.name", cfg.sweep.name)
    _require(cfg.sweep.timeout_s >= 0, "sweep.timeout_s", cfg.sweep.timeout_s, "must be >= 0 (0 = no limit)")

    _require(cfg.seed >= 0, "seed", cfg.seed, "must be >= 0")
    if cfg.name is not None:
        check_dir_name("name", cfg.name)
    if cfg.resume == "auto":
        _require(
            bool(cfg.name), "resume", cfg.resume, "auto needs a run name (name=...): it resumes <output-dir>/<name>"
        )
    elif cfg.resume is not None:
        _require(Path(cfg.resume).is_file(), "resume", cfg.resume, "no such checkpoint file (or use resume=auto)")
    _require(
        bool(_DEVICE_RE.match(cfg.server_device)),
        "server_device",
        cfg.server_device,
        "allowed: auto, cpu, cuda, cuda:N",
    )
    return cfg


def _validate_local_devices(cfg: Config) -> None:
    d = cfg.train.local_devices
    ok = (
        d == "auto"
        or (type(d) is int and d >= 1)
        or (isinstance(d, list) and d and all(type(i) is int and i >= 0 for i in d))
    )
    _require(ok, "train.local_devices", d, "allowed: auto (every visible GPU), N >= 1, or a list of CUDA indices")
    _require(
        d == 1 or cfg.privacy.name != "local",
        "train.local_devices",
        d,
        "privacy=local trains on one device: DP-SGD's accounting assumes one Poisson-sampled "
        "batch per step, which ranks sampling apart would break",
    )


def _require_target(key: str, value: str | None) -> None:
    """A `_target_` must be a dotted path; whether it imports is checked where it is called,
    before round 1 (app/task/user_code.py)."""
    _require(
        bool(value) and _TARGET_RE.fullmatch(str(value)) is not None,
        key,
        value,
        "give the dotted path of a callable, e.g. my_pkg.module.function",
    )


# A metric's name becomes a metrics.jsonl column and a reply key (eval-<name>): a plain word,
# and not one of the row's other columns (ROW_COLUMNS), which would overwrite it.
_METRIC_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


def _metric_names(metrics: list[Any]) -> list[str]:
    """The name of each `task.metrics` entry (`metric_name`), checked."""
    names = []
    for i, entry in enumerate(metrics):
        key = f"task.metrics[{i}]"
        if isinstance(entry, Mapping):
            _require_target(f"{key}._target_", entry.get("_target_"))
            name = entry.get("name")
            _require(name is None or isinstance(name, str), f"{key}.name", name, "must be a string")
            name = metric_name(entry)
        else:
            _require(
                entry in BUILTIN_METRICS,
                key,
                entry,
                f"allowed: {', '.join(BUILTIN_METRICS)}, or {{_target_: my_pkg.module.metric, name: ...}}",
            )
            name = entry
        _require(
            _METRIC_NAME_RE.fullmatch(name) is not None,
            f"{key}.name",
            name,
            "a metric's name is a metrics.jsonl column: letters, digits, '_', '.', '-', starting with a letter",
        )
        _require(
            name not in ROW_COLUMNS,
            f"{key}.name",
            name,
            f"{name!r} is already a metrics.jsonl column of every run (it would be overwritten); name the metric "
            f"otherwise, e.g. {{_target_: ..., name: my_{name}}}",
        )
        names.append(name)
    return names


def _validate_task(cfg: Config) -> None:
    """task.loss, task.metrics and the stopping target they define. Normalises the target:
    afterwards federation.target_metric names a metric (the primary one when unset) and
    federation.target_value holds the value to reach (federation.target_accuracy, the older
    spelling, moved there). Idempotent: validating twice accepts what the first pass set."""
    t = cfg.task
    if t.loss.target is not None:
        _require_target("task.loss._target_", t.loss.target)
    metrics = list(t.metrics)
    _require(bool(metrics), "task.metrics", metrics, "name at least one metric, e.g. [accuracy] (the first is primary)")
    names = _metric_names(metrics)
    dupes = sorted({n for n in names if names.count(n) > 1})
    _require(
        not dupes, "task.metrics", metrics, f"metric names must be unique ({', '.join(dupes)}); set each one's name"
    )

    f = cfg.federation
    _require(
        0 <= f.target_accuracy <= 1, "federation.target_accuracy", f.target_accuracy, "must be in [0, 1] (0 = off)"
    )
    if f.target_accuracy > 0:
        _require(
            f.target_value in (0, f.target_accuracy) and f.target_metric in (None, "accuracy"),
            "federation.target_accuracy",
            f.target_accuracy,
            "it is the older spelling of federation.target_metric=accuracy federation.target_value=...; set one or the "
            f"other (federation.target_metric={f.target_metric!r}, federation.target_value={f.target_value!r})",
        )
        _require(
            "accuracy" in names,
            "federation.target_accuracy",
            f.target_accuracy,
            f"needs accuracy among task.metrics ({', '.join(names)}); "
            "use federation.target_metric=<name> federation.target_value=...",
        )
        f.target_metric, f.target_value = "accuracy", f.target_accuracy
    if f.target_metric is None:
        f.target_metric = names[0]
    _require(
        f.target_metric in names,
        "federation.target_metric",
        f.target_metric,
        f"allowed: the names of task.metrics ({', '.join(names)}); unset = the first (primary) one",
    )
    _require(
        0 <= f.target_value < float("inf"),
        "federation.target_value",
        f.target_value,
        f"must be a finite number >= 0: stop once {f.target_metric} reaches it (metrics are higher-is-better); 0 = off",
    )
    _require(
        f.target_value <= 1 or f.target_metric not in BUILTIN_METRICS,
        "federation.target_value",
        f.target_value,
        f"{f.target_metric} is at most 1, so the run would never stop for it; 0 = off",
    )


def _validate_model(cfg: Config) -> None:
    m = cfg.model
    _one_of("model.name", m.name, MODELS)
    _require(m.width >= 1, "model.width", m.width, "must be >= 1")
    if m.name == "resnet18":
        _require(m.width == 64, "model.width", m.width, "model=resnet18 is 64 wide (torchvision)")
    if m.name == "torchvision":
        _require(
            bool(m.arch),
            "model.arch",
            m.arch,
            "model=torchvision needs a torchvision model name, e.g. mobilenet_v3_small",
        )
    if m.name == "custom":
        _require_target("model._target_", m.target)
    if m.init_weights is not None:
        _require(
            Path(m.init_weights).is_file(),
            "model.init_weights",
            m.init_weights,
            "no such file (a torch.save'd state_dict)",
        )
    _require(
        all(isinstance(p, str) and p and not p.startswith(".") and not p.endswith(".") for p in m.trainable),
        "model.trainable",
        m.trainable,
        "a list of parameter-name prefixes such as [fc] or [net.9]; [] trains the whole model",
    )


def _validate_fedbuff(s: StrategyConfig) -> None:
    _require(s.buffer_size >= 0, "strategy.buffer_size", s.buffer_size, "must be >= 1, or 0 (auto: half the nodes)")
    _require(s.concurrency >= 0, "strategy.concurrency", s.concurrency, "must be >= 0 (0 = every connected node)")
    _require(s.max_staleness >= 0, "strategy.max_staleness", s.max_staleness, "must be >= 0")
    _one_of("strategy.staleness_fn", s.staleness_fn, STALENESS_FUNCTIONS)
    _require(s.staleness_a >= 0, "strategy.staleness_a", s.staleness_a, "must be >= 0 (< 0 favours stale updates)")
    _require(s.staleness_b >= 0, "strategy.staleness_b", s.staleness_b, "must be >= 0")
    _require(s.server_lr > 0, "strategy.server_lr", s.server_lr, "must be > 0")
    _require(0 <= s.server_momentum < 1, "strategy.server_momentum", s.server_momentum, "must be in [0, 1)")
    _one_of("strategy.buffer_aggregator", s.buffer_aggregator, BUFFER_AGGREGATORS)


def _validate_privacy(cfg: Config) -> None:
    p = cfg.privacy
    _one_of("privacy.name", p.name, PRIVACY)
    if p.name == "none":
        return
    _require(p.noise_multiplier >= 0, "privacy.noise_multiplier", p.noise_multiplier, "must be >= 0")
    _require(p.clip_norm > 0, "privacy.clip_norm", p.clip_norm, "must be > 0")
    _require(0 < p.delta < 1, "privacy.delta", p.delta, "must be in (0, 1)")
    _require(p.max_epsilon >= 0, "privacy.max_epsilon", p.max_epsilon, "must be > 0, or 0 for no budget")
    _require(0 < p.target_quantile < 1, "privacy.target_quantile", p.target_quantile, "must be in (0, 1)")
    _require(p.clip_lr > 0, "privacy.clip_lr", p.clip_lr, "must be > 0")
    _require(p.count_noise >= 0, "privacy.count_noise", p.count_noise, "must be >= 0 (0 = expected cohort / 20)")
    _require(p.target_epsilon >= 0, "privacy.target_epsilon", p.target_epsilon, "must be > 0, or 0 to use the noise")
    if p.name.startswith("central"):
        s = cfg.strategy.name
        aggregator = cfg.strategy.buffer_aggregator if s == "fedbuff" else s
        _require(
            aggregator in ("fedavg", "mean"),
            "privacy.name",
            p.name,
            f"central DP has no standard sensitivity bound for {aggregator} (a robust rule's output can move by "
            "more than one clipped update); use strategy=fedavg or fedbuff with buffer_aggregator=mean, or privacy=local",
        )
        _require(p.noise_multiplier > 0, "privacy.noise_multiplier", p.noise_multiplier, "central DP needs noise > 0")
        _require(
            not (s == "fedbuff" and p.poisson_sampling),
            "privacy.poisson_sampling",
            True,
            "FedBuff releases are accounted with q = 1 (its cohort is whoever answers first)",
        )
        st = cfg.strategy
        _require(
            not (s == "fedbuff" and 0 < st.concurrency < st.buffer_size),
            "strategy.buffer_size",
            st.buffer_size,
            f"a central-DP buffer takes one update per node, but strategy.concurrency={st.concurrency} train at once",
        )
    if p.name == "local":
        _require(
            not (cfg.strategy.name == "fedbuff" and p.target_epsilon > 0),
            "privacy.target_epsilon",
            p.target_epsilon,
            "plans each client's noise over federation.rounds tasks, but a FedBuff node may train more often; "
            "with strategy=fedbuff set privacy.noise_multiplier instead (epsilon is still reported per client)",
        )
        _require(
            p.noise_multiplier > 0 or p.target_epsilon > 0,
            "privacy.noise_multiplier",
            p.noise_multiplier,
            "local DP-SGD needs noise > 0 or privacy.target_epsilon > 0",
        )


def _validate_fleet(cfg: Config) -> None:
    """The fleet profile (app/simulation/fleet.py); stragglers=... is its short form, not a second one."""
    f = cfg.fleet
    if f.name == "none":
        return
    _require(
        cfg.stragglers.name == "none" and cfg.stragglers.dropout == 0,
        "stragglers",
        cfg.stragglers.name,
        f"stragglers is the short form of a fleet profile; with fleet={f.name} set the slowdowns in "
        "fleet.speed / fleet.factors / fleet.sigma and drop-outs in fleet.completion_p",
    )
    _one_of("fleet.speed", f.speed, FLEET_SPEEDS)
    _one_of("fleet.availability", f.availability, AVAILABILITY)
    _require(f.reference_samples_per_s > 0, "fleet.reference_samples_per_s", f.reference_samples_per_s, "must be > 0")
    if f.speed == "fixed":
        _require(bool(f.factors), "fleet.factors", f.factors, "fleet.speed=fixed needs slowdowns, e.g. [5,5,5]")
    _require(all(x > 0 for x in f.factors), "fleet.factors", f.factors, "slowdowns must be > 0")
    _require(f.sigma >= 0, "fleet.sigma", f.sigma, "must be >= 0")
    if f.speed == "devices":
        _require(
            bool(f.devices), "fleet.devices", f.devices, "fleet.speed=devices needs device classes, e.g. [rtx4090,t4]"
        )
    _require(all(v > 0 for v in f.device_speeds.values()), "fleet.device_speeds", f.device_speeds, "must be > 0")
    for key in ("downlink_mbps", "uplink_mbps"):
        values = getattr(f, key)
        _require(bool(values) and all(v > 0 for v in values), f"fleet.{key}", values, "a non-empty list of rates > 0")
    _require(bool(f.latency_ms) and all(v >= 0 for v in f.latency_ms), "fleet.latency_ms", f.latency_ms, "values >= 0")
    _require(f.link_sigma >= 0, "fleet.link_sigma", f.link_sigma, "must be >= 0")
    _require(0 < f.completion_p <= 1, "fleet.completion_p", f.completion_p, "must be in (0, 1]")
    if f.availability == "trace":
        _require(bool(f.trace), "fleet.trace", f.trace, "fleet.availability=trace needs a CSV file (docs/fleet.md)")

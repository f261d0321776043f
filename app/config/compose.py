"""Compose `conf/` with a run's Hydra overrides and type-check the result.

Only the server side (ServerApp, sweeps, scripts) imports this module: it is the one
place that imports Hydra.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from app.config.schema import Config, ConfigError
from app.config.validate import validate

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Config nodes that name a callable with `_target_`: their other keys are its keyword arguments.
TARGET_NODES = ("model", "dataset", "task.loss")
# Keys that moved: a run config written for the old place gets the new one named.
MOVED = {"strategy.eval_every": "federation.eval_every"}


def config_groups() -> dict[str, list[str]]:
    """The option names of every config group under `conf/`."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(CONF_DIR.iterdir()) if d.is_dir()}


def split_overrides(overrides: str | list[str]) -> list[str]:
    """Split the run config's overrides string; quotes stay for Hydra to parse."""
    if isinstance(overrides, str):
        return shlex.split(overrides, posix=False)
    return list(overrides)


def _hydra_compose(items: list[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=items)
    finally:
        GlobalHydra.instance().clear()


def with_kwargs(items: list[str]) -> list[str]:
    """`model.hidden=256` for a `_target_` model means a keyword argument: Hydra would refuse the
    new key without a `+`, so such overrides become `++` (add or replace). Which nodes name a
    callable is read off the config composed from the group choices alone (presets included).
    Other sections keep Hydra's refusal of unknown keys (a typo is an error there)."""

    def node_of(item: str) -> str | None:
        key = item.partition("=")[0]
        if "=" not in item or item.startswith(("+", "~")):
            return None
        return next((n for n in TARGET_NODES if key.startswith(n + ".")), None)

    if not any(node_of(i) for i in items):
        return items
    try:
        base = _hydra_compose([i for i in items if "." not in i.lstrip("+~").partition("=")[0]])
    except (HydraException, OmegaConfBaseException):
        return items  # the full composition below reports what is wrong
    takes = set()
    for node in TARGET_NODES:
        sub = OmegaConf.select(base, node, default=None)
        if isinstance(sub, DictConfig) and "_target_" in sub.keys():  # `in sub` is False while it is ???
            takes.add(node)
    return ["++" + i if node_of(i) in takes else i for i in items]


def compose_config(overrides: str | list[str] = "") -> DictConfig:
    """Compose `conf/` with Hydra overrides; unknown groups, options or keys fail clearly."""
    items = split_overrides(overrides)
    groups = config_groups()
    for item in items:
        key, sep, value = item.lstrip("+~").partition("=")
        if key in MOVED:
            raise ConfigError(f"{key} is now {MOVED[key]}: write {MOVED[key]}={value}")
        if sep and key in groups and value not in groups[key]:
            raise ConfigError(f"{key}={value!r} is not a known {key} option; allowed: {', '.join(groups[key])}")
    items = with_kwargs(items)
    try:
        return _hydra_compose(items)
    except (HydraException, OmegaConfBaseException) as err:
        text = str(err)
        unknown = [i for i in items if f"override '{i.partition('=')[0]}'" in text]
        if unknown:
            key = unknown[0].partition("=")[0]
            group = key.partition(".")[0]
            chosen = next((i.partition("=")[2] for i in items if i.partition("=")[0] == group), None)
            where = f" of {group}={chosen}" if chosen else ""
            raise ConfigError(
                f"{key} is not a config key{where} (typo, or a key of another {group} option?); "
                f"the keys of each option are in conf/{group}/"
            ) from err
        raise ConfigError(f"bad override in {items}: {text.splitlines()[0]}") from err


# The keys of a `_target_` node that are the app's own; any other key is an argument of the callable.
OWN_KEYS = {
    "model": {"name", "init_weights", "trainable"},
    "dataset": {"name", "path", "hf_name", "image_key", "label_key", "test_fraction", "val_fraction"},
    "task.loss": set(),
}


def split_targets(tree: dict[str, Any]) -> dict[str, Any]:
    """A `_target_` node's `_target_` as `target` and its other keys (all but the app's own)
    as `kwargs`, the callable's keyword arguments."""
    for path in TARGET_NODES:
        parent, _, leaf = path.rpartition(".")
        node = (tree.get(parent, {}) if parent else tree).get(leaf)
        if not isinstance(node, dict) or "_target_" not in node:
            continue
        node["target"] = node.pop("_target_")
        args = {k: node.pop(k) for k in list(node) if k not in OWN_KEYS[path] | {"target", "kwargs"}}
        node["kwargs"] = {**node.get("kwargs", {}), **args}
    return tree


def to_typed(cfg: DictConfig) -> Config:
    """Check types against the schema (OmegaConf names the offending key)."""
    try:
        tree = split_targets(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))  # type: ignore[arg-type]
        merged = OmegaConf.merge(OmegaConf.structured(Config), tree)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except MissingMandatoryValue as err:
        key = getattr(err, "full_key", None) or "?"
        example = "my_pkg.module.function" if key.endswith("_target_") else "<value>"
        raise ConfigError(f"{key} is required here: set it, e.g. {key}={example}") from err
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"{key}: {str(getattr(err, 'msg', err)).splitlines()[0]}") from err


def load_config(overrides: str | list[str] = "") -> tuple[Config, DictConfig]:
    """Compose, type-check and validate; returns the typed config and the resolved tree."""
    raw = compose_config(overrides)
    return validate(to_typed(raw)), raw

"""Compose `conf/` with a run's Hydra overrides and type-check the result.

Only the server side (ServerApp, sweeps, scripts) imports this module: it is the one
place that imports Hydra.
"""

from __future__ import annotations

import difflib
import shlex
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from app.config.schema import Config, ConfigError
from app.config.validate import problem_block, validate

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Config nodes that name a callable with `_target_`: their other keys are its keyword arguments.
TARGET_NODES = ("model", "dataset", "task.loss")
# Keys that moved: a run config written for the old place gets the new one named.
MOVED = {"strategy.eval_every": "federation.eval_every"}
_ABSENT = object()


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


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _group_problems(items: list[str], groups: dict[str, list[str]]) -> list[str]:
    """Moved keys and unknown group options, each with what to write instead."""
    problems = []
    for item in items:
        key, sep, value = item.lstrip("+~").partition("=")
        if key in MOVED:
            problems.append(f"{key} is now {MOVED[key]}: write {MOVED[key]}={value}")
        elif sep and key in groups and value not in groups[key]:
            problems.append(
                f"{key}={value!r} is not a known {key} option{_did_you_mean(value, groups[key])} "
                f"(allowed: {', '.join(groups[key])})"
            )
    return problems


def _valid_choice(item: str, groups: dict[str, list[str]]) -> bool:
    """A group choice (`strategy=krum`, `~attack`) that names an existing option."""
    key, sep, value = item.lstrip("+~").partition("=")
    return key in groups and (not sep or value in groups[key])


def _key_problems(items: list[str], groups: dict[str, list[str]]) -> list[str]:
    """Plain `key=value` overrides whose key the config composed from the group choices lacks,
    each with the closest existing key. Keys of a `_target_` node are the callable's arguments
    (`++`, from `with_kwargs`), and `+`/`~` are explicit: those are Hydra's to judge."""
    plain = [i for i in items if "=" in i and not i.startswith(("+", "~"))]
    if not any("." in i.partition("=")[0] or i.partition("=")[0] not in groups for i in plain):
        return []
    try:
        base = _hydra_compose([i for i in items if _valid_choice(i, groups)])
    except (HydraException, OmegaConfBaseException):
        return []  # a group choice Hydra refuses: the full composition reports it
    problems = []
    for item in plain:
        key = item.partition("=")[0]
        if key in groups or OmegaConf.select(base, key, default=_ABSENT) is not _ABSENT:
            continue
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(base, parent, default=None) if parent else base
        if parent and not isinstance(node, DictConfig):
            top = parent.partition(".")[0]
            problems.append(f"{key}: {parent!r} is not a config section{_did_you_mean(top, list(base.keys()))}")
            continue
        siblings = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        hint = _did_you_mean(leaf, siblings)
        if not parent:
            hint = hint or _did_you_mean(leaf, list(groups))
            problems.append(f"{key} is not a config key or group{hint}")
            continue
        chosen = next((i.partition("=")[2] for i in items if i.partition("=")[0] == parent), None)
        where = f" of {parent}={chosen}" if chosen else (f" of {parent}" if parent in groups else "")
        more = f" (the keys of each {parent} option are in conf/{parent}/)" if parent in groups and not hint else ""
        problems.append(
            f"{key} is not a config key{where}{hint.replace('did you mean ', f'did you mean {parent}.')}{more}"
        )
    return problems


def compose_config(overrides: str | list[str] = "") -> DictConfig:
    """Compose `conf/` with Hydra overrides. Every unknown group, option or key is reported at
    once, each with the closest valid name, in one ConfigError without Hydra's traceback (its
    hint, `+key=value`, would add the typo as a new key)."""
    items = split_overrides(overrides)
    groups = config_groups()
    problems = _group_problems(items, groups)
    items = with_kwargs(items)
    problems += _key_problems(items, groups)
    if problems:
        raise ConfigError(problem_block(problems))
    try:
        return _hydra_compose(items)
    except (HydraException, OmegaConfBaseException) as err:
        first = str(err).splitlines()[0]
        raise ConfigError(f"bad override in {items}: {first}") from None


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
    """Check types against the schema; every offending key is named (OmegaConf stops at the
    first, so each one found is set aside and the check runs again)."""
    try:
        tree = split_targets(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))  # type: ignore[arg-type]
    except MissingMandatoryValue as err:
        key = getattr(err, "full_key", None) or "?"
        example = "my_pkg.module.function" if key.endswith("_target_") else "<value>"
        raise ConfigError(f"{key} is required here: set it, e.g. {key}={example}") from None
    problems: list[str] = []
    for _ in range(MAX_TYPE_ERRORS):
        try:
            typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), tree))
            break
        except OmegaConfBaseException as err:
            key = getattr(err, "full_key", None) or "?"
            problems.append(f"{key}: {str(getattr(err, 'msg', err)).splitlines()[0]}")
            if not _drop(tree, key):
                break
    if problems:
        raise ConfigError(problem_block(problems))
    return typed  # type: ignore[return-value]


MAX_TYPE_ERRORS = 50


def _drop(tree: dict[str, Any], key: str) -> bool:
    """Remove dotted `key` from `tree` (its schema default then applies); False if absent."""
    *path, leaf = key.split(".")
    for part in path:
        tree = tree.get(part) if isinstance(tree, dict) else None  # type: ignore[assignment]
    return isinstance(tree, dict) and tree.pop(leaf, _ABSENT) is not _ABSENT


def load_config(overrides: str | list[str] = "") -> tuple[Config, DictConfig]:
    """Compose, type-check and validate; returns the typed config and the resolved tree."""
    raw = compose_config(overrides)
    return validate(to_typed(raw)), raw

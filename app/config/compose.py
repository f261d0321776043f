"""Compose `conf/` with a run's Hydra overrides and type-check the result.

Only the server side (ServerApp, sweeps, scripts) imports this module: it is the one
place that imports Hydra.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from app.config.schema import Config, ConfigError
from app.config.validate import validate

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def config_groups() -> dict[str, list[str]]:
    """The option names of every config group under `conf/`."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(CONF_DIR.iterdir()) if d.is_dir()}


def split_overrides(overrides: str | list[str]) -> list[str]:
    """Split the run config's overrides string; quotes stay for Hydra to parse."""
    if isinstance(overrides, str):
        return shlex.split(overrides, posix=False)
    return list(overrides)


def compose_config(overrides: str | list[str] = "") -> DictConfig:
    """Compose `conf/` with Hydra overrides; unknown groups, options or keys fail clearly."""
    items = split_overrides(overrides)
    groups = config_groups()
    for item in items:
        key, sep, value = item.lstrip("+~").partition("=")
        if sep and key in groups and value not in groups[key]:
            raise ConfigError(f"{key}={value!r} is not a known {key} option; allowed: {', '.join(groups[key])}")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=items)
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
    finally:
        GlobalHydra.instance().clear()


def to_typed(cfg: DictConfig) -> Config:
    """Check types against the schema (OmegaConf names the offending key)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"{key}: {str(getattr(err, 'msg', err)).splitlines()[0]}") from err


def load_config(overrides: str | list[str] = "") -> tuple[Config, DictConfig]:
    """Compose, type-check and validate; returns the typed config and the resolved tree."""
    raw = compose_config(overrides)
    return validate(to_typed(raw)), raw

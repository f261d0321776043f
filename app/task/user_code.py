"""Calling the user's own code named by a `_target_` (model=custom, dataset=python, task.loss,
task.metrics): import it, call it with its keyword arguments, and turn every failure into a
ConfigError that names the config key.

Hydra's `instantiate` does the same on the server, but the ClientApp must not import Hydra
(a deployed SuperNode starts a fresh ClientApp process per message, and Hydra with OmegaConf
adds to every start), and it cannot hand a callable the values only the data knows (its
shape, its class count) when the callable asks for them. So this is `importlib` plus
`inspect`, the same lookup Hydra's `_locate` does: the longest importable module prefix,
then attributes.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from app.config.schema import ConfigError


def locate(path: str, key: str) -> Callable[..., Any]:
    """The callable at dotted `path` (`pkg.module.fn` or `pkg.module.Class.method`)."""
    parts = path.split(".") if path else []
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ConfigError(f"{key}={path!r} is invalid: give a dotted path such as my_pkg.module.function")
    error: Exception | None = None
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and not module_name.startswith(err.name):
                # the module exists but imports something missing: that is the user's error to see
                raise ConfigError(f"{key}={path!r}: importing {module_name} failed: {err}") from err
            error = err
            continue
        except Exception as err:  # noqa: BLE001 - any failure while importing user code
            raise ConfigError(f"{key}={path!r}: importing {module_name} failed: {type(err).__name__}: {err}") from err
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise ConfigError(f"{key}={path!r}: module {module_name} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        if not callable(obj):
            raise ConfigError(f"{key}={path!r} is a {type(obj).__name__}, not a callable")
        return obj
    raise ConfigError(
        f"{key}={path!r}: no module {parts[0]!r} can be imported ({error}). Install your package into the "
        "environment the ServerApp and ClientApps run in, or put your module inside the app directory "
        "(flwr run ships it); docs/own-task.md"
    )


def _parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature: offer nothing
        return {}


def call_parameters(key: str, path: str) -> set[str]:
    """The parameter names of the callable at `path`."""
    return set(_parameters(locate(path, key)))


def call(key: str, path: str, kwargs: Mapping[str, Any], offered: Mapping[str, Any] | None = None) -> Any:  # noqa: ANN401
    """Call the callable at `path` with `kwargs`, plus each `offered` value its signature names
    (and `kwargs` does not set): e.g. a model factory that declares `num_classes` gets it."""
    fn = locate(path, key)
    args = dict(kwargs)
    params = _parameters(fn)
    for name, value in (offered or {}).items():
        if name in params and name not in args:
            args[name] = value
    try:
        return fn(**args)
    except Exception as err:  # noqa: BLE001 - the user's code may raise anything; say where it came from
        given = ", ".join(sorted(args)) or "no arguments"
        raise ConfigError(f"{key}={path!r} failed when called with {given}: {type(err).__name__}: {err}") from err

"""Which Python environment runs the ServerApp: one log line at the start of every run, and
warnings when that environment is not the one the app being run was installed into.

Flower's local SuperLink (`flwr run` with `address = ":local:"`) is started once, from the
environment of the first `flwr run`, and then serves every later `flwr run` on the machine,
from any virtual environment or after a reinstall: the run executes with the packages of the
environment that started the SuperLink, silently. The line says which one it is;
`fedgpu-run` (app/tools/supervise.py) parses it (`parse_line`) and compares it with its own,
and `python -m app.tools.local_superlink` finds and stops that SuperLink.

What the ServerApp can check by itself: the app being run is the FAB's copy (its
pyproject.toml sits next to this package), so its version and requirements are known, and
the environment's installed fedgpu and packages can be compared with them. Reads only
package metadata (no torch import): cheap, and safe for the supervisor to import.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import sys
import tomllib
from dataclasses import dataclass, fields
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

from packaging.requirements import InvalidRequirement, Requirement

log = logging.getLogger("flwr.fedgpu." + __name__)

APP_DIR = Path(__file__).resolve().parents[2]  # the app being run: under Flower, the FAB's copy
MARK = "ServerApp environment:"
NONE = "-"  # a field with no value (shlex keeps an empty string, but "-" reads better)


@dataclass(frozen=True)
class Environment:
    """The ServerApp's Python environment and the app it runs, as logged (strings, "-" = none)."""

    python: str  # sys.executable
    prefix: str  # sys.prefix: the environment (a venv's directory); what the supervisor compares
    host: str  # socket.gethostname(): a prefix means something only on the same machine
    runtime_env: str  # Flower's per-run `uv sync` environment, whose packages come first
    fedgpu: str  # the installed distribution's version
    fedgpu_source: str  # an editable install's project directory
    app: str  # the version in the pyproject.toml of the app being run
    app_dir: str  # where the app being run lies (a FAB copy under $FLWR_HOME/apps/)
    flwr: str
    torch: str


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return NONE


def _editable_source(name: str) -> str:
    """The project directory of an editable install of `name` (PEP 610 direct_url.json)."""
    try:
        text = metadata.distribution(name).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return NONE
    try:
        info = json.loads(text or "{}")
    except ValueError:
        return NONE
    if not info.get("dir_info", {}).get("editable"):
        return NONE
    url = urlparse(info.get("url", ""))
    return unquote(url.path) if url.scheme == "file" else NONE


def _runtime_env() -> str:
    """Flower's per-run environment: with runtime dependency installation on, Flower `uv sync`s
    the app's requirements into a fresh directory, puts its site-packages first on sys.path and
    sets VIRTUAL_ENV to it, while sys.prefix stays the SuperLink's."""
    venv = os.environ.get("VIRTUAL_ENV", "")
    if not venv or Path(venv).resolve() == Path(sys.prefix).resolve():
        return NONE
    return venv if any(p.startswith(venv.rstrip("/") + "/") for p in sys.path) else NONE


def app_project(app_dir: Path = APP_DIR) -> dict:
    """The [project] table of the app's pyproject.toml ({} when there is none)."""
    try:
        return tomllib.loads((app_dir / "pyproject.toml").read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def describe(app_dir: Path = APP_DIR) -> Environment:
    """The environment of this process and the app in `app_dir`."""
    return Environment(
        python=sys.executable or NONE,
        prefix=sys.prefix,
        host=socket.gethostname(),
        runtime_env=_runtime_env(),
        fedgpu=_version("fedgpu"),
        fedgpu_source=_editable_source("fedgpu"),
        app=str(app_project(app_dir).get("version", NONE)),
        app_dir=str(app_dir),
        flwr=_version("flwr"),
        torch=_version("torch"),
    )


def format_line(env: Environment) -> str:
    """`ServerApp environment: python=... prefix=... ...`: key=value pairs, shell-quoted."""
    pairs = (f"{f.name.replace('_', '-')}={shlex.quote(getattr(env, f.name) or NONE)}" for f in fields(env))
    return f"{MARK} {' '.join(pairs)}"


def parse_line(line: str) -> Environment | None:
    """The Environment in `format_line`'s line, alone or after Flower's level prefix (`INFO :`);
    None for any other line (one that only quotes it, a node's error reason say)."""
    before, mark, rest = line.partition(MARK)
    if not mark or before.strip() not in ("", "INFO :"):
        return None
    try:
        pairs = dict(item.split("=", 1) for item in shlex.split(rest) if "=" in item)
    except ValueError:
        return None
    values = {f.name: pairs.get(f.name.replace("_", "-"), NONE) for f in fields(Environment)}
    return Environment(**values)


def unmet_requirements(requirements: list[str]) -> list[str]:
    """The requirements (PEP 508 strings) this environment does not satisfy, each with what is
    installed; markers that do not apply here are skipped."""
    unmet = []
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        installed = _version(req.name)
        if installed == NONE:
            unmet.append(f"{req.name}{req.specifier} (not installed)")
        elif not req.specifier.contains(installed, prereleases=True):
            unmet.append(f"{req.name}{req.specifier} (installed {installed})")
    return unmet


def mismatches(env: Environment, requirements: list[str]) -> list[str]:
    """Why this environment may not be the app's: each a sentence for a warning."""
    where = f"the environment that runs this ServerApp ({env.prefix})"
    found = []
    if env.fedgpu == NONE and env.runtime_env == NONE:
        found.append(
            f"fedgpu is not installed in {where}: it is not the one you installed the app into "
            "(`pip install -e .`); the local SuperLink serves every environment from the one that started it"
        )
    elif env.fedgpu != NONE and env.app != NONE and env.fedgpu != env.app:
        found.append(
            f"fedgpu {env.fedgpu} is installed in {where}, but the app being run is version {env.app}: "
            "the SuperLink runs the app with another installation's packages"
        )
    if unmet := unmet_requirements(requirements):
        found.append(f"{where} does not satisfy the app's requirements: {', '.join(unmet)}")
    return found


def log_environment(app_dir: Path = APP_DIR) -> Environment:
    """Log the environment line, and a warning for each mismatch; return the Environment."""
    env = describe(app_dir)
    log.info("%s", format_line(env))
    for problem in mismatches(env, [str(r) for r in app_project(app_dir).get("dependencies", [])]):
        log.warning(
            "%s. If this is the local SuperLink that `flwr run` started, stop it "
            "(python -m app.tools.local_superlink stop) and run again from the right environment.",
            problem,
        )
    return env

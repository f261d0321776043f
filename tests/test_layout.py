"""The package layout's rules (docs/architecture.md): imports point down, and the ClientApp,
a fresh process per message in deployment, loads neither Hydra nor the server's run or tools."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "strategies")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(module: str) -> set[str]:
    """Every module `module` imports, at the top or inside a function (lazy imports count: they run)."""
    path = MODULES[module]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from app.privacy import dp_sgd` imports a submodule
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)
    return found


def closure(start: str) -> set[str]:
    """`start` and everything it imports transitively, with each package's __init__ on the way."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in imports_of(module) if module in MODULES else ():
            parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
            todo.extend(n for n in (*parents, name) if n in MODULES or n.split(".")[0] not in PACKAGES)
    return seen


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


SERVER_ONLY = ("app.run", "app.tools", "app.config.compose", "app.server_app", "hydra", "omegaconf")


def test_the_walk_sees_lazy_imports() -> None:
    # The ClientApp imports Opacus's DP-SGD only inside its handlers; the walk must still find it.
    assert "app.privacy.dp_sgd" in closure("app.client_app")
    assert "hydra" in closure("app.config.compose")


def test_client_side_never_imports_server_run_tools_or_hydra() -> None:
    bad = sorted(m for m in closure("app.client_app") if under(m, *SERVER_ONLY))
    assert not bad, f"the ClientApp side imports {bad}"


def test_client_app_process_does_not_load_hydra() -> None:
    code = "import json, sys, app.client_app; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd=ROOT).stdout)
    assert "app.client_app" in loaded
    bad = [m for m in loaded if under(m, *SERVER_ONLY)]
    assert not bad, f"importing app.client_app loads {bad}"


# What the ClientApp may import (never Hydra's compose, the server's run or the tools).
CLIENT_SIDE = (
    "app.config",
    "app.protocol",
    "app.compression",
    "app.task",
    "app.privacy",
    "app.simulation",
    "strategies",
)
# Each package may import only the packages listed (and the standard library / third parties).
ALLOWED = {
    "strategies": ("strategies",),
    "app.config": ("app.config", "strategies"),
    "app.protocol": ("app.config", "strategies"),
    "app.compression": ("app.compression", "app.config", "app.protocol"),
    "app.ledger": ("app.ledger", "strategies"),
    "app.task": ("app.task", "app.config", "app.protocol", "strategies"),
    "app.simulation": ("app.simulation", "app.config", "app.protocol", "app.task", "strategies"),
    "app.privacy": ("app.privacy", "app.config", "app.protocol", "app.task", "strategies"),
    "app.client_app": CLIENT_SIDE,
    "app.run": ("app.run", "app.ledger", *CLIENT_SIDE),  # the server's run: what the client uses, the ledger, itself
    "app.server_app": ("app.run", "app.config", "app.task", "strategies"),
    "app.tools": ("app", "strategies"),
}


def owner(module: str) -> str:
    return max((p for p in ALLOWED if under(module, p)), key=len, default="app")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m not in ("app",)))
def test_imports_point_down(module: str) -> None:
    allowed = ALLOWED.get(owner(module))
    if allowed is None:  # python -m entry points (app/sweep.py ...): thin wrappers of app.tools
        allowed = ("app.tools",)
    ours = [m for m in imports_of(module) if m.split(".")[0] in PACKAGES]
    bad = sorted(m for m in ours if not under(m, *allowed))
    assert not bad, f"{module} ({owner(module)}) imports {bad}; allowed: {allowed}"

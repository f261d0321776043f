"""Installable where users are: pyproject.toml's ranges, constraints.txt's exact set, and the
code on every Python the project admits (requires-python >= 3.11, Flower's own floor).

CI runs on 3.11. For 3.12 and 3.13 a full install would mean a multi-GB torch download, so
these tests do what costs nothing and needs no network: every module of the project is
compiled by that interpreter (warnings as errors, so 3.12's invalid-escape SyntaxWarning
counts), and every module that needs only the standard library is imported there. A missing
interpreter is a skip with the reason. scripts/check_python_versions.sh adds the resolution
check (does pyproject + constraints.txt resolve to wheels for 3.12/3.13?), which needs PyPI.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PACKAGES = ("app", "strategies", "hydra_plugins")  # what the wheel ships
SOURCES = (*PACKAGES, "scripts", "bench")  # everything that must at least compile
NEWER_PYTHONS = ("3.12", "3.13")


def _requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    for group in PROJECT.get("optional-dependencies", {}).values():
        reqs += [Requirement(r) for r in group]
    return reqs


def _constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        assert m, f"constraints.txt:{n}: {line!r} is not an exact NAME==VERSION pin"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"constraints.txt:{n}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


# ----------------------------------------------------------------------------- metadata


def test_requires_python_is_flowers_floor() -> None:
    assert PROJECT["requires-python"] == ">=3.11"
    spec = SpecifierSet(PROJECT["requires-python"])
    assert all(v in spec for v in ("3.11.7", *(f"{v}.0" for v in NEWER_PYTHONS)))


def test_every_dependency_is_pinned_in_constraints_within_its_range() -> None:
    """constraints.txt and pyproject.toml cannot drift: each requirement (extras included) has
    an exact pin, and the pin is a version its range admits."""
    pins = _constraints()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is in pyproject.toml but not in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {req}"


def test_torch_range_admits_the_build_on_disk() -> None:
    """torch 2.14.1 lies on this project's machines' disks; a range that excluded it would make
    `pip install -e .` download several GB of CUDA wheels instead."""
    (torch,) = [r for r in _requirements() if canonicalize_name(r.name) == "torch"]
    assert torch.specifier.contains("2.14.1")
    assert _constraints()["torch"] == "2.14.1"


def test_ci_and_docker_install_from_constraints() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"(?m)^pip install -e \"\.\[test\]\" -c constraints\.txt$", ci), "CI must install with -c"
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"(?m)^COPY .*\bconstraints\.txt\b.* /opt/fedgpu/$", dockerfile)
    assert "-c /opt/fedgpu/constraints.txt /opt/fedgpu" in dockerfile


# ----------------------------------------------------------------------------- newer Pythons


@cache
def _interpreter(version: str) -> str | None:
    """A working `python<version>`: on PATH, in /usr(/local)/bin, or a pyenv version."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python{version}"), f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    candidates += sorted(glob.glob(str(pyenv / f"{version}.*" / "bin" / f"python{version}")), reverse=True)
    for candidate in filter(None, candidates):
        try:  # a pyenv shim for a version that is not selected exits non-zero
            out = subprocess.run(
                [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return candidate
    return None


def _need(version: str) -> str:
    python = _interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} interpreter here (PATH, /usr/bin, /usr/local/bin, pyenv)")
    return python


def _sources() -> list[Path]:
    return sorted(p for d in SOURCES for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_at_import_time(path: Path) -> set[str]:
    """Absolute names of the modules `path` imports when it is imported (not inside functions)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)  # may be submodules
            visit(child)

    visit(tree)
    return found


def stdlib_only_modules() -> list[str]:
    """Project modules whose import (parents and project imports included) needs only the
    standard library: the part of the code that a bare interpreter can import."""
    modules = {_module_name(p): p for d in PACKAGES for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts}
    own = {name.split(".")[0] for name in modules}
    direct = {name: _imports_at_import_time(path) for name, path in modules.items()}

    @cache
    def ok(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in seen:
            return True
        parts = name.split(".")
        needs = {".".join(parts[:i]) for i in range(1, len(parts))} | direct[name]
        for dep in needs:
            top = dep.split(".")[0]
            if top in own:
                if dep in modules and not ok(dep, seen | {name}):
                    return False
            elif top not in sys.stdlib_module_names:
                return False
        return True

    return sorted(name for name in modules if ok(name))


def test_the_stdlib_only_set_is_meaningful() -> None:
    """The import check below covers the torch-free core (config schema, wire protocol,
    staleness maths), and the analysis does see third-party imports."""
    modules = stdlib_only_modules()
    assert {"app.config.schema", "app.protocol", "strategies.staleness"} <= set(modules), modules
    assert "app.client_app" not in modules and "app.task.training" not in modules


@pytest.mark.parametrize("version", NEWER_PYTHONS)
def test_every_module_compiles_on_newer_python(version: str) -> None:
    python = _need(version)
    script = (
        "import sys\n"
        "bad = []\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        compile(open(path, encoding='utf-8').read(), path, 'exec')\n"
        "    except (SyntaxError, Warning) as err:\n"
        "        bad.append(f'{path}: {type(err).__name__}: {err}')\n"
        "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n"
    )
    files = [str(p) for p in _sources()]
    proc = subprocess.run(
        [python, "-I", "-W", "error", "-c", script, *files], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"Python {version} cannot compile:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("version", NEWER_PYTHONS)
def test_stdlib_only_modules_import_on_newer_python(version: str) -> None:
    python = _need(version)
    modules = stdlib_only_modules()
    # -I: no site-packages, no PYTHONPATH, no user site: the standard library and the checkout only
    script = "import importlib, sys\nsys.path.insert(0, sys.argv[1])\nfor name in sys.argv[2:]:\n    importlib.import_module(name)\n"
    proc = subprocess.run(
        [python, "-I", "-B", "-W", "error", "-c", script, str(ROOT), *modules],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"Python {version} cannot import {modules}:\n{proc.stderr}"

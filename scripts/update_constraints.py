"""Write constraints.txt: the exact versions, in this environment, of everything fedgpu needs.

    pip install -e ".[test,mlflow]" -c constraints.txt   # or without -c, to take upgrades
    python scripts/update_constraints.py                 # rewrites constraints.txt
    python scripts/update_constraints.py --check         # exit 1 if it would change

It walks pyproject.toml's requirements (every extra included) through the installed
packages' own metadata, with environment markers evaluated for this interpreter and
platform, and pins each package it reaches to its installed version: `pip freeze`
restricted to the project's dependency closure. Packages that only other platforms or
Pythons need stay unpinned there (a constraints file never installs anything itself).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
CONSTRAINTS = ROOT / "constraints.txt"


def project_requirements(pyproject: Path = PYPROJECT) -> list[Requirement]:
    """The project's requirements: dependencies plus every optional-dependency group."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    for group in project.get("optional-dependencies", {}).values():
        reqs += [Requirement(r) for r in group]
    return reqs


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    env = default_environment()
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in extras or {""})


def closure(roots: list[Requirement]) -> dict[str, str]:
    """{canonical name: installed version} of `roots` and everything they need here."""
    pins: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    todo = [(req, {""}) for req in roots]
    while todo:
        req, parent_extras = todo.pop()
        if not _applies(req, parent_extras):
            continue
        name = canonicalize_name(req.name)
        extras = {canonicalize_name(e) for e in req.extras}
        if name in pins and extras <= extras_seen[name]:
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            sys.exit(f"{req.name} is required ({req}) but not installed: pip install -e '.[test,mlflow]' first")
        pins[name] = dist.version
        extras_seen[name] = extras_seen.get(name, set()) | extras
        todo += [(Requirement(r), extras_seen[name]) for r in dist.requires or []]
    pins.pop(canonicalize_name(tomllib.loads(PYPROJECT.read_text())["project"]["name"]), None)
    return pins


def render(pins: dict[str, str]) -> str:
    header = f"""\
# Exact versions of everything fedgpu needs (dependencies and every extra), as installed
# where the test suite passed: Python {platform.python_version()}, {sys.platform} {platform.machine()}.
# pyproject.toml holds the ranges the code supports; this file is the set CI and the Docker
# images install (pip install -e ".[test]" -c constraints.txt), so installs are reproducible.
# Packages needed only on other platforms or Pythons are not listed (pip then resolves them).
#
# Regenerate after an upgrade (only the project's dependency closure is written, so any
# environment that holds the project will do):
#   pip install -e ".[test,mlflow]" --upgrade   # or pip install NAME==VERSION -c constraints.txt
#   python scripts/update_constraints.py        # `--check` fails if this file is stale
"""
    return header + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if constraints.txt differs, write nothing")
    parser.add_argument("--out", type=Path, default=CONSTRAINTS)
    args = parser.parse_args()
    text = render(closure(project_requirements()))
    if args.check:
        old = args.out.read_text() if args.out.exists() else ""
        strip = lambda t: [line for line in t.splitlines() if not line.startswith("#")]  # noqa: E731
        if strip(old) != strip(text):
            sys.exit(f"{args.out} is stale: run python scripts/update_constraints.py")
        print(f"{args.out} is up to date")
        return
    args.out.write_text(text)
    print(f"wrote {args.out}: {text.count('==')} pins")


if __name__ == "__main__":
    main()

"""The package layout as docs/architecture.md states it, and nothing more.

The page's "Package layers" section has two tables: the imports between packages (exact:
every entry used, no other) and the module rules (what the ClientApp side reaches, where
Hydra may be imported, which modules stay on the standard library). This file holds the
same two tables (LAYERS, MODULE_RULES), fails if they and the page differ, and checks the
code against them. The page's "Modules" table must name every module of app/ and
strategies/, and every path on the page must exist.

Imports are read with `ast` from every `import` statement in a module, lazy ones inside
functions included (they run); `importlib` calls are not seen. Each check is a function
returning its violations, so that `test_the_checks_catch_violations` can show it failing on
a synthetic import graph.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("app", "strategies")

# --- the tables docs/architecture.md states ("Package layers") ---------------------------

# package -> the packages it imports besides itself: exactly these (each used by some module).
LAYERS: dict[str, frozenset[str]] = {
    "strategies/": frozenset(),
    "app/config/": frozenset({"strategies/"}),
    "app/protocol.py": frozenset({"app/config/", "strategies/"}),
    "app/task/": frozenset({"app/config/", "app/protocol.py"}),
    "app/compression/": frozenset({"app/config/", "app/protocol.py", "app/task/"}),
    "app/simulation/": frozenset({"app/config/", "app/protocol.py", "strategies/"}),
    "app/privacy/": frozenset({"app/config/", "app/protocol.py", "app/task/", "strategies/"}),
    "app/ledger/": frozenset(),
    "app/secagg/": frozenset({"app/privacy/", "app/protocol.py", "strategies/"}),
    "app/regions/": frozenset({"app/compression/", "app/config/", "app/protocol.py", "app/simulation/", "strategies/"}),
    "app/status/": frozenset({"app/config/", "app/protocol.py"}),
    "app/live/": frozenset({"app/status/"}),
    "app/client_app.py": frozenset(
        {
            "app/compression/",
            "app/ledger/",
            "app/privacy/",
            "app/protocol.py",
            "app/regions/",
            "app/secagg/",
            "app/simulation/",
            "app/status/",
            "app/task/",
            "strategies/",
        }
    ),
    "app/run/": frozenset(
        {
            "app/compression/",
            "app/config/",
            "app/ledger/",
            "app/privacy/",
            "app/protocol.py",
            "app/regions/",
            "app/secagg/",
            "app/simulation/",
            "app/status/",
            "app/task/",
            "strategies/",
        }
    ),
    "app/server_app.py": frozenset({"app/config/", "app/run/", "app/task/", "strategies/"}),
    "app/tools/": frozenset(
        {"app/client_app.py", "app/config/", "app/ledger/", "app/run/", "app/simulation/", "app/status/", "strategies/"}
    ),
    "app/sweep.py": frozenset({"app/tools/"}),
    "app/report.py": frozenset({"app/tools/"}),
    "app/compare_runs.py": frozenset({"app/tools/"}),
    "app/supervise.py": frozenset({"app/tools/"}),
}

CLIENT_STRATEGIES = frozenset(
    f"strategies/{m}.py"
    for m in ("budget", "keys", "node_names", "node_text", "opacus_logging", "registry", "replies", "tensor_ops")
)
SERVER_STRATEGIES = frozenset(
    f"strategies/{m}.py"
    for m in (
        "bulyan",
        "central_dp",
        "coordinatewise",
        "fedavg",
        "fedbuff",
        "interface",
        "krum",
        "liveness",
        "node_wait",
        "norm_bound",
        "partitions",
        "regional",
        "robust",
        "robust_ops",
        "scaffold",
        "server_opt",
        "settings",
        "staleness",
        "streaming",
    )
)
MODULE_RULES: dict[str, frozenset[str]] = {
    # app/client_app.py and everything it imports, transitively, never reach these
    "client never": frozenset(
        {"app/run/", "app/tools/", "app/server_app.py", "app/config/compose.py", "hydra", "omegaconf"}
    ),
    # the only strategies/ modules the ClientApp side reaches ...
    "client strategies": CLIENT_STRATEGIES,
    # ... and every other one (each strategies/ module is in exactly one of the two)
    "server strategies": SERVER_STRATEGIES,
    # `import app.client_app` in a fresh interpreter loads none of these
    "fresh client process": frozenset(
        {"app/run/", "app/tools/", "app/privacy/", "app/compression/", "hydra", "omegaconf", "opacus", "torchvision"}
    ),
    # the only modules that import hydra or omegaconf are in these
    "Hydra": frozenset({"app/config/compose.py", "app/run/", "app/tools/"}),
    # these and their transitive imports: the standard library and app/ / strategies/ only
    "standard library only": frozenset(
        {
            "app/config/schema.py",
            "app/config/registry.py",
            "app/protocol.py",
            "strategies/registry.py",
            "strategies/keys.py",
            "strategies/budget.py",
        }
    ),
}


def dotted(path: str) -> str:
    """`app/run/` -> app.run, `app/protocol.py` -> app.protocol, `hydra` -> hydra."""
    return path.rstrip("/").removesuffix(".py").replace("/", ".")


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# --- the code's imports -----------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_in(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """Every module `module` imports, at the top or inside a function (relative imports resolved)."""
    known = set(known)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            found.add(source)
            # `from app.privacy import dp_sgd` imports a submodule
            found.update(f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known)
    found.discard("")
    return found


IMPORTS: dict[str, set[str]] = {m: imports_in(m, p, MODULES) for m, p in MODULES.items()}


def ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def closure(start: str, imports: Mapping[str, set[str]] = IMPORTS) -> set[str]:
    """`start` and everything it imports transitively, with each package's __init__ on the way."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in imports.get(module, ()):
            parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
            todo.extend(n for n in (*parents, name) if n in imports or not ours(n))
    return seen


def layer_of(module: str) -> str | None:
    """The LAYERS entry `module` belongs to (the longest that contains it); None for the bare
    `app` namespace; the module itself when no entry covers it."""
    if module == "app":  # app/__init__.py, a docstring
        return None
    found = [layer for layer in LAYERS if under(module, dotted(layer))]
    return max(found, key=len) if found else module


# --- the checks: each returns its violations --------------------------------------------


def layer_violations(imports: Mapping[str, set[str]] = IMPORTS) -> dict[str, list[str]]:
    """Per LAYERS entry: imports of a package it does not list, and listed ones nobody uses."""
    used: dict[str, dict[str, set[str]]] = {layer: {} for layer in LAYERS}
    out: dict[str, list[str]] = {layer: [] for layer in LAYERS}
    for module, names in imports.items():
        layer = layer_of(module)
        if layer is None:
            continue
        if layer not in LAYERS:
            out.setdefault(layer, []).append(f"{module} is in no package of the table")
            continue
        for name in filter(ours, names):
            target = layer_of(name)
            if target is not None and target != layer:
                used[layer].setdefault(target, set()).add(module)
    for layer, allowed in LAYERS.items():
        for target, by in sorted(used[layer].items()):
            if target not in allowed:
                out[layer].append(f"imports {target} (in {sorted(by)}), which the table does not list")
        for target in sorted(allowed - used[layer].keys()):
            out[layer].append(f"the table lists {target}, which no module of it imports")
    return {layer: problems for layer, problems in out.items() if problems}


def client_closure(imports: Mapping[str, set[str]] = IMPORTS) -> set[str]:
    return closure("app.client_app", imports)


def client_never_violations(imports: Mapping[str, set[str]] = IMPORTS) -> list[str]:
    never = [dotted(p) for p in MODULE_RULES["client never"]]
    return sorted(m for m in client_closure(imports) if under(m, *never))


def client_strategies_violations(imports: Mapping[str, set[str]] = IMPORTS) -> list[str]:
    allowed = {dotted(p) for p in MODULE_RULES["client strategies"]}
    reached = (m for m in client_closure(imports) if under(m, "strategies") and m != "strategies")
    return sorted(m for m in reached if m not in allowed)


def fresh_process_violations(loaded: Iterable[str]) -> list[str]:
    never = [dotted(p) for p in MODULE_RULES["fresh client process"]]
    return sorted(m for m in loaded if under(m, *never))


def hydra_violations(imports: Mapping[str, set[str]] = IMPORTS) -> list[str]:
    allowed = [dotted(p) for p in MODULE_RULES["Hydra"]]
    return sorted(
        f"{module} imports {name}"
        for module, names in imports.items()
        for name in names
        if under(name, "hydra", "omegaconf") and not under(module, *allowed)
    )


def stdlib_violations(imports: Mapping[str, set[str]] = IMPORTS) -> list[str]:
    out = []
    for path in sorted(MODULE_RULES["standard library only"]):
        outside = {n.split(".")[0] for n in closure(dotted(path), imports) if not ours(n)}
        out += [f"{path} reaches {top}" for top in sorted(outside - set(sys.stdlib_module_names))]
    return out


# --- the page ---------------------------------------------------------------------------

TOKEN = re.compile(r"`([^`]+)`")


def section(text: str, title: str) -> list[str]:
    """The lines of `## title` up to the next `## ` heading."""
    lines = text.splitlines()
    start = lines.index(f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def tables(lines: list[str]) -> dict[str, list[list[str]]]:
    """Each markdown table in `lines`, by its first header cell: its body rows' cells."""
    found: dict[str, list[list[str]]] = {}
    rows: list[list[str]] = []
    for line in [*lines, ""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            found[rows[0][0]] = rows[2:]
            rows = []
    return found


def stated_rules(text: str) -> tuple[dict[str, frozenset[str]], dict[str, frozenset[str]]]:
    """The page's two tables in "Package layers": (layers, module rules)."""
    found = tables(section(text, "Package layers"))
    layers: dict[str, frozenset[str]] = {}
    for row in found["package"]:
        for package in TOKEN.findall(row[0]):
            layers[package] = frozenset(TOKEN.findall(row[1]))
    rules = {}
    for row in found["rule"]:
        name = re.match(r"\*\*(.+?)\*\*", row[0])
        assert name, f"a module rule without its **name**: {row[0]}"
        rules[name.group(1)] = frozenset(TOKEN.findall(row[1]))
    return layers, rules


def mapped_modules(text: str) -> set[str]:
    """The modules the "Modules" table names: a package's file column, or a module row itself."""
    named = set()
    for row in tables(section(text, "Modules"))["package"]:
        for path in TOKEN.findall(row[0]):
            if path.endswith(".py"):
                named.add(dotted(path))
            else:
                files = [f for f in TOKEN.findall(row[2]) if re.fullmatch(r"\w+\.py", f)]
                named.update(f"{dotted(path)}.{f.removesuffix('.py')}" for f in files)
    return named


def package_markers() -> set[str]:
    return {m for m, p in MODULES.items() if p.name == "__init__.py"}


def map_violations(text: str, modules: Iterable[str]) -> list[str]:
    named, real = mapped_modules(text), set(modules) - package_markers()
    return [f"{m} is not in the Modules table" for m in sorted(real - named)] + [
        f"the Modules table names {m}, which does not exist" for m in sorted(named - real)
    ]


def missing_paths(text: str) -> list[str]:
    paths = {p.rstrip(".") for p in re.findall(r"\b(?:app|strategies)/[\w/.]*", text)}
    return sorted(p for p in paths if not (ROOT / p).exists())


# --- the tests --------------------------------------------------------------------------


def test_the_page_states_this_files_tables() -> None:
    layers, rules = stated_rules(DOC.read_text(encoding="utf-8"))
    assert layers == LAYERS, "docs/architecture.md's package table and LAYERS differ"
    assert rules == MODULE_RULES, "docs/architecture.md's module rules and MODULE_RULES differ"


def test_the_walk_sees_lazy_imports() -> None:
    # The ClientApp imports Opacus's DP-SGD only inside its handlers; the walk must still find it.
    assert "app.privacy.dp_sgd" in client_closure()
    assert "hydra" in closure("app.config.compose")


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_package_imports_are_the_table(layer: str) -> None:
    problems = layer_violations().get(layer, [])
    assert not problems, f"{layer}: " + "; ".join(problems) + " (change the code, or docs/architecture.md and LAYERS)"


def test_every_module_is_in_a_package_of_the_table() -> None:
    uncovered = sorted(m for m in MODULES if layer_of(m) not in (*LAYERS, None))
    assert not uncovered, f"modules in no package of docs/architecture.md's table: {uncovered}"


def test_client_side_never_imports_server_run_tools_or_hydra() -> None:
    bad = client_never_violations()
    assert not bad, f"the ClientApp side imports {bad}"


def test_client_side_reaches_only_the_shared_strategies_modules() -> None:
    bad = client_strategies_violations()
    assert not bad, f"the ClientApp side imports server strategies modules {bad}"


def test_every_strategies_module_is_client_or_server() -> None:
    real = {f"strategies/{p.name}" for p in (ROOT / "strategies").glob("*.py") if p.name != "__init__.py"}
    assert not CLIENT_STRATEGIES & SERVER_STRATEGIES, "a strategies module in both rows"
    assert CLIENT_STRATEGIES | SERVER_STRATEGIES == real, (
        f"unclassified: {sorted(real - CLIENT_STRATEGIES - SERVER_STRATEGIES)}; "
        f"gone: {sorted(CLIENT_STRATEGIES | SERVER_STRATEGIES - real)}"
    )


def test_client_app_process_loads_nothing_it_must_not() -> None:
    code = "import json, sys, app.client_app; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd=ROOT).stdout)
    assert "app.client_app" in loaded
    bad = fresh_process_violations(loaded)
    assert not bad, f"importing app.client_app loads {bad}"


def test_only_config_compose_run_and_tools_import_hydra() -> None:
    bad = hydra_violations()
    assert not bad, f"Hydra imported elsewhere: {bad}"


def test_standard_library_only_modules() -> None:
    bad = stdlib_violations()
    assert not bad, f"dependency-free modules import third-party packages: {bad}"


def test_the_module_map_names_every_module() -> None:
    bad = map_violations(DOC.read_text(encoding="utf-8"), MODULES)
    assert not bad, "docs/architecture.md's Modules table: " + "; ".join(bad)


def test_every_path_on_the_page_exists() -> None:
    bad = missing_paths(DOC.read_text(encoding="utf-8"))
    assert not bad, f"docs/architecture.md names paths that do not exist: {bad}"


def test_package_markers_hold_only_a_docstring() -> None:
    bad = []
    for module in sorted(package_markers()):
        body = ast.parse(MODULES[module].read_text(encoding="utf-8")).body
        if len(body) != 1 or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Constant):
            bad.append(str(MODULES[module].relative_to(ROOT)))
    assert not bad, f"__init__.py files with code (name it in docs/architecture.md's Modules table): {bad}"


def test_the_checks_catch_violations() -> None:
    """Each check fails on a synthetic import graph with one forbidden import, so none of them
    passes vacuously."""

    def plus(module: str, *names: str) -> dict[str, set[str]]:
        return {**IMPORTS, module: IMPORTS[module] | set(names)}

    assert "strategies/" in layer_violations(plus("strategies.keys", "app.run.federation"))
    assert "app/ledger/" in layer_violations(plus("app.ledger.chain", "app.task.data"))
    unused = {**IMPORTS, **{m: set() for m in MODULES if layer_of(m) == "app/server_app.py"}}
    assert "app/server_app.py" in layer_violations(unused)  # listed imports nobody uses
    assert "app.newpkg.x" in layer_violations({**IMPORTS, "app.newpkg.x": set()})
    assert "app.run.factory" in client_never_violations(plus("app.task.data", "app.run.factory"))
    assert "hydra" in client_never_violations(plus("app.protocol", "hydra"))
    assert client_strategies_violations(plus("app.task.models", "strategies.fedavg"))
    assert fresh_process_violations(["app.client_app", "omegaconf.dictconfig", "app.privacy.dp_sgd"]) == [
        "app.privacy.dp_sgd",
        "omegaconf.dictconfig",
    ]
    assert "app.task.data imports omegaconf" in hydra_violations(plus("app.task.data", "omegaconf"))
    stdlib = stdlib_violations(plus("strategies.keys", "torch"))
    assert {"strategies/keys.py reaches torch", "app/protocol.py reaches torch"} <= set(stdlib)  # protocol imports keys

    def edited(old: str, new: str) -> str:
        text = DOC.read_text(encoding="utf-8")
        assert old in text, f"docs/architecture.md no longer has {old!r}: update this test's edit"
        return text.replace(old, new)

    ledger_row = "| `app/ledger/` | nothing |"
    assert stated_rules(edited(ledger_row, "| `app/ledger/` | `strategies/` |"))[0] != LAYERS
    assert stated_rules(edited("`omegaconf`, `opacus`", "`opacus`"))[1] != MODULE_RULES
    text = DOC.read_text(encoding="utf-8")
    assert "app.run.extra is not in the Modules table" in map_violations(text, [*MODULES, "app.run.extra"])
    assert "app.ledger.totals is not in the Modules table" in map_violations(edited("`totals.py`, ", ""), MODULES)
    assert missing_paths("see `app/run/gone.py` and app/nowhere/") == ["app/nowhere/", "app/run/gone.py"]


def test_the_run_asks_a_strategy_only_what_its_protocols_declare():
    """app/run/ reads a strategy (`strategy.x`, `self.strategy.x`, `run.strategy.x`) only through
    the members strategies/interface.py declares: a new one must be declared there first."""
    import inspect

    from strategies import interface

    declared: set[str] = set()
    for protocol in (
        interface.ServerStrategy,
        interface.RoundStrategy,
        interface.BufferStrategy,
        interface.SecureStrategy,
    ):
        declared |= set(getattr(protocol, "__annotations__", {})) | {
            name for name, _ in inspect.getmembers(protocol, inspect.isfunction)
        }
    used: dict[str, str] = {}
    for path in sorted((ROOT / "app" / "run").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            named = isinstance(owner, ast.Name) and owner.id == "strategy"
            attr = isinstance(owner, ast.Attribute) and owner.attr == "strategy"
            if (named or attr) and not (isinstance(owner, ast.Attribute) and _is_cfg(owner)):
                used.setdefault(node.attr, f"{path.name}:{node.lineno}")
    undeclared = {k: v for k, v in used.items() if k not in declared}
    assert not undeclared, f"app/run reads strategy members no Protocol declares: {undeclared}"
    assert {"configure_train", "run", "state_dict"} <= used.keys()  # the scan sees the loops


def _is_cfg(node: ast.Attribute) -> bool:
    """`cfg.strategy` / `self.cfg.strategy`: the config section, not the strategy object."""
    base = node.value
    return (isinstance(base, ast.Name) and base.id in ("cfg", "config")) or (
        isinstance(base, ast.Attribute) and base.attr == "cfg"
    )

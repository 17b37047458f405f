"""The import wall: which of the project's packages may import which, and no import cycles.

Read from the source with ``ast`` (nothing is imported), so imports nested in functions,
``if`` blocks and ``TYPE_CHECKING`` blocks count like top-level ones:

* the core of ``fleet/`` (everything but its top layer: ``fleet/cli.py``,
  ``fleet/commands/``, ``fleet/bench/``) never imports ``flwr``, ``client`` or ``server``;
* ``client/`` never imports ``server`` and ``server/`` never imports ``client``;
* no cycle among the project's modules;
* each layer imports only the layers below it and the third-party libraries listed for it in
  :data:`LAYERS` (docs/architecture.md shows the same table).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fleet", "client", "server")
# The parts of fleet/ that are the app's top layer: they may reach Flower and the apps.
TOP_LAYER = ("fleet/cli.py", "fleet/commands/", "fleet/bench/")
OUTSIDE_CORE = ("flwr", "client", "server")


@dataclass(frozen=True)
class Import:
    file: str  # path relative to the root, with /
    line: int
    module: str  # the importing module, dotted
    target: str  # the imported module as written, absolute dotted (relative imports resolved)
    names: tuple[str, ...]  # for ``from target import a, b``: a, b; empty for ``import target``

    def describe(self) -> str:
        text = f"from {self.target} import {', '.join(self.names)}" if self.names else f"import {self.target}"
        return f"{self.file}:{self.line}: {text}"


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path, packages=PACKAGES) -> dict[str, str]:
    """Dotted module name -> file path relative to ``root``, for every .py file of ``packages``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            modules[module_name(rel)] = rel.as_posix()
    return modules


def read_imports(root: Path, modules: dict[str, str]) -> list[Import]:
    """Every import statement of every module, wherever it sits in the file."""
    found = []
    for module, file in modules.items():
        tree = ast.parse((root / file).read_text(), filename=file)
        is_package = file.endswith("__init__.py")
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.extend(Import(file, node.lineno, module, alias.name, ()) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found.append(Import(file, node.lineno, module, target, tuple(a.name for a in node.names)))
    return found


def top_name(imp: Import) -> str:
    return imp.target.split(".")[0]


def in_top_layer(file: str) -> bool:
    return any(file == p or (p.endswith("/") and file.startswith(p)) for p in TOP_LAYER)


def wall_violations(imports: list[Import]) -> list[str]:
    """Core fleet modules importing flwr/client/server."""
    return [
        f"{imp.describe()}  (fleet's core may not import {top_name(imp)}; only {', '.join(TOP_LAYER)} may)"
        for imp in imports
        if imp.file.startswith("fleet/") and not in_top_layer(imp.file) and top_name(imp) in OUTSIDE_CORE
    ]


def app_violations(imports: list[Import]) -> list[str]:
    """client/ importing server or server/ importing client."""
    banned = {"client/": "server", "server/": "client"}
    return [
        f"{imp.describe()}  ({imp.file.split('/')[0]}/ may not import {top_name(imp)})"
        for imp in imports
        for prefix, other in banned.items()
        if imp.file.startswith(prefix) and top_name(imp) == other
    ]


def resolve(name: str, modules: dict[str, str]) -> str | None:
    """The project module a dotted name lands in: itself, else its longest known prefix."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(imports: list[Import], modules: dict[str, str]) -> dict[str, dict[str, Import]]:
    """module -> {module it depends on: the first import that makes it so}.

    ``from a.b import c`` depends on module ``a.b.c`` when that is a module, else on ``a.b``
    (for a package: its ``__init__.py``); ``import a.b`` depends on ``a.b``.
    """
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in imports:
        targets = [f"{imp.target}.{n}" if f"{imp.target}.{n}" in modules else imp.target for n in imp.names if n != "*"]
        for target in targets or [imp.target]:
            dep = resolve(target, modules)
            if dep is not None:
                graph[imp.module].setdefault(dep, imp)
    return graph


def strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in a deterministic order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def cycle_in(component: list[str], graph: dict[str, dict[str, Import]]) -> list[str]:
    """One shortest cycle through the component's first module, as a list of modules."""
    start = component[0]
    members = set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # cannot happen in a strongly connected component


def cycles(imports: list[Import], modules: dict[str, str]) -> list[str]:
    """Every import cycle, one message per strongly connected component (or self-import)."""
    graph = import_graph(imports, modules)
    found = []
    for component in strongly_connected(graph):
        if len(component) == 1 and component[0] not in graph[component[0]]:
            continue
        path = cycle_in(component, graph)
        steps = "\n".join(f"    {graph[a][b].describe()}" for a, b in zip(path, path[1:]))
        on_path = set(zip(path, path[1:]))
        rest = [
            graph[a][b].describe()
            for a in component
            for b in sorted(graph[a])
            if b in component and (a, b) not in on_path
        ]
        others = (
            "\n    tangled with it (same strongly connected component): "
            f"{', '.join(m for m in component if m not in path)}"
            if len(component) > len(path) - 1
            else ""
        )
        found.append(f"import cycle {' -> '.join(path)}:\n{steps}{others}" + "".join(f"\n      {r}" for r in rest))
    return found


def check(root: Path, packages=PACKAGES) -> dict[str, list[str]]:
    modules = find_modules(root, packages)
    imports = read_imports(root, modules)
    return {"wall": wall_violations(imports), "apps": app_violations(imports), "cycles": cycles(imports, modules)}


def report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n" + "\n".join(f"  {p}" for p in problems)


@pytest.fixture(scope="module")
def project() -> dict[str, list[str]]:
    return check(ROOT)


# Each layer (a path prefix; the longest one that matches a file is its layer): the project layers it may import
# besides its own, and the third-party libraries it may import (the standard library always). The top layer
# (fleet/cli.py, fleet/commands/, fleet/bench/) may import anything and is not listed.
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "fleet/__init__.py": ((), ()),
    "fleet/base/": ((), ("torch",)),
    "fleet/data/": (("fleet/base/",), ("numpy", "torch", "torchvision", "PIL", "sklearn")),  # sklearn: 'digits' only
    "fleet/memory/": (("fleet/base/",), ("numpy", "torch")),
    "fleet/engine/": (("fleet/base/", "fleet/data/", "fleet/memory/"), ("numpy", "torch", "torchvision", "yaml")),
    "fleet/federated/": (
        ("fleet/base/", "fleet/data/", "fleet/memory/", "fleet/engine/"),
        ("numpy", "torch", "yaml", "matplotlib"),  # matplotlib: a run's plots, drawn where its records are
    ),
    # the emulated-device testbed: it launches Flower's own programs as processes, and imports no Flower
    "fleet/testbed/": (
        ("fleet/base/", "fleet/data/", "fleet/memory/", "fleet/engine/", "fleet/federated/"),
        ("numpy", "torch", "yaml", "PIL"),
    ),
    "client/": (("fleet/base/", "fleet/data/", "fleet/memory/", "fleet/engine/", "fleet/federated/"), ("flwr",)),
    "server/": (
        ("fleet/base/", "fleet/data/", "fleet/memory/", "fleet/engine/", "fleet/federated/"),
        ("flwr", "numpy"),
    ),
}
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def layer_of(file: str) -> str | None:
    """The layer a file belongs to (None: the top layer, or outside the listed packages)."""
    matches = [p for p in LAYERS if file == p or (p.endswith("/") and file.startswith(p))]
    return max(matches, key=len) if matches else None


def layer_violations(imports: list[Import], modules: dict[str, str]) -> list[str]:
    """Imports of a layer above (or beside) the importing one, and third-party imports a layer does not list."""
    found = []
    for imp in imports:
        layer = layer_of(imp.file)
        if layer is None:
            continue
        below, libraries = LAYERS[layer]
        top = top_name(imp)
        target = resolve(imp.target, modules)
        if target is not None:
            target_layer = layer_of(modules[target])
            if target_layer != layer and target_layer not in below:
                found.append(f"{imp.describe()}  ({layer} may import {', '.join(below) or 'no other layer'})")
        elif top not in STDLIB and top not in libraries:
            found.append(
                f"{imp.describe()}  ({layer} may import {', '.join(libraries) or 'only the standard library'})"
            )
    return found


def test_each_layer_imports_only_the_layers_below_and_its_libraries():
    modules = find_modules(ROOT)
    problems = layer_violations(read_imports(ROOT, modules), modules)
    assert not problems, report(problems, "imports across the layers")


def test_the_layer_check_fails_on_synthetic_violations(tmp_path):
    _write(
        tmp_path,
        {
            "fleet/__init__.py": "",
            "fleet/base/__init__.py": "",
            "fleet/base/errors.py": "import os\nimport torch\n",  # allowed
            "fleet/data/__init__.py": "",
            "fleet/data/io.py": "from fleet.engine.trainer import Trainer\nimport pandas\n",  # up a layer; unlisted
            "fleet/engine/__init__.py": "",
            "fleet/engine/trainer.py": "from fleet.data.io import x\nimport matplotlib\n",  # below: ok; unlisted
            "fleet/commands/__init__.py": "import anything_at_all\n",  # the top layer: not checked
        },
    )
    modules = find_modules(tmp_path)
    found = sorted(layer_violations(read_imports(tmp_path, modules), modules))
    assert len(found) == 3
    assert found[0].startswith("fleet/data/io.py:1: from fleet.engine.trainer import Trainer  (fleet/data/ may import")
    assert found[1].startswith("fleet/data/io.py:2: import pandas")
    assert found[2].startswith("fleet/engine/trainer.py:2: import matplotlib")


def test_fleet_core_does_not_import_flower_or_the_apps(project):
    assert not project["wall"], report(project["wall"], "imports through fleet's wall")


def test_client_and_server_do_not_import_each_other(project):
    assert not project["apps"], report(project["apps"], "imports between client/ and server/")


def test_no_import_cycles(project):
    assert not project["cycles"], report(project["cycles"], "import cycles")


def test_the_checker_sees_the_tree():
    modules = find_modules(ROOT)
    expected = {"fleet", "fleet.cli", "fleet.engine.trainer", "client", "server", "fleet.commands.simulation"}
    assert expected <= set(modules)
    assert not any(f.startswith("tests/") for f in modules.values())


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_fails_on_synthetic_violations(tmp_path):
    _write(
        tmp_path,
        {
            "fleet/__init__.py": "",
            "fleet/cli.py": "import flwr\nfrom server.x import y\n",  # top layer: allowed
            "fleet/commands/__init__.py": "",
            "fleet/commands/run.py": "from flwr.app import Context\n",  # top layer: allowed
            "fleet/ok.py": "import os\nfrom fleet import util\n",
            "fleet/util.py": "",
            "fleet/core.py": "def f():\n    from flwr.common import logger\n    import server.strategy\n",
            "fleet/deep/__init__.py": "from . import inner\n",
            "fleet/deep/inner.py": "from ..server_like import z\nimport client\n",
            # a cycle of three through a package __init__, one edge hidden in a function
            "fleet/a.py": "from fleet.b import thing\n",
            "fleet/b.py": "def later():\n    from fleet import pkg\n",
            "fleet/pkg/__init__.py": "from .c import x\n",
            "fleet/pkg/c.py": "import fleet.a\n",
            # a self-import and a relative one that resolves to the module itself
            "fleet/selfish.py": "from . import selfish\n",
            "client/__init__.py": "",
            "client/app.py": "from server import strategy\nfrom fleet.util import *\n",
            "server/__init__.py": "",
            "server/strategy.py": "import fleet.ok\n",
            "server/app.py": "def g():\n    import client.app\n",
        },
    )
    found = check(tmp_path)
    assert sorted(found["wall"]) == [
        "fleet/core.py:2: from flwr.common import logger  (fleet's core may not import flwr; only "
        "fleet/cli.py, fleet/commands/, fleet/bench/ may)",
        "fleet/core.py:3: import server.strategy  (fleet's core may not import server; only fleet/cli.py, "
        "fleet/commands/, fleet/bench/ may)",
        "fleet/deep/inner.py:2: import client  (fleet's core may not import client; only fleet/cli.py, "
        "fleet/commands/, fleet/bench/ may)",
    ]
    assert sorted(found["apps"]) == [
        "client/app.py:1: from server import strategy  (client/ may not import server)",
        "server/app.py:2: import client.app  (server/ may not import client)",
    ]
    assert len(found["cycles"]) == 2
    three, selfish = sorted(found["cycles"])
    assert three.startswith("import cycle fleet.a -> fleet.b -> fleet.pkg -> fleet.pkg.c -> fleet.a:")
    assert "fleet/b.py:2: from fleet import pkg" in three and "fleet/pkg/c.py:1: import fleet.a" in three
    assert selfish.startswith("import cycle fleet.selfish -> fleet.selfish:")
    # ``fleet.deep`` imports its own submodule: a package importing its children is no cycle.
    assert "fleet.deep" not in "".join(found["cycles"])


def test_clean_synthetic_tree_passes(tmp_path):
    _write(
        tmp_path,
        {
            "fleet/__init__.py": "",
            "fleet/base.py": "import torch\n",
            "fleet/top.py": "from fleet.base import x\nfrom . import base\n",
            "fleet/bench/__init__.py": "import flwr\nfrom server import simulation\n",
            "client/__init__.py": "from fleet import top\n",
            "server/__init__.py": "import fleet.base\n",
        },
    )
    assert check(tmp_path) == {"wall": [], "apps": [], "cycles": []}


# The federated core's sides (docs/architecture.md): a folder of fleet/federated/ each, and the sides each may import
# besides its own. A device and the server share only what both must agree on; a launcher (what starts a run,
# prepares its start or writes the reference) may import either side.
CORE = "fleet.federated"
SIDES = {"on_device": "device", "on_server": "server", "shared": "shared", "launch": "launch"}  # folder -> side
MAY_IMPORT = {"device": ("shared",), "server": ("shared",), "shared": (), "launch": ("device", "server", "shared")}


def side_of(module: str) -> str | None:
    """The side of a core module: its folder's (None outside the core, and for the core's own package)."""
    parts = module.split(".")
    return SIDES.get(parts[2]) if module.startswith(f"{CORE}.") and len(parts) > 2 else None


def core_targets(imp: Import, modules: dict[str, str]) -> list[str]:
    """The core modules an import lands in; ``from fleet.federated.shared import keys, schema`` lands in both."""
    if imp.target.startswith(CORE) and imp.names and all(f"{imp.target}.{n}" in modules for n in imp.names):
        return [f"{imp.target}.{n}" for n in imp.names]
    target = resolve(imp.target, modules)
    return [target] if target is not None and target.startswith(f"{CORE}.") else []


def side_violations(imports: list[Import], modules: dict[str, str]) -> list[str]:
    found = []
    for imp in imports:
        side = side_of(imp.module)
        for target in core_targets(imp, modules) if side else []:
            other = side_of(target)
            if other is not None and other != side and other not in MAY_IMPORT[side]:
                found.append(f"{imp.describe()}  ({side} side imports {other} side's {target})")
    return found


def test_every_core_module_has_a_side():
    core = [m for m in find_modules(ROOT) if m.startswith(f"{CORE}.")]
    unplaced = [m for m in core if side_of(m) is None]
    assert not unplaced, f"put each in a side's folder ({', '.join(SIDES)}; and docs/architecture.md): {unplaced}"


def test_the_device_and_the_server_side_share_only_the_shared_modules():
    modules = find_modules(ROOT)
    problems = side_violations(read_imports(ROOT, modules), modules)
    assert not problems, report(problems, "imports across the core's sides")


def test_the_side_check_fails_on_synthetic_violations(tmp_path):
    tree = {f"fleet/federated/{folder}/__init__.py": "" for folder in SIDES}
    _write(
        tmp_path,
        {
            **tree,
            "fleet/__init__.py": "",
            "fleet/federated/__init__.py": "",
            "fleet/federated/on_server/coordinator.py": "from fleet.federated.on_device.round import compute_steps\n",
            "fleet/federated/on_device/round.py": "from fleet.federated.on_server import coordinator\n",
            "fleet/federated/shared/keys.py": "from fleet.federated.on_device.tasks import x\n",
            "fleet/federated/on_device/tasks.py": "from fleet.federated.shared import keys\n",  # fine
            "fleet/federated/launch/prepare.py": "from fleet.federated.on_server import state\n",  # a launcher: fine
            "fleet/federated/on_server/state.py": "",
        },
    )
    modules = find_modules(tmp_path)
    found = sorted(side_violations(read_imports(tmp_path, modules), modules))
    assert len(found) == 3, found
    assert "device side imports server side's fleet.federated.on_server.coordinator" in found[0]
    assert "server side imports device side's fleet.federated.on_device.round" in found[1]
    assert "shared side imports device side's fleet.federated.on_device.tasks" in found[2]

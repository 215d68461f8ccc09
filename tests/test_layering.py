"""The package layers of ``posttrain`` and a check that every import runs downward.

Each unit (a subpackage such as ``posttrain/core`` or a top-level module such as ``posttrain/callbacks.py``) sits in
one layer of ``LAYERS``; a unit may import only units in *lower* layers (units that share a layer are peers and do
not import each other). The graph is read with ``ast`` from the import statements of every file under
``posttrain/``, including the ones inside functions and ``if TYPE_CHECKING:`` blocks: a lazy import is still a
dependency, only a deferred one. Name → "module:attr" tables resolved at run time (the CLI's verbs, the lazy public
API, the generation backends' registry) are dispatch, not imports, and are not counted.

Why the order is what it is (lowest first):

- foundations with no posttrain imports: the version, ``Registry``, process-group helpers, checkpoint/numerics
  checks;
- ``core``: pure tensor math (design §1.1); ``env_info`` (versions for bug reports);
- ``data``: formats, templates, collators; ``report``: metrics → plots → HTML, read by the report callback;
- ``models``: loading, forward passes, scoring; TRL's ``data_utils`` / ``chat_template_utils`` facades over ``data``;
- ``generation``: the sampling backends and the trainer's side of the server's wire; ``rewards``: reward functions;
- ``agents``: the tool loop, which generates and rewards; ``rollout``: the online-RL pipeline over all of these;
- ``callbacks``; then ``trainers`` and ``serving`` (the server stands above the sampler it wraps, beside the
  trainers, and neither imports the other);
- ``cli``: the parser, the script-argument dataclasses, the verb table; ``scripts`` (one per verb) and TRL's
  ``posttrain.trainer.*`` import paths above it; ``experimental`` (its own ``run`` entry point reuses the scripts'
  helpers); ``demo``; and the lazy public API, ``posttrain/__init__.py``, on top.
"""

from __future__ import annotations

import ast
import collections
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "posttrain"
ROOT = "posttrain"  # the unit name of ``posttrain/__init__.py``

LAYERS: tuple[tuple[str, ...], ...] = (
    ("_version", "registry", "distributed", "reliability"),
    ("core", "env_info", "import_utils"),
    ("data", "report"),
    ("legacy",),
    ("models", "data_utils", "chat_template_utils"),
    ("generation", "rewards"),
    ("agents",),
    ("rollout",),
    ("callbacks",),
    ("trainers", "serving"),
    ("cli",),
    ("scripts", "trainer", "_legacy_collator"),
    ("experimental",),
    ("demo",),
    (ROOT,),
)

# modules kept only so old import paths keep working: nothing inside posttrain may import them
COMPAT_SHIMS = {
    "posttrain.serving.client": "posttrain.generation.client",
    "posttrain.serving.weights": "posttrain.generation.weights",
}


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``source`` (a module) imports ``target`` (a module), at ``where``."""

    source: str
    target: str
    where: str


def _module_name(path: Path, package_dir: Path) -> tuple[str, bool]:
    """Dotted module name of ``path`` and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _exists(module: str, package_dir: Path) -> bool:
    """Whether ``module`` (dotted, under the package) is a file or a package in ``package_dir``'s tree."""
    path = package_dir.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def collect_imports(package_dir: Path) -> list[Import]:
    """Every import of the package by itself, as (importing module, imported module, file:line).

    ``from a.b import c`` is an import of ``a.b.c`` when that is a module, else of ``a.b``; relative imports are
    resolved against the importing module.
    """
    name = package_dir.name
    imports = []
    for path in sorted(package_dir.rglob("*.py")):
        module, is_package = _module_name(path, package_dir)
        here = module.split(".") if is_package else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                for alias in node.names:
                    full = f"{origin}.{alias.name}"
                    targets.append(full if _exists(full, package_dir) else origin)
            where = f"{path.relative_to(package_dir.parent)}:{getattr(node, 'lineno', 0)}"
            imports += [
                Import(module, target, where)
                for target in dict.fromkeys(targets)  # ``from a import b, c`` of one module is one import
                if target == name or target.startswith(name + ".")
            ]
    return imports


def unit_of(module: str) -> str:
    """The layered unit a module belongs to: ``posttrain.core.kl`` → ``core``; ``posttrain`` → ``ROOT``."""
    parts = module.split(".")
    return ROOT if len(parts) == 1 else parts[1]


def package_units(package_dir: Path) -> set[str]:
    """The units present in the tree: subpackages and top-level modules (and the root ``__init__``)."""
    units = {ROOT}
    for child in package_dir.iterdir():
        if child.is_dir() and (child / "__init__.py").is_file():
            units.add(child.name)
        elif child.suffix == ".py" and child.name != "__init__.py":
            units.add(child.stem)
    return units


def unit_graph(imports: list[Import]) -> dict[str, dict[str, list[str]]]:
    """unit → {imported unit → [file:line, ...]}, without a unit's imports of itself."""
    graph: dict[str, dict[str, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for imp in imports:
        source, target = unit_of(imp.source), unit_of(imp.target)
        if source != target:
            graph[source][target].append(imp.where)
    return graph


def layering_violations(graph: dict[str, dict[str, list[str]]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Imports of a unit in the same or a higher layer, and units without a layer, one message each."""
    rank = {unit: i for i, layer in enumerate(layers) for unit in layer}
    problems = []
    for source, targets in sorted(graph.items()):
        for target, places in sorted(targets.items()):
            for unit in (source, target):
                if unit not in rank:
                    problems.append(f"{unit!r} has no layer in LAYERS ({places[0]}): place it")
            if source in rank and target in rank and rank[target] >= rank[source]:
                direction = "upward" if rank[target] > rank[source] else "sideways"
                problems.append(
                    f"{direction}: {source} (layer {rank[source]}) imports {target} (layer {rank[target]}) at "
                    + ", ".join(places)
                )
    return sorted(set(problems))


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected groups of more than one unit (Tarjan), each sorted: every import circle lies in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


# --- the checks on posttrain itself ----------------------------------------------------------------------------


def test_every_import_inside_posttrain_runs_downward():
    assert layering_violations(unit_graph(collect_imports(PACKAGE)), LAYERS) == []


def test_no_import_circles_between_posttrain_units():
    assert cycles(unit_graph(collect_imports(PACKAGE))) == []


def test_no_import_circles_between_posttrain_modules_either():
    graph: dict[str, dict[str, list[str]]] = collections.defaultdict(dict)
    for imp in collect_imports(PACKAGE):
        if imp.source != imp.target:
            graph[imp.source].setdefault(imp.target, []).append(imp.where)
    assert cycles(graph) == []


def test_layers_name_exactly_the_units_that_exist():
    placed = [unit for layer in LAYERS for unit in layer]
    assert len(placed) == len(set(placed)), "a unit is placed twice"
    assert set(placed) == package_units(PACKAGE)


def test_nothing_inside_posttrain_imports_an_old_path_kept_for_users():
    users = [f"{imp.where} imports {imp.target}" for imp in collect_imports(PACKAGE) if imp.target in COMPAT_SHIMS]
    assert users == [], f"import the new homes instead: {COMPAT_SHIMS}"


def test_the_old_public_paths_still_import_the_same_objects():
    import posttrain.generation.client as client
    import posttrain.generation.weights as weights
    from posttrain.serving import client as old_client
    from posttrain.serving import weights as old_weights
    from posttrain.serving.client import GenerationClient  # the path the README documents

    assert GenerationClient is client.GenerationClient
    for name in old_client.__all__:
        assert getattr(old_client, name) is getattr(client, name)
    for name in old_weights.__all__:
        assert getattr(old_weights, name) is getattr(weights, name)
    # the helpers that moved out of a backend stay reachable where they were
    from posttrain.generation.transformers_backend import model_device
    from posttrain.models.unwrap import model_device as moved

    assert model_device is moved


# --- the checker can fail ----------------------------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "posttrain"


@pytest.mark.parametrize(
    "statement",
    [
        "from posttrain.trainers.grpo import GRPOTrainer",
        "import posttrain.trainers.grpo",
        "from ..trainers import grpo",
        "from ..trainers.grpo import GRPOTrainer",
        "def lazy():\n    from posttrain.trainers import grpo\n",
    ],
)
def test_an_injected_upward_import_is_reported_with_its_place(tmp_path, statement):
    package = _write(
        tmp_path,
        {
            "posttrain/__init__.py": "",
            "posttrain/core/__init__.py": "",
            "posttrain/core/kl.py": "import torch\n" + statement + "\n",
            "posttrain/trainers/__init__.py": "",
            "posttrain/trainers/grpo.py": "from posttrain.core.kl import k3\nGRPOTrainer = object\n",
        },
    )
    layers = (("core",), ("trainers",), (ROOT,))
    graph = unit_graph(collect_imports(package))
    assert dict(graph["trainers"]) == {"core": ["posttrain/trainers/grpo.py:1"]}  # the downward edge is fine
    (problem,) = layering_violations(graph, layers)
    assert problem.startswith("upward: core (layer 0) imports trainers (layer 1) at posttrain/core/kl.py:")
    assert cycles(graph) == [["core", "trainers"]]


def test_peers_importing_each_other_and_unplaced_units_are_reported():
    layers = (("core",), ("generation", "rewards"))
    graph = {"generation": {"rewards": ["a.py:3"], "core": ["a.py:1"]}, "agents": {"core": ["b.py:2"]}}
    assert layering_violations(graph, layers) == [
        "'agents' has no layer in LAYERS (b.py:2): place it",
        "sideways: generation (layer 1) imports rewards (layer 1) at a.py:3",
    ]


def test_cycles_finds_every_circle_and_only_circles():
    graph = {"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}, "e": {"f": []}, "f": {"e": []}}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b": []}, "b": {"c": []}}) == []


def test_from_package_import_name_counts_the_submodule_only_when_it_is_one(tmp_path):
    package = _write(
        tmp_path,
        {
            "posttrain/__init__.py": "from posttrain._version import __version__\n",
            "posttrain/_version.py": "__version__ = '0'\n",
            "posttrain/env_info.py": "from posttrain import __version__\nfrom posttrain import _version\n",
        },
    )
    targets = {(imp.source, imp.target) for imp in collect_imports(package)}
    assert targets == {
        ("posttrain", "posttrain._version"),
        ("posttrain.env_info", "posttrain"),  # an attribute of the root: the lazy public API, the top layer
        ("posttrain.env_info", "posttrain._version"),
    }

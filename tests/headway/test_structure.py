"""The code's shape: imports run one way, and head kinds are looked up, never branched on by
name."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from headway.export.exporter import FORMATS
from headway.export.layouts import LAYOUTS, REFUSED
from headway.inference.drafters.neural import NEURAL
from headway.inference.tune.spaces import TREE_SPACES
from headway.kinds.config import HeadConfig
from headway.kinds.registry import KINDS
from headway.train.objectives import OBJECTIVES
from tests.helpers import ROOT_DIR

ROOT = ROOT_DIR
# the top-level folders and the packages they install as (pyproject.toml's package-dir)
TOP = {
    "headway": "headway",
    "heads": "headway.heads",
    "target": "headway.target",
    "train": "headway.train",
    "inference": "headway.inference",
    "export": "headway.export",
    "data_scripts": "headway.data_scripts",
    "kinds": "headway.kinds",
}


def _packages() -> dict[Path, str]:
    """Every Headway package folder (a folder with an __init__.py under a top-level folder) -> its
    name."""
    out = {}
    for folder, package in TOP.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            out[init.parent] = ".".join([package, *rel.parts])
    return out


PACKAGES = _packages()


def _modules() -> dict[str, ast.Module]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = ast.parse(path.read_text(), str(path))
    return out


MODULES = _modules()


def _imports(tree: ast.Module) -> set[str]:
    """The Headway modules a module imports anywhere: at the top, inside functions and in
    TYPE_CHECKING blocks (a type-only import is still an arrow a reader follows, so it may not close
    a circle either)."""
    found: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        stack.extend(ast.iter_child_nodes(node))
    return {m for m in found if m in MODULES}


def test_no_import_cycles():
    graph = {name: _imports(tree) - {name} for name, tree in MODULES.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(name) :] + [name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in graph:
        visit(name, [])


# The command line imports each command's job inside the command's function, after checking its
# inputs, so that `--help`, `--version` and every argument, config or input error answer before
# torch and transformers load (test_cli_answers_without_heavy_imports). Its imports still count as
# arrows in test_no_import_cycles.
LAZY_IMPORTERS = {"headway.cli"}


def test_no_headway_imports_inside_functions():
    """A function-level import hides an arrow from a reader; every Headway import sits at the top of
    its module, except the command line's (LAZY_IMPORTERS)."""
    hidden = []
    for name, tree in MODULES.items():
        if name in LAZY_IMPORTERS:
            continue
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        "headway"
                    ):
                        hidden.append(f"{name}.{fn.name} imports {node.module}")
    assert not hidden, hidden


def test_no_stage_branches_on_a_kind_name():
    """Callers look the kind's spec up (kinds/registry.py); only a kind's own modules name it."""
    branches = []
    for name, tree in MODULES.items():
        if name.startswith(("headway.kinds", "headway.heads")):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                names = [s.value for s in sides if isinstance(s, ast.Constant) and s.value in KINDS]
                if names and any(
                    "kind" in ast.unparse(s) for s in sides if not isinstance(s, ast.Constant)
                ):
                    branches.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not branches, branches


def test_every_registered_kind_is_complete():
    sections = {f.name for f in fields(HeadConfig)}
    # HeadConfig names each registered kind's section, and no other
    assert sections - {"kind"} == set(KINDS)
    for name, spec in KINDS.items():
        assert spec.name == name and name in sections
        assert isinstance(getattr(HeadConfig(), name), spec.config)
        assert set(LAYOUTS[name]) | set(REFUSED[name]) <= set(FORMATS) - {"native"}
        assert not set(LAYOUTS[name]) & set(REFUSED[name])
    # each stage's part of every kind, and of no other (the stages' tables, by the kind's name)
    for table in (OBJECTIVES, NEURAL, TREE_SPACES, LAYOUTS, REFUSED):
        assert set(table) == set(KINDS)
    assert all(callable(part) for table in (OBJECTIVES, NEURAL) for part in table.values())


HEAVY = ("torch", "transformers", "datasets", "safetensors", "numpy")


def _modules_loaded_by(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_cli_answers_without_heavy_imports(tmp_path):
    """The command line's start-up, counted in modules imported rather than seconds: --version,
    --print-config, a config error and an input error each load none of torch, transformers, datasets
    or numpy."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["hi"]}\n{bad\n')
    for argv in (
        ["--version"],
        ["train", "--print-config"],
        ["demo", "--print-config"],
        ["train", "train.lr=abc"],
        ["bench", "--head", "heads/reference/smollm2-135m-instruct-eagle3", "--prompts", str(bad)],
    ):
        code = f"from headway.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        loaded = _modules_loaded_by(f"import os; os.chdir({str(ROOT)!r})\n" + code)
        heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
        assert not heavy, f"headway {' '.join(argv)} imported {heavy[:5]}"


def test_config_modules_are_torch_free():
    """Every config section (and the run config that holds them) loads without torch: the command
    line checks a config before anything heavy loads."""
    loaded = _modules_loaded_by("import headway.run_config, headway.demo_config, headway.checks")
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]


def test_no_module_is_over_600_lines():
    """Code is split by concern (the engines by device, the drafters one per drafter): no module
    grows past a screenful of screens."""
    long = {
        str(p.relative_to(ROOT)): n
        for folder in PACKAGES
        for p in folder.glob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long


# the most modules directly in one package folder, so that a reader can scan it: a larger one splits
# into sub-packages by what its modules are (inference/ did: engines/, drafters/, bench/, tune/)
MAX_MODULES = {"headway.inference": 12, "headway.target": 20, "headway.train": 26}
DEFAULT_MAX_MODULES = 15


def test_every_folder_is_small_enough_to_scan():
    big = {}
    for folder, package in PACKAGES.items():
        n = len([p for p in folder.glob("*.py") if p.stem != "__init__"])
        if n > MAX_MODULES.get(package, DEFAULT_MAX_MODULES):
            big[package] = n
    assert not big, big


# The layers, bottom first (docs/layout.md draws them): a module imports from its own layer and the
# layers below it, never from one above. Every `config` module (a config section's dataclasses,
# torch-free) and the run configs that gather them are the settings layer, just above the base:
# every stage reads them.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "headway",
            "headway.errors",
            "headway.io",
            "headway.config",
            "headway.faults",
            "headway.ranks",
            "headway.runtime",
        ),
    ),
    ("settings", ("headway.run_config", "headway.demo_config")),
    ("heads", ("headway.heads",)),
    ("target", ("headway.target",)),
    ("prompt sets", ("headway.prompts",)),
    ("kinds", ("headway.kinds",)),
    ("export", ("headway.export",)),
    ("inference.engines", ("headway.inference.engines",)),
    ("inference.drafters", ("headway.inference.drafters",)),
    ("inference", ("headway.inference",)),
    ("inference.tune", ("headway.inference.tune",)),
    ("inference.bench", ("headway.inference.bench",)),
    ("data_scripts", ("headway.data_scripts",)),
    ("train", ("headway.train",)),
    ("commands", ("headway.checks", "headway.demo", "headway.cli", "headway.__main__")),
]


def _layer(module: str) -> int:
    """The index in LAYERS of the layer a module belongs to (the longest matching name wins)."""
    if module.endswith(".config") and module != "headway.config":
        return 1
    best = max(
        (
            (len(name), i)
            for i, (_, names) in enumerate(LAYERS)
            for name in names
            if module == name or module.startswith(name + ".") and name != "headway"
        ),
        default=(0, -1),
    )
    if best[1] < 0 and module == "headway":
        return 0
    assert best[1] >= 0, f"{module} belongs to no layer of LAYERS"
    return best[1]


def test_imports_run_one_way_between_layers():
    """No module imports from a layer above its own, so no two folders import each other: the stages
    look a head kind up in kinds/ (and keep their own part of it), inference reads prompt sets and
    the chat format from below it, and data_scripts (self-distillation) decodes with inference's
    engines."""
    upward = []
    for name, tree in MODULES.items():
        own = _layer(name)
        for dep in sorted(_imports(tree) - {name}):
            if _layer(dep) > own:
                upward.append(f"{name} ({LAYERS[own][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})")
    assert not upward, upward


def test_the_layers_picture_matches_the_layers():
    """docs/layout.md draws LAYERS top down, one name per line of its picture."""
    text = (ROOT / "docs" / "layout.md").read_text()
    picture = text.split("```text\n", 1)[1].split("```", 1)[0]
    drawn = [line[:20].strip() for line in picture.splitlines() if line.strip()]
    assert drawn == [name for name, _ in reversed(LAYERS)]


# where the engine lives: nothing there sets an attribute of another object behind its back
_NO_OBJECT_SETATTR = ("headway.inference", "headway.target")
# headway_* attributes that are no setting of a model or head
# train/distributed.py: its wrappers of torch.distributed's collectives
_NOT_SETTINGS = {"_headway_real"}


def _headway_attr(attr: str) -> bool:
    return attr.lstrip("_").startswith("headway_") and attr not in _NOT_SETTINGS


def test_engine_settings_are_passed_never_written_onto_the_model():
    """Engine settings (engine, CUDA buckets and graphs, the static engine's layer loop and kernels)
    travel as EngineOptions from the config to the runner: no module writes or reads a `headway_*`
    attribute (on the HF model, the head or anything else), and the engine's modules never
    `object.__setattr__` another object (a runner or weight format is kept in a weak table keyed by
    the model instead)."""
    found = []
    for name, tree in MODULES.items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and _headway_attr(t.attr):
                    found.append(f"{name}:{node.lineno} sets .{t.attr}")
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            called = fn.id if isinstance(fn, ast.Name) else ""
            args = [
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
            if called in ("getattr", "setattr", "hasattr", "delattr") and any(
                _headway_attr(a) for a in args
            ):
                found.append(f"{name}:{node.lineno} {called}(..., {args[0]!r})")
            is_object_setattr = (
                isinstance(fn, ast.Attribute)
                and fn.attr == "__setattr__"
                and isinstance(fn.value, ast.Name)
                and fn.value.id == "object"
            )
            if is_object_setattr and name.startswith(_NO_OBJECT_SETATTR):
                first = node.args[0] if node.args else None
                if not (isinstance(first, ast.Name) and first.id == "self"):
                    found.append(f"{name}:{node.lineno} object.__setattr__ on another object")
    assert not found, found

"""The layout rules, read from the source tree (no import of the project): eval/ and kernels/ (mapped into the
package as mm_oval.eval and mm_oval.kernels) import the rest of the project absolutely, no module edits
sys.path, and the folders import one another without a loop, not even through imports inside functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package name -> its folder in the checkout (pyproject's package-dir)
PACKAGES = {"mm_oval": ROOT / "mm_oval", "mm_oval.eval": ROOT / "eval", "mm_oval.kernels": ROOT / "kernels"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package __init__)"""
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if ".venv" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            if is_init:
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = (path, is_init)
    return out


def _imports(name: str, path: Path, is_init: bool, modules: dict) -> list[tuple[str, int, int]]:
    """(imported module, level of the relative import or 0, line) of every import in the file, at any depth."""
    package = name if is_init else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, 0, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            out += [(m, node.level, node.lineno) for m in subs]
            if len(subs) < len(node.names):
                out.append((base, node.level, node.lineno))
    return out


def _folder(module: str) -> str | None:
    """The unit of the layout a module belongs to: mm_oval's subpackage or top-level module."""
    parts = module.split(".")
    if parts[0] != "mm_oval" or len(parts) == 1:
        return None  # another project, or mm_oval/__init__ (every submodule import runs it)
    return parts[1]


def test_eval_and_kernels_import_the_project_absolutely_and_relatively_only_within_a_folder():
    modules = _modules()
    bad = []
    for name, (path, is_init) in modules.items():
        if not name.startswith(("mm_oval.eval", "mm_oval.kernels")):
            continue
        for target, level, line in _imports(name, path, is_init, modules):
            if level > 1:  # `from .x` stays within the module's folder; `from ..x` climbs out of it
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} as {'.' * level}")
    assert not bad, "\n".join(bad)


def _is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys"
    )


MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__delitem__"}


def test_no_module_edits_sys_path():
    # an edit: sys.path.<mutator>(...), or sys.path (or an item of it) assigned or deleted; reading it is fine
    edits = []
    for path, _ in _modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            mutated = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            mutated = mutated and node.func.attr in MUTATORS and _is_sys_path(node.func.value)
            assigned = any(
                _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)) for t in targets
            )
            if mutated or assigned:
                edits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not edits, f"sys.path is touched at {edits}"


KNOWN_EDGES: set[tuple[str, str]] = set()  # edges allowed to close a loop: none


def test_the_folders_import_one_another_without_a_loop():
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for name, (path, is_init) in modules.items():
        a = _folder(name)
        for target, _, line in _imports(name, path, is_init, modules):
            b = _folder(target)
            if a and b and a != b and (a, b) not in KNOWN_EDGES:
                graph[a].add(b)
                where.setdefault((a, b), f"{path.relative_to(ROOT)}:{line}")

    # a loop is a folder that reaches itself
    def reaches(start: str) -> set[str]:
        seen, stack = set(), list(graph[start])
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(graph[n])
        return seen

    loops = sorted(f for f in list(graph) if f in reaches(f))
    detail = [f"{a} -> {b} ({where[a, b]})" for a in loops for b in sorted(graph[a]) if b in loops]
    assert not loops, "folders in an import loop: " + ", ".join(loops) + "\n" + "\n".join(detail)


def test_a_checkout_kernels_folder_imported_as_top_level_kernels_runs_nothing():
    """From the checkout root `kernels` names the folder; transformers imports that name to probe for the
    Hugging Face Hub's kernels library. Without that library the import loads no op and offers no version;
    with it installed (lmms-eval brings it), the import is the installed library, so transformers gets the
    names it asks for."""
    import importlib.machinery

    outside = [p for p in sys.path if Path(p or ".").resolve() != ROOT.resolve()]
    hub = importlib.machinery.PathFinder.find_spec("kernels", outside)
    code = (
        "import sys, kernels; "
        "print(sorted(m for m in sys.modules if m == 'kernels' or m.startswith('mm_oval'))); "
        "print(hasattr(kernels, '__version__'), 'torch' in sys.modules, kernels.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    modules, line = out.stdout.split("\n")[:2]
    assert modules == "['kernels']", out.stdout + out.stderr  # no mm_oval module, no op
    has_version, has_torch, file = line.split(" ", 2)
    if hub is None:  # the folder itself: nothing loaded, not even torch
        assert has_version == "False" and has_torch == "False", out.stdout
        assert Path(file).resolve().parent == (ROOT / "kernels").resolve()
    else:
        assert has_version == "True" and Path(file).resolve() == Path(hub.origin).resolve(), out.stdout


def test_every_folder_that_holds_files_is_a_package_the_wheel_ships():
    """A folder missing from pyproject's `packages` is left out of a built wheel (`pip install .` without -e):
    its modules fail to import and its data (weights, dev sets) is not there. Every folder of the three
    package roots that holds a file is listed."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    assert {k: ROOT / v for k, v in setup["package-dir"].items()} == PACKAGES
    missing = []
    for pkg, folder in PACKAGES.items():
        for d in [folder, *folder.rglob("*")]:
            if (
                not d.is_dir()
                or "__pycache__" in d.parts
                or ".venv" in d.parts
                or d.name.endswith(".egg-info")
            ):
                continue
            if any(f.is_file() and f.name != ".DS_Store" for f in d.iterdir()):
                name = ".".join([pkg, *d.relative_to(folder).parts])
                if name not in listed:
                    missing.append(name)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"

"""The top-level parts import each other without cycles.

A part is a package of ``tooltrie`` (``tooltrie.serve`` -> ``serve/``, as pyproject.toml maps them) or a module of
``tooltrie`` itself (``tooltrie.cli``, ``tooltrie.errors``, ...). Every import counts, the ones inside functions and
under ``TYPE_CHECKING`` included, and so does a module named in a string (``python -m tooltrie.train.job``,
``importlib.import_module``): a part that needs another, even lazily or in another process, sits above it. Rerun with
``.venv/bin/python -m pytest tests/test_layout.py``.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = "tooltrie"
DOTTED_NAME = re.compile(rf"{ROOT}(\.[A-Za-z_]\w*)+")


def package_dirs(pyproject: Path = REPO / "pyproject.toml") -> dict[str, Path]:
    """{package name: folder} from pyproject.toml's ``package-dir`` (``tooltrie`` itself included)."""
    mapping = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    return {name: REPO / folder for name, folder in mapping.items()}


def part_of(module: str) -> str | None:
    """The part a dotted module name belongs to: ``tooltrie.serve.engine`` -> ``tooltrie.serve``; None outside."""
    pieces = module.split(".")
    if pieces[0] != ROOT:
        return None
    return ".".join(pieces[:2])


def imported_modules(source: str, *, package: str) -> set[str]:
    """Every module ``source`` imports (absolute names; relative imports resolved against ``package``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from tooltrie import serve`
    return found


def named_modules(source: str) -> set[str]:
    """Every string in ``source`` that is a whole dotted name under ``tooltrie``: a module started or imported by
    name (``[sys.executable, "-m", "tooltrie.train.job"]``). Names that are no module are dropped by the caller."""
    return {node.value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED_NAME.fullmatch(node.value)}


def module_names(dirs: Mapping[str, Path]) -> set[str]:
    """The dotted name of every module of the mapped folders (packages included)."""
    names = set()
    for package, folder in dirs.items():
        for path in folder.rglob("*.py"):
            relative = path.relative_to(folder).with_suffix("").parts
            names.add(".".join((package, *relative[: -1 if relative[-1] == "__init__" else None])))
    return names


def import_graph(dirs: Mapping[str, Path]) -> dict[str, set[str]]:
    """{part: the other parts it imports or names}, over every .py file of the mapped folders."""
    modules = module_names(dirs)
    graph: dict[str, set[str]] = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder).with_suffix("").parts
            if relative[-1] == "__init__":
                relative = relative[:-1]
            module = ".".join((package, *relative))
            own = part_of(module)
            if own is None:
                continue
            inner_package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            source = path.read_text(encoding="utf-8")
            named = {name for name in named_modules(source) if name in modules}
            targets = {part_of(name) for name in imported_modules(source, package=inner_package) | named}
            graph.setdefault(own, set()).update(t for t in targets if t is not None and t != own)
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one member (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]


def test_imports_are_read_whole(tmp_path: Path) -> None:
    source = ("from tooltrie.serve.engine import Engine\nimport tooltrie.eval.cli as c\n"
              "def f():\n    from tooltrie import train\n"
              "if TYPE_CHECKING:\n    from tooltrie.kernels import step\n"
              "from .model import Registry\n")
    parts = {part_of(name) for name in imported_modules(source, package="tooltrie.registry")}
    assert {"tooltrie.serve", "tooltrie.eval", "tooltrie.train", "tooltrie.kernels", "tooltrie.registry"} <= parts


def test_a_planted_cycle_is_found(tmp_path: Path) -> None:
    (tmp_path / "low").mkdir()
    (tmp_path / "high").mkdir()
    (tmp_path / "low" / "__init__.py").write_text("")
    (tmp_path / "high" / "__init__.py").write_text("from tooltrie.low import x\n")
    dirs = {"tooltrie.low": tmp_path / "low", "tooltrie.high": tmp_path / "high"}
    assert cycles(import_graph(dirs)) == []
    (tmp_path / "low" / "late.py").write_text("def f():\n    from tooltrie.high import y\n")
    assert cycles(import_graph(dirs)) == [["tooltrie.high", "tooltrie.low"]]


def test_a_module_started_by_name_counts_as_imported(tmp_path: Path) -> None:
    """``python -m tooltrie.high.job`` from ``low`` makes ``low`` need ``high`` as an import would; a string that
    names no module (``"tooltrie.json"``, a file name) does not."""
    for name, files in {"low": {"__init__.py": "NAME = 'tooltrie.json'\n"},
                        "high": {"__init__.py": "", "job.py": "from tooltrie.low import NAME\n"}}.items():
        (tmp_path / name).mkdir()
        for file, text in files.items():
            (tmp_path / name / file).write_text(text)
    dirs = {"tooltrie.low": tmp_path / "low", "tooltrie.high": tmp_path / "high"}
    assert cycles(import_graph(dirs)) == []
    (tmp_path / "low" / "start.py").write_text("COMMAND = [sys.executable, '-m', 'tooltrie.high.job']\n")
    assert cycles(import_graph(dirs)) == [["tooltrie.high", "tooltrie.low"]]


def test_the_top_level_parts_import_each_other_without_cycles() -> None:
    graph = import_graph(package_dirs())
    assert {"tooltrie.serve", "tooltrie.eval", "tooltrie.train", "tooltrie.kernels"} <= set(graph)
    found = cycles(graph)
    assert not found, "import cycles between top-level parts: " + "; ".join(
        " <-> ".join(members) + " (" + ", ".join(f"{a} -> {b}" for a in members for b in sorted(graph[a])
                                                 if b in members) + ")"
        for members in found)

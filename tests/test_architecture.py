"""Every import inside ``fuser`` points down the pipeline (see ARCHITECTURE.md), and every
function reads in one sitting.

The checker reads each module with ``ast`` (imports at module level and inside functions
alike, relative ones resolved), maps importer and imported module to their layer, and
reports an import of a later layer, or of another module's private (``_x``) name. A second
checker reports each function longer than ``MAX_FUNCTION_LINES``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import fuser

PACKAGE = Path(fuser.__file__).resolve().parent

# The declared order, bottom first: a module may import its own layer and the ones above
# it in this list, never one below. Modules are matched by their longest listed prefix.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("fuser.errors", "fuser.log", "fuser.counters"),
    "rules": ("fuser.rules",),
    "ir": ("fuser.ir",),
    "codegen": ("fuser.codegen",),
    "cache": ("fuser.cache",),
    "runtime": ("fuser.runtime",),
    "display": ("fuser.display",),
    "front ends": ("fuser.optim", "fuser.losses"),
    "explainer": ("fuser.explainer",),
    "integrations": ("fuser.integrations",),
    "cli": ("fuser.cli", "fuser.clitools", "fuser.__main__"),
    "package": ("fuser",),
}
RANK = {name: i for i, name in enumerate(LAYERS)}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    importer: str  # layer of the importing module
    imported: str  # layer of the imported module
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what} ({self.importer} -> {self.imported})"


def layer_of(module: str) -> str:
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    if best is None:
        raise KeyError(f"module {module} has no layer in LAYERS")
    return best


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(tree: ast.AST, module: str, is_package: bool, modules: set[str]):
    """(line, imported module, imported name or None) for every import of a fuser module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fuser":
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, module, is_package)
            if source.split(".")[0] != "fuser":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:  # `from fuser import clitools`: the submodule itself
                    yield node.lineno, sub, None
                else:
                    yield node.lineno, source, alias.name


def check_source(text: str, module: str, path: str, modules: set[str], is_package: bool = False):
    """The violations of one module's source."""
    found, upward = [], set()
    own = layer_of(module)
    for line, target, name in imports(ast.parse(text), module, is_package, modules):
        if target == "fuser" and name is None:
            # The bare package: Python runs it before any of its modules, so reading its
            # metadata (__version__, __file__) adds no dependency.
            continue
        theirs = layer_of(target)
        if RANK[theirs] > RANK[own] and (line, target) not in upward:
            upward.add((line, target))
            found.append(Violation(path, line, own, theirs, f"{module} imports {target}"))
        if name and name.startswith("_") and not name.startswith("__") and target != module:
            found.append(Violation(path, line, own, theirs, f"{module} imports private {target}.{name}"))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the fuser modules it imports (a package's own ``__init__`` left out: Python
    runs it before any of its modules whatever they import)."""
    modules = package_modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        targets = {t for _, t, _ in imports(tree, name, path.name == "__init__.py", set(modules))}
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def check_package() -> list[Violation]:
    modules = package_modules()
    found = []
    for name, path in modules.items():
        rel = str(path.relative_to(PACKAGE.parent))
        found += check_source(path.read_text(), name, rel, set(modules), path.name == "__init__.py")
    return found


# A longer function becomes named steps (helper functions or small dataclasses).
MAX_FUNCTION_LINES = 60


def long_functions(text: str, path: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line: name is N lines`` for each function in ``text`` longer than ``limit``
    lines, counted from its ``def`` to its last line (docstring included); methods and
    nested functions go by their qualified names, and count within their outer function too."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                length = child.end_lineno - child.lineno + 1
                if length > limit:
                    found.append(f"{path}:{child.lineno}: {name} is {length} lines")
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(text), "")
    return found


def test_every_module_has_a_layer():
    for name in package_modules():
        layer_of(name)


def test_imports_point_down_the_pipeline():
    found = check_package()
    assert not found, "imports against the declared layer order:\n" + "\n".join(map(str, found))


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_checker_reports_an_upward_import():
    modules = set(package_modules())
    text = "import os\n\ndef f():\n    from fuser.optim.factory import make_optimizer\n"
    found = check_source(text, "fuser.cache.example", "fuser/cache/example.py", modules)
    assert [str(v) for v in found] == [
        "fuser/cache/example.py:4: fuser.cache.example imports fuser.optim.factory (cache -> front ends)"
    ]


def test_checker_reports_a_private_name_and_resolves_relative_imports():
    modules = set(package_modules())
    text = "from .keys import _hidden\nfrom ..display import rule_latex\n"
    found = check_source(text, "fuser.cache.example", "fuser/cache/example.py", modules)
    assert [(v.line, v.what) for v in found] == [
        (1, "fuser.cache.example imports private fuser.cache.keys._hidden"),
        (2, "fuser.cache.example imports fuser.display"),
    ]


def test_checker_allows_downward_and_same_layer_imports():
    modules = set(package_modules())
    text = "from fuser.cache import load_kernel\nfrom fuser.runtime.tables import build_tables\n"
    assert check_source(text, "fuser.runtime.example", "fuser/runtime/example.py", modules) == []


def test_no_function_is_longer_than_the_limit():
    found = []
    for path in package_modules().values():
        found += long_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(found)
    )


def test_length_checker_reports_a_function_over_the_limit():
    def function(name: str, lines: int, indent: str = "") -> str:
        body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 2))
        return f'{indent}def {name}():\n{indent}    """Doc."""\n{body}'

    text = function("exactly", 60) + "\n\nclass A:\n" + function("longer", 61, "    ")
    text += "\n    def outer(self):\n" + function("inner", 61, "        ")
    assert long_functions(text, "fuser/example.py") == [
        "fuser/example.py:64: A.longer is 61 lines",
        "fuser/example.py:126: A.outer is 62 lines",
        "fuser/example.py:127: A.outer.inner is 61 lines",
    ]

"""The packages import each other only downwards (docs/architecture.md): every module's imports, read with ast
(top-level and inside functions), against the rule of its package; no folder of a package holds more than
``MAX_MODULES`` modules (nor does a folder of the tests, which mirror the packages, nor of the benchmarks), and no
modules import each other in a circle. The tests share helpers through modules of their own (tests/<package>/helpers.py
and the named ones beside it), never through a test module or a conftest."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "automata", "training", "server", "clients")
FIRST_PARTY = (*PACKAGES, "benchmarks", "tests")
ALLOWED = {  # package -> the first-party packages (or modules) its modules may import
    "model": ("model",),
    "automata": ("model", "automata"),
    "training": ("model", "automata", "training"),
    "server": ("model", "automata", "server"),
    "clients": ("clients", "server.api.protocol"),
}
STANDALONE = ("server/__init__.py", "server/api/protocol.py")  # the client imports them: no torch, nothing first-party


def imported(path: Path) -> list[str]:
    """Every module ``path`` imports, as a dotted name: ``import a.b`` gives a.b, ``from a import b`` gives a.b
    (b may be a module or a name in a), a relative import is resolved against the module's package."""
    package = path.relative_to(REPO).parent.parts
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # in a/b/c.py, ``from .x import y`` is a.b.x.y and ``from .. import y`` is a.y
                module = ".".join([*package[: len(package) - node.level + 1], *([module] if module else [])])
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def first_party(names: list[str]) -> list[str]:
    return [name for name in names if name.split(".")[0] in FIRST_PARTY]


def allows(rule: tuple[str, ...], name: str) -> bool:
    return any(name == allowed or name.startswith(f"{allowed}.") for allowed in rule)


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_what_its_layer_allows(package: str) -> None:
    assert modules(package), f"{package}/ has no modules"
    wrong = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in modules(package)
        for name in first_party(imported(path))
        if not allows(ALLOWED[package], name)
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", STANDALONE)
def test_what_the_client_imports_imports_nothing_of_ours(module: str) -> None:
    assert first_party(imported(REPO / module)) == []


MAX_MODULES = 12  # per folder, __init__.py (and a test folder's conftest.py) not counted
NOT_COUNTED = ("__init__.py", "conftest.py")
BOUNDED = (*PACKAGES, "benchmarks")  # the trees whose folders the bound covers, besides tests/


def crowded(folders: set[Path]) -> list[str]:
    """Each of ``folders`` that holds more than ``MAX_MODULES`` modules, with its count (and its path from the
    repository's root, where it lies inside it)."""
    return sorted(
        f"{folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder}: {count}"
        for folder in folders
        if (count := sum(1 for path in folder.glob("*.py") if path.name not in NOT_COUNTED)) > MAX_MODULES
    )


@pytest.mark.parametrize("package", BOUNDED)
def test_no_folder_holds_more_than_a_readable_number_of_modules(package: str) -> None:
    """Each package's folders, and the benchmarks' (grouped by what they measure: benchmarks/ops/, ...)."""
    folders = {path.parent for path in modules(package)}
    assert not crowded(folders), f"folders over {MAX_MODULES} modules: {crowded(folders)}"


def test_no_test_folder_holds_more_than_a_readable_number_of_modules() -> None:
    """The tests mirror the packages (tests/server/api/ tests server/api/, ...) and obey the same bound."""
    folders = {path.parent for path in modules("tests")}
    assert {
        REPO / "tests" / "server" / "api",
        REPO / "tests" / "model" / "ops",
        REPO / "tests" / "training" / "cli",
    } <= folders
    assert not crowded(folders), f"test folders over {MAX_MODULES} modules: {crowded(folders)}"


def test_the_folder_rule_sees_the_folders_and_fails_on_a_crowded_one(tmp_path: Path) -> None:
    """The checker itself: nested folders are seen, ``__init__.py`` and ``conftest.py`` are not counted, and one
    module past ``MAX_MODULES`` is named with its count."""
    assert {REPO / "benchmarks", REPO / "benchmarks" / "serve" / "engine"} <= {p.parent for p in modules("benchmarks")}
    for name in (*NOT_COUNTED, *(f"module_{index}.py" for index in range(MAX_MODULES))):
        (tmp_path / name).touch()
    assert crowded({tmp_path}) == []
    (tmp_path / "one_more.py").touch()
    assert crowded({tmp_path}) == [f"{tmp_path}: {MAX_MODULES + 1}"]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the first-party modules it imports (``from a import b`` names the module a.b where b is one, else
    a), over every package's modules, imports inside functions included."""
    paths = [path for package in PACKAGES for path in modules(package)]
    known = {module_name(path) for path in paths}

    def module_of(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    return {
        module_name(path): {module for name in first_party(imported(path)) if (module := module_of(name))}
        - {module_name(path)}
        for path in paths
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    """A package's ``__init__`` counts as the module of its name: the package faces here import nothing."""
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert "server.engine.core" in import_graph()["server.engine.client"]


def test_the_rule_sees_the_imports() -> None:
    """The checker itself: an import of each form is found, and a wrong one is named."""
    names = imported(REPO / "server" / "models" / "runtime.py")
    assert "automata.compiler.COMPILERS" in names and "model.device.resolve_device" in names
    assert first_party(imported(REPO / "clients" / "client.py")) and allows(ALLOWED["clients"], "server.api.protocol")
    assert not allows(ALLOWED["server"], "training.data.tasks.get_task")
    assert not allows(ALLOWED["clients"], "server.api.app.create_app")


def from_a_test_module(name: str) -> bool:
    """Whether the dotted ``name`` is, or lies inside, a test module (``test_*``) or a conftest."""
    return any(part == "conftest" or part.startswith("test_") for part in name.split("."))


def test_tests_share_helpers_only_through_helper_modules() -> None:
    """No test module, conftest or helper imports from a ``test_*`` module or a conftest: what more than one file
    uses lives in a helper module (fixtures stay in conftest.py, where pytest finds them without an import)."""
    tests = sorted((REPO / "tests").rglob("*.py"))
    assert len(tests) > 10
    wrong = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in tests
        for name in first_party(imported(path))
        if from_a_test_module(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_test_module_rule_sees_the_imports() -> None:
    assert from_a_test_module("tests.server.test_live.wait_for") and from_a_test_module("tests.server.test_live")
    assert from_a_test_module("tests.server.conftest.make_settings") and from_a_test_module("tests.server.conftest")
    assert not from_a_test_module("tests.server.helpers.make_settings")
    assert not from_a_test_module("tests.model.tiny_models.build_tiny")
    assert "tests.model.tiny_models.build_tiny" in imported(REPO / "tests" / "model" / "test_models.py")

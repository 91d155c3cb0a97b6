"""Layers that point one way (issue 35), read from the source: rfattn's modules (kernels/ as
rfattn.kernels) import each other without a cycle, counting imports inside functions too, and no
file of the project (package, tests, benchmarks, plots) imports or reads another module's private
names. The one exception: the Triton kernels themselves (``_..._kernel``), private by the house
style (launched only by their module's launchers), which tests may wrap to observe a launch."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _modules() -> dict[str, pathlib.Path]:
    """rfattn's modules by dotted name (kernels/ installed as rfattn.kernels)."""
    out = {}
    for top in ("rfattn", "kernels"):
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] == "kernels":
                parts = ["rfattn", *parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def _absolute(module: str | None, level: int, here: str) -> str:
    """An import's module as an absolute name (relative imports resolved against ``here``)."""
    if level == 0:
        return module or ""
    base = _package(here).split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str) -> list[tuple[str, str | None]]:
    """``(module, imported name or None)`` of every rfattn import in module ``name``."""
    out = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = _absolute(node.module, node.level, name)
            if mod.startswith("rfattn"):
                out += [(mod, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.startswith("rfattn")]
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the rfattn modules it imports (a package's own __init__ left out: importing
    rfattn.x runs rfattn/__init__ whatever the layering)."""
    edges = {}
    for name in MODULES:
        deps = set()
        for mod, what in _imports(name):
            target = f"{mod}.{what}" if what and f"{mod}.{what}" in MODULES else mod
            while target not in MODULES:
                target = target.rsplit(".", 1)[0]
            if target != name and MODULES[target].name != "__init__.py":
                deps.add(target)
        edges[name] = deps
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, done, stack = [], set(), []

    def visit(u):
        stack.append(u)
        for v in sorted(edges[u]):
            if v in stack:
                found.append(stack[stack.index(v):] + [v])
            elif v not in done:
                visit(v)
        stack.pop()
        done.add(u)

    for u in sorted(edges):
        if u not in done:
            visit(u)
    return found


def test_modules_import_each_other_without_a_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_check_finds_a_cycle():
    """The cycle search can fail: a graph with one."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.endswith("_kernel")


def _private_uses(path: pathlib.Path) -> list[str]:
    """``from rfattn... import _x`` and ``module._x`` where ``module`` names an rfattn module."""
    tree = ast.parse(path.read_text())
    here = next((n for n, p in MODULES.items() if p == path), "")
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _absolute(node.module, node.level, here) if here else node.module or ""
            if not mod.startswith("rfattn"):
                continue
            for a in node.names:
                if _private(a.name):
                    found.append(f"{path.name}:{node.lineno} from {mod} import {a.name}")
                elif f"{mod}.{a.name}" in MODULES:
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name.split(".")[0] for a in node.names
                        if a.name.startswith("rfattn")}  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and \
                isinstance(node.value, ast.Name) and node.value.id in aliases:  # fmt: skip
            found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
        # setattr(module, "_x", ...), getattr(module, "_x") and monkeypatch.setattr alike
        if isinstance(node, ast.Call) and len(node.args) >= 2 and \
                getattr(node.func, "attr", getattr(node.func, "id", "")) in SET_GET and \
                isinstance(node.args[0], ast.Name) and node.args[0].id in aliases and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value):  # fmt: skip
            found.append(f"{path.name}:{node.lineno} {node.args[0].id}.{node.args[1].value}")
    return found


SET_GET = ("setattr", "getattr", "delattr", "hasattr")


def test_no_file_reads_another_modules_private_names():
    files = [p for top in ("rfattn", "kernels", "tests", "bench", "plots")
             for p in sorted((ROOT / top).rglob("*.py"))]  # fmt: skip
    found = [use for path in files for use in _private_uses(path)]
    assert not found, "private names used across modules: " + "; ".join(found)


def test_the_check_finds_private_uses(tmp_path):
    """The scan can fail: both forms are found, a kernel is not."""
    path = tmp_path / "user.py"
    path.write_text("from rfattn.blocked import _secret\nfrom rfattn import threads\n"
                    "threads._hidden\nthreads._fwd_kernel\n"
                    "monkeypatch.setattr(threads, '_patched', 1)\n")  # fmt: skip
    assert sorted(u.split(" ", 1)[1] for u in _private_uses(path)) == [
        "from rfattn.blocked import _secret", "threads._hidden", "threads._patched"
    ]

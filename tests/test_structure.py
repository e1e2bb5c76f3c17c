"""The package's shape, checked from its source (ast, no imports): layers, cycles, privacy.

- Imports only go down the layers (docs/DESIGN.md): format < fs < store < fuse, ops, replicate < daemon, cli (and replicas_cli),
  with the small shared modules (errors, sizes, checks, tasks) below everything.
- No import cycle between modules.
- No module reads another object's underscore attributes (`other._x`): state belongs to one
  owner, and others go through its methods.
"""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ckptfs"
BASE = {"errors", "sizes", "checks", "tasks"}
LAYER = {"format": 1, "fs": 2, "store": 3, "fuse": 4, "ops": 4, "replicate": 4, "daemon": 5, "cli": 6, "replicas_cli": 6, "__main__": 7,
         "__init__": 0}
NAMEDTUPLE_API = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """ckptfs modules `name` imports (anywhere in it, relative or absolute)."""
    is_pkg = (PKG / name.replace(".", "/") / "__init__.py").exists()
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("ckptfs"):
                mod = node.module[len("ckptfs."):] if node.module != "ckptfs" else ""
            else:
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}" if mod else alias.name
                out.add(sub if sub in known else mod)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ckptfs."):
                    out.add(alias.name[len("ckptfs."):])
    return {m for m in out if m in known and m != name}


def layer(name: str) -> int:
    top = name.split(".")[0]
    return 0 if top in BASE or name == "" else LAYER[top]


def test_imports_only_go_down_the_layers():
    mods = modules()
    bad = []
    for name, tree in mods.items():
        for dep in imports(name, tree, set(mods)):
            if layer(dep) > layer(name) and name not in ("", "__init__"):
                bad.append(f"{name} imports {dep}")
    assert not bad, "imports that go up a layer:\n" + "\n".join(bad)


def test_no_import_cycles():
    mods = modules()
    graph = {n: imports(n, t, set(mods)) for n, t in mods.items()}
    graph[""] = set()  # the package's lazy __getattr__ import of ops.api is not a cycle at import time
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in graph[n]:
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_reads_another_objects_private_attributes():
    bad = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr in NAMEDTUPLE_API:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            bad.append(f"{name}:{node.lineno}: .{attr} of {ast.unparse(node.value)}")
    assert not bad, "private attributes read from outside their object:\n" + "\n".join(bad)


def test_the_checks_see_the_package():
    mods = modules()
    assert {"store.store", "store.ordering", "fs.facade", "format.records", "daemon"} <= set(mods)
    assert "store.ordering" in imports("store.store", mods["store.store"], set(mods))

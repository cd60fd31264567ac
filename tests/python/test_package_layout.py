"""The package's shape (the brief): no import circles among tensor_ops'
modules, and one op table driving the Python op path."""
import ast
import pathlib

# The source tree, not the imported copy: CI's sanitizer build imports a
# partial copy of the package (without tensor_ops.torch).
PKG = pathlib.Path(__file__).resolve().parents[2] / "python" / "tensor_ops"


def _modules() -> dict:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _edges(mods: dict) -> dict:
    """Module-level imports between the package's own modules (imports inside
    functions are deferred on purpose and do not count; the compiled _C is
    not a Python module)."""
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    if alias.name == "_C":
                        continue
                    for cand in (f"{target}.{alias.name}", target):
                        if cand in mods:
                            edges[m].add(cand)
                            break
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods)
    return edges


def _cycles(edges: dict) -> list:
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = 1
        for t in sorted(edges[n]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[n] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_circles():
    mods = _modules()
    assert "tensor_ops._optable" in mods and "tensor_ops.torch.functional" in mods, sorted(mods)
    cycles = _cycles(_edges(mods))
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_checker_finds_circles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []

"""The import structure of our packages (issue 32): no cycles, imports only down the layering, none inside
a function.

Read from the source with `ast` (nothing is imported): every .py under `jaxrl/`, `models/`, `kernels/` and
`sharding/`, module-level and function-level imports alike, relative imports resolved. The graph has an
edge A -> B for

* each module of ours that A names: `import a.b`, `from a import b` (the submodule `a.b` when there is
  one, else the package `a`) and `from .b import x`;
* each package whose `__init__` Python runs on the way there (`from jaxrl.rollout.params import x` runs
  `jaxrl/rollout/__init__.py`), except the packages A itself lives in (they are already running).

Imports under `if TYPE_CHECKING:` never run: they count for the layering (a type that needs an upward
import says the layering is wrong) but not for cycles (a config section's cross-section check annotating
its argument with the `TrainConfig` that contains the section is the usual case). A dynamic
`importlib.import_module(name)` is not seen: the ones left resolve "package.module:function" names given at
run time (user rewards and graph nodes, and the "builtin" reward: `jaxrl.rewards.registry`).

Checks:
  (a) no cycle between modules (the one printed is a shortest one through the first module of each
      strongly connected component);
  (b) every edge goes down or sideways in `LAYERS`; a module missing from `LAYERS` is an error too;
  (c) no import inside a function, except of a heavy optional third-party package (`LAZY_THIRD_PARTY`)
      or at one of the few places in `LAZY_EXCEPTIONS`, each with its reason (both lists must stay in use).

Where `jaxrl.config` sits: the typed config sections describe; they are not where runtime objects are
built. They import the registries and types they validate against (`jaxrl.algos`'s estimators, `models`,
`sharding`) and nothing of `data`, `rewards`, `rollout`, `train` or `flow`, so that every one of those can
import its own section. A section's values become an object in the module that owns the object
(`jaxrl.train.optim.make_optimizer(section, steps)`, `RolloutService.from_config(section, ...)`, ...).
"""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict, deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxrl", "models", "kernels", "sharding")

# The layer table, lowest first: a module may import modules of its own layer and of lower ones.
# From ARCHITECTURE.md (the design map): the "Packages" table (`kernels` and `models` import nothing of ours except
# `models -> kernels`; `sharding -> models`; `sharding` must not import `jaxrl`) and "Components":
# "Layering, lowest first: `models`, `kernels` -> `sharding` -> `jaxrl/{algos, data, rewards}` ->
# `jaxrl/rollout` -> `jaxrl/train` stages -> `jaxrl/flow` -> trainer and entry points". Refinements
# made here, inside that order: `jaxrl.runtime` (process-wide JAX settings, imports nothing of ours but
# `jaxrl.compile_log`, the per-program log it starts; `jaxrl.executable_store`, the cache beside JAX's persistent
# one, and `jaxrl.serialized_executable`, its files' format, sit with it) is the lowest `jaxrl` layer; `jaxrl.config` sits above `jaxrl.algos`, whose registries it validates
# against, and below everything that is configured (module docstring); `jaxrl.rewards` sits below
# `jaxrl.data`, whose opt-in code task is scored by the code reward. An entry names a module or a
# package (all of its modules); the longest matching entry wins.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kernels",),                        # (kernels.testing: the kernels' test cases, shared with scripts/)
    ("models",),
    ("sharding",),
    ("jaxrl.runtime", "jaxrl.compile_log", "jaxrl.executable_store", "jaxrl.serialized_executable", "jaxrl.algos"),
    ("jaxrl.config",),
    ("jaxrl.rewards",),
    ("jaxrl.data", "jaxrl.envs"),        # envs: environments stepped in the reward pool's workers
    ("jaxrl.rollout",),
    ("jaxrl.train", "jaxrl.eval"),       # the train stages (step, update, batch, blockwise, stream, ...); held-out eval
    ("jaxrl.flow",),
    ("jaxrl.train.trainer", "jaxrl.train.__main__", "jaxrl.generate", "jaxrl.eval.__main__", "jaxrl.demo",
     "jaxrl.sim", "jaxrl.testing"),      # the simulator runs the mechanisms' own decision code; what tests and
                                         # scripts share
)
ROOT_PACKAGE = "jaxrl"                   # its __init__ is a docstring: below everything

# Third-party packages a function may import: heavy, and needed only on one path of a run.
LAZY_THIRD_PARTY: dict[str, str] = {
    "matplotlib": "~0.9 s to import (pyplot); only the figure-writing functions (a run's curves, PAT profile, "
                  "simulator report) use it",
    "pyarrow": "~0.5 s to import; only a Parquet dataset needs it",
    "math_verify": "~0.5 s to import (SymPy, latex2sympy2); only the math reward uses it",
}

# (module, function) -> why an import there stays inside the function.
LAZY_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("jaxrl.train.__main__", "main"): "the entry point imports the trainer (optax, orbax, math-verify, "
                                      "matplotlib: ~2 s) after the command line and the start-up checks, so a "
                                      "bad config or path answers at once",
    ("jaxrl.train.__main__", "local_devices"): "main's device count, called after the start-up checks; "
                                               "jaxrl.train.distributed imports JAX",
}

AWAITING_CALLERS: dict[tuple[str, str], str] = {}   # (issue 32: empty since trainer.py calls the owners)


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str           # the module that imports
    target: str             # the module of ours it depends on, or a third-party top-level name
    line: int
    function: str | None    # the enclosing function ("Class.method"), None at module level
    ours: bool
    implicit: bool = False  # a package __init__ that Python runs on the way to an imported module
    type_only: bool = False  # under `if TYPE_CHECKING:`


def discover(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `packages` (a package is its __init__.py)."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


class _Imports(ast.NodeVisitor):
    """The imports of one module; class bodies run at import time and count as module level."""

    def __init__(self, name: str, mods: dict[str, Path], roots):
        self.name, self.mods, self.roots = name, mods, tuple(roots)
        self.package = name if mods[name].name == "__init__.py" else name.rpartition(".")[0]
        self.scope: list[tuple[str, bool]] = []      # (name, is a function) of the enclosing defs
        self.type_only = False
        self.out: list[Import] = []

    def _enter(self, node, function: bool):
        self.scope.append((node.name, function))
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node):
        self._enter(node, True)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self._enter(node, False)

    def visit_If(self, node):
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            self.visit(test)
            before, self.type_only = self.type_only, True
            for child in node.body:
                self.visit(child)
            self.type_only = before
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node):
        module = node.module
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:      # `from a import b`: the submodule a.b when there is one, else a
            sub = f"{module}.{alias.name}"
            self._add(node, sub if sub in self.mods else module)

    def _add(self, node, dotted: str):
        function = ".".join(n for n, _ in self.scope) if any(f for _, f in self.scope) else None
        if dotted.split(".")[0] not in self.roots:
            self.out.append(Import(self.name, dotted.split(".")[0], node.lineno, function, False,
                                   type_only=self.type_only))
            return
        parts = dotted.split(".")
        target = next((m for m in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if m in self.mods), None)
        assert target is not None, f"{self.name}:{node.lineno}: {dotted!r} is not a module of ours"
        self.out.append(Import(self.name, target, node.lineno, function, True, type_only=self.type_only))
        running = set(_ancestors(self.name))
        for pkg in _ancestors(target):
            if pkg not in running and pkg in self.mods:
                self.out.append(Import(self.name, pkg, node.lineno, function, True, True, self.type_only))


def scan(root: Path = ROOT, packages=PACKAGES, awaiting=()) -> list[Import]:
    """Every import of every module under `packages` (see the module docstring), less those inside the
    (module, function)s of `awaiting`."""
    mods = discover(root, packages)
    out = []
    for name, path in mods.items():
        v = _Imports(name, mods, packages)
        v.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        out += [imp for imp in v.out if (imp.importer, imp.function) not in awaiting]
    return out


def graph(imports: list[Import]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports when it runs (type-only imports left out)."""
    g: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        if imp.ours and not imp.type_only and imp.target != imp.importer:
            g[imp.importer].add(imp.target)
    return g


def _components(g: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps = []
    for root in sorted(set(g) | {t for ts in g.values() for t in ts}):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(g.get(root, ()))))]
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        comps.append(comp)
    return comps


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """A shortest cycle through the first module of each strongly connected component, as
    [m0, m1, ..., m0]."""
    out = []
    for comp in _components(g):
        start = min(comp)
        prev = {start: None}
        queue = deque([start])
        while queue:
            v = queue.popleft()
            if start in g.get(v, ()):
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                out.append(path[::-1] + [start])
                break
            for w in sorted(g.get(v, ())):
                if w in comp and w not in prev:
                    prev[w] = v
                    queue.append(w)
    return sorted(out)


def layer_of(module: str, layers=LAYERS, root_package: str = ROOT_PACKAGE) -> int | None:
    if module == root_package:
        return -1
    best, found = -1, None
    for i, entries in enumerate(layers):
        for e in entries:
            if (module == e or module.startswith(e + ".")) and len(e) > best:
                best, found = len(e), i
    return found


def layering_violations(imports: list[Import], layers=LAYERS, root_package: str = ROOT_PACKAGE) -> list[str]:
    out = []
    for imp in imports:
        if not imp.ours:
            continue
        a, b = layer_of(imp.importer, layers, root_package), layer_of(imp.target, layers, root_package)
        if a is not None and b is not None and b > a:
            how = " (its package __init__ runs)" if imp.implicit else ""
            out.append(f"{imp.importer}:{imp.line} (layer {a}) imports {imp.target}{how} (layer {b})")
    return sorted(set(out))


def function_imports(imports: list[Import], third_party=LAZY_THIRD_PARTY, exceptions=LAZY_EXCEPTIONS) -> list[str]:
    out = []
    for imp in imports:
        if imp.function is None or imp.implicit:
            continue
        if not imp.ours and imp.target in third_party:
            continue
        if (imp.importer, imp.function) in exceptions:
            continue
        out.append(f"{imp.importer}:{imp.line} in {imp.function}(): import {imp.target}")
    return sorted(set(out))


# ------------------------------------------------------------------------------------------ the checks


def test_no_import_cycles():
    g = graph(scan(awaiting=AWAITING_CALLERS))
    found = cycles(g)
    assert not found, "import cycles (a shortest one per tangle, then every module of the tangle):\n" + "\n".join(
        f"{' -> '.join(c)}\n    [{', '.join(sorted(comp))}]" for c, comp in zip(found, sorted(_components(g), key=min)))


def test_every_module_has_a_layer():
    missing = sorted({m for m in discover(ROOT) if layer_of(m) is None})
    assert not missing, f"modules missing from LAYERS (tests/test_imports.py): {missing}"


def test_imports_follow_the_layering():
    bad = layering_violations(scan(awaiting=AWAITING_CALLERS))
    assert not bad, "imports against the layering (LAYERS, lowest first):\n" + "\n".join(bad)


def test_no_imports_inside_functions():
    bad = function_imports(scan(awaiting=AWAITING_CALLERS))
    assert not bad, ("imports inside functions (move them to the module top; LAZY_THIRD_PARTY and "
                     "LAZY_EXCEPTIONS list the allowed ones):\n" + "\n".join(bad))


def imports_of_tests(root: Path = ROOT) -> list[str]:
    """"file:line module" for every import of `tests` (or a module under it) in a script of `scripts/`, at any depth
    (what both need belongs in the packages: `jaxrl.testing`, `kernels.testing`)."""
    out = []
    for path in sorted((root / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            out += [(str(path.relative_to(root)), node.lineno, n) for n in names if n.split(".")[0] == "tests"]
    return [f"{f}:{line} {n}" for f, line, n in sorted(out)]


def test_scripts_do_not_import_tests(tmp_path):
    bad = imports_of_tests()
    assert not bad, "scripts/ importing tests/ (move what both need into jaxrl.testing or kernels.testing):\n" + \
        "\n".join(bad)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "s.py").write_text("def f():\n    from tests.test_x import TOL\nimport tests.y\n")
    assert imports_of_tests(tmp_path) == ["scripts/s.py:2 tests.test_x", "scripts/s.py:3 tests.y"]


def test_allowlists_are_in_use():
    imports = scan()
    lazy = [imp for imp in imports if imp.function is not None and not imp.implicit]
    unused = sorted(set(LAZY_THIRD_PARTY) - {imp.target for imp in lazy if not imp.ours})
    lazy_at = {(imp.importer, imp.function) for imp in lazy}
    unused += sorted(f"{m}.{f}" for m, f in (set(LAZY_EXCEPTIONS) | set(AWAITING_CALLERS)) - lazy_at)
    assert not unused, f"allowlist entries with no lazy import left (remove them): {unused}"


# ------------------------------------------------------------------------------- the checker itself


def _write(root: Path, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_cycles_upward_and_lazy_imports(tmp_path):
    _write(tmp_path, {
        "low/__init__.py": "",
        "low/a.py": "from . import b\n",                    # low.a -> low.b -> low.a: a cycle
        "low/b.py": "def f():\n    from low.a import x\n",  # ... through a function-level import
        "low/c.py": "import json\nfrom high.d import y\n",  # upward, and it runs high/__init__
        "low/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from high.f import z\n",
        "high/__init__.py": "from .d import y\n",
        "high/f.py": "from low import e\n",             # a cycle only through a type-only import: none
        "high/d.py": "from ..low import c\nimport low.c as lc\n\n\nclass K:\n    def m(self):\n"
                     "        import matplotlib\n        import json\n",
    })
    layers = (("low",), ("high",))
    imports = scan(tmp_path, ("low", "high"))
    assert cycles(graph(imports)) == [["high", "high.d", "low.c", "high"], ["low.a", "low.b", "low.a"]]
    assert layering_violations(imports, layers, "none") == [
        "low.c:2 (layer 0) imports high (its package __init__ runs) (layer 1)",
        "low.c:2 (layer 0) imports high.d (layer 1)",
        "low.e:3 (layer 0) imports high (its package __init__ runs) (layer 1)",
        "low.e:3 (layer 0) imports high.f (layer 1)"]
    assert function_imports(imports, {"matplotlib": "heavy"}, {}) == [
        "high.d:8 in K.m(): import json", "low.b:2 in f(): import low.a"]
    assert function_imports(imports, {"matplotlib": "heavy"}, {("low.b", "f"): "why", ("high.d", "K.m"): "why"}) == []
    assert layer_of("elsewhere", layers, "none") is None

"""The package's layers hold: imports run one way only, down the layers, with no cycle.

vocabulary -> reference -> kernels -> ops -> intercept -> functional -> Flax layers -> swap-in ->
analysis. Two checks: the static import graph of every module under jaxquant/ (no cycle, no edge to
a higher layer, no import inside a function), and what importing each layer loads in a fresh
interpreter (the reference loads no kernel, op or integration module, and never the CUDA library).
"""

import ast
import fnmatch
import json
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PACKAGE = _ROOT / "jaxquant"

# Layer names, lowest first, with the module patterns each holds; the longest matching
# pattern places a module.
_LAYERS = (
  (
    "vocabulary",
    (
      "jaxquant.formats",
      "jaxquant.tensor",
      "jaxquant.roles",
      "jaxquant.quantizers",
      "jaxquant.recipes",
    ),
  ),
  ("reference", ("jaxquant.reference", "jaxquant.reference.*", "jaxquant.scaling")),
  ("kernels", ("jaxquant.kernels", "jaxquant.kernels.*")),
  ("ops", ("jaxquant.ops", "jaxquant.ops.*")),
  ("intercept", ("jaxquant.intercept", "jaxquant.intercept.*")),
  ("functional", ("jaxquant.functional", "jaxquant.functional.*")),
  ("flax layers", ("jaxquant.flax.*",)),
  ("swap-in", ("jaxquant.flax.swap", "jaxquant.flax.swap.*")),
  ("flax", ("jaxquant.flax",)),
  ("analysis", ("jaxquant.analysis", "jaxquant.analysis.*")),
  ("jaxquant", ("jaxquant",)),
)


def _layer(module: str) -> int:
  matches = [
    (len(pattern), rank)
    for rank, (_, patterns) in enumerate(_LAYERS)
    for pattern in patterns
    if fnmatch.fnmatchcase(module, pattern)
  ]
  if not matches:
    raise AssertionError(f"{module} belongs to no layer of tests/test_layers.py's _LAYERS")
  return max(matches)[1]


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for path in _PACKAGE.rglob("*.py"):
    parts = path.relative_to(_ROOT).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return modules


def _imported(node: ast.AST, module: str, is_package: bool, modules) -> list[str]:
  """The jaxquant modules an import statement names: `from P import name` names P.name
  where that is a module, P otherwise."""
  if isinstance(node, ast.Import):
    names = [alias.name for alias in node.names]
  else:
    base = node.module or ""
    if node.level:
      package = module.split(".") if is_package else module.split(".")[:-1]
      package = package[: len(package) - node.level + 1]
      base = ".".join(package + ([node.module] if node.module else []))
    names = [
      f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
    ]
  return [name for name in names if name == "jaxquant" or name.startswith("jaxquant.")]


def _graph():
  """module -> the modules its import statements run, and its function-local imports.

  Importing `a.b.c` also runs the __init__ of `a.b` (and `a`): an edge to each package
  above the target that does not also contain the importer (a module's own packages run
  before it anyway)."""
  modules = _modules()
  edges, local = {m: set() for m in modules}, []
  for module, path in modules.items():
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        for inner in ast.walk(node):
          if isinstance(inner, (ast.Import, ast.ImportFrom)) and _imported(
            inner, module, is_package, modules
          ):
            local.append(f"{module}:{inner.lineno}")
      if not isinstance(node, (ast.Import, ast.ImportFrom)):
        continue
      for target in _imported(node, module, is_package, modules):
        while target not in modules:  # an attribute path: its module
          target = target.rpartition(".")[0]
        parts = target.split(".")
        for depth in range(1, len(parts) + 1):
          runs = ".".join(parts[:depth])
          inside = module == runs or module.startswith(runs + ".")
          if runs == target and runs != module or not inside:
            edges[module].add(runs)
  return edges, local


def _cycles(edges) -> list[list[str]]:
  """The strongly connected groups of more than one module (Tarjan)."""
  index, low, stack, on_stack, groups = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        groups.append(sorted(group))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return groups


def test_import_graph_has_no_cycle():
  edges, _ = _graph()
  cycles = _cycles(edges)
  assert not cycles, "import cycles:\n" + "\n".join(map(str, cycles))


def test_imports_run_down_the_layers():
  edges, _ = _graph()
  upward = [
    f"{m} ({_LAYERS[_layer(m)][0]}) imports {t} ({_LAYERS[_layer(t)][0]})"
    for m, targets in sorted(edges.items())
    for t in sorted(targets)
    if _layer(t) > _layer(m)
  ]
  assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_function_local_imports():
  _, local = _graph()
  assert not local, "function-local imports of jaxquant modules: " + ", ".join(local)


def test_the_checks_see_cycles_and_upward_edges():
  """The graph walk itself: a planted cycle and an upward edge are found."""
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _layer("jaxquant.ops._gemm") > _layer("jaxquant.kernels._cast")
  assert _layer("jaxquant.flax.swap._x") > _layer("jaxquant.flax._state")
  assert _layer("jaxquant.flax") > _layer("jaxquant.flax.swap")
  edges, _ = _graph()
  # jaxquant.scaling imports jaxquant.reference._scaling, which runs jaxquant.reference too.
  assert {"jaxquant.reference", "jaxquant.reference._scaling"} <= edges["jaxquant.scaling"]


_LOADS = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
maps = open("/proc/self/maps").read() if sys.platform == "linux" else ""
print(json.dumps({"modules": sorted(m for m in sys.modules if m.startswith("jaxquant")),
                  "cuda_library": "libjaxquant_ffi" in maps}))
"""


def _loaded_by(module: str) -> dict:
  out = subprocess.run(
    [sys.executable, "-c", _LOADS, module],
    cwd=_ROOT,
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
  "module",
  [
    "jaxquant.formats",
    "jaxquant.tensor",
    "jaxquant.roles",
    "jaxquant.quantizers",
    "jaxquant.recipes",
    "jaxquant.scaling",
    "jaxquant.reference",
    "jaxquant",
    "jaxquant.kernels",
    "jaxquant.ops",
    "jaxquant.intercept",
    "jaxquant.functional",
    "jaxquant.flax",
  ],
)
def test_importing_a_layer_loads_nothing_above_it(module):
  """Each layer alone: its import runs no module of a higher layer (the package's own
  __init__ aside, which every import runs and which loads the vocabulary alone)."""
  loaded = _loaded_by(module)
  ceiling = _layer("jaxquant.formats") if module == "jaxquant" else _layer(module)
  above = [m for m in loaded["modules"] if m != "jaxquant" and _layer(m) > ceiling]
  assert above == []
  if ceiling < _layer("jaxquant.kernels"):
    assert not loaded["cuda_library"]

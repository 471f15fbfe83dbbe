"""Every public function and method carries type hints (STYLE.md, Mechanics).

Checked on the source with ``ast``, nothing imported. Public: a module-level function whose
name does not start with ``_``, and, in a class whose name does not start with ``_``, a method
that does not either, or ``__init__``/``__call__``. Each needs an annotation on every
parameter but ``self``/``cls`` (``*args`` and ``**kwargs`` included) and a return annotation
(except ``__init__``).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jaxtune", "converters", "pallas_kernels")
PUBLIC_DUNDERS = ("__init__", "__call__")

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _public_functions(tree: ast.Module) -> list[tuple[str, Function, bool]]:
  """(qualified name, node, is a method) of every public function and method of a module."""
  out = []
  for node in tree.body:
    if isinstance(node, Function) and not node.name.startswith("_"):
      out.append((node.name, node, False))
    elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
      for item in node.body:
        if not isinstance(item, Function):
          continue
        if not item.name.startswith("_") or item.name in PUBLIC_DUNDERS:
          out.append((f"{node.name}.{item.name}", item, True))
  return out


def _missing(fn: Function, method: bool) -> list[str]:
  """What ``fn`` leaves unannotated: parameter names, and "return"."""
  args = fn.args
  params = [*args.posonlyargs, *args.args]
  is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
  if method and not is_static and params and params[0].arg in ("self", "cls"):
    params = params[1:]
  params += args.kwonlyargs
  params += [a for a in (args.vararg, args.kwarg) if a is not None]
  out = [a.arg for a in params if a.annotation is None]
  if fn.returns is None and fn.name != "__init__":
    out.append("return")
  return out


def unannotated(root: Path = ROOT) -> list[str]:
  """``path:line name (missing)`` for every public function lacking a hint."""
  problems = []
  for package in PACKAGES:
    for path in sorted((root / package).rglob("*.py")):
      tree = ast.parse(path.read_text(), str(path))
      for name, fn, method in _public_functions(tree):
        missing = _missing(fn, method)
        if missing:
          where = f"{path.relative_to(root)}:{fn.lineno}"
          problems.append(f"{where} {name} ({', '.join(missing)})")
  return problems


def test_the_scan_finds_functions():
  tree = ast.parse((ROOT / "pallas_kernels" / "nf4.py").read_text())
  names = {name for name, _, _ in _public_functions(tree)}
  assert {"quantize", "dequantize_linear"} <= names


def test_the_scan_flags_what_lacks_a_hint():
  source = """
def f(a, b: int, *args, c: int = 0, **kw) -> int: ...
def _private(a): ...
class C:
  def __init__(self, x): ...
  def __call__(self, x: int): ...
  def ok(self, x: int) -> int: ...
  def _helper(self, x): ...
  def __repr__(self): ...
class _Hidden:
  def m(self, x): ...
"""
  got = {name: _missing(fn, method) for name, fn, method in _public_functions(ast.parse(source))}
  assert got == {
    "f": ["a", "args", "kw"],
    "C.__init__": ["x"],
    "C.__call__": ["return"],
    "C.ok": [],
  }


def test_every_public_function_has_type_hints():
  problems = unannotated()
  assert not problems, "public functions without type hints:\n" + "\n".join(problems)

"""Every module imports alone, and the layers of DESIGN.md import only from below.

Each module of jaxtune/, converters/ and pallas_kernels/ is imported into an interpreter
that holds none of our modules (a cycle that only some import orders reach fails there),
which also reports whether the import loaded Mosaic GPU: only the kernel modules themselves
may. The layering rules are checked on the source (every import statement, at module level
and in functions).
"""

import ast
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jaxtune", "converters", "pallas_kernels")
# Loaded by the Mosaic GPU kernels only. (jax itself loads parts of jax._src.pallas.mosaic_gpu
# and jaxlib's Mosaic dialect whenever flax is imported; those are not these.)
MOSAIC = ("jax.experimental.pallas.mosaic_gpu", "jax.experimental.mosaic.gpu")
KERNEL_FILES = (  # they import Mosaic GPU
  "kernel",
  "kernel_backward",
  "kernel_common",
  "kernel_pipeline",
  "lookups",
)
ENTRY_POINTS = ("jaxtune.train", "jaxtune.export", "jaxtune.generate")
NF4_FORMAT = ("pallas_kernels.nf4", "pallas_kernels.nf4_maps")


def _module_files() -> dict[str, Path]:
  out = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


MODULES = _module_files()


def _is_kernel(name: str) -> bool:
  return name.startswith("pallas_kernels.") and name.rsplit(".", 1)[-1] in KERNEL_FILES


# A server that loads the third-party packages every module needs (never a module of ours, nor
# Mosaic GPU), then forks one child per module named on its command line: each child imports
# that module into an interpreter holding none of ours, and reports the Mosaic GPU and kernel
# modules that came with it (or its traceback) as one JSON line. Forking skips loading JAX
# anew per module; nothing has started a thread before the forks (no backend is created).
_SERVER = f"""
import importlib, json, os, sys, traceback
import jax, jax.numpy, numpy, flax.nnx, optax
for name in sys.argv[1:]:
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(read)
    try:
      importlib.import_module(name)
      loaded = sorted(
        m for m in sys.modules
        if m.startswith({MOSAIC!r})
        or (m.startswith("pallas_kernels.") and m.rsplit(".", 1)[-1] in {KERNEL_FILES!r})
      )
      result = {{"ok": True, "loaded": loaded}}
    except BaseException:
      result = {{"ok": False, "error": traceback.format_exc()}}
    os.write(write, json.dumps(result).encode())
    os._exit(0)
  os.close(write)
  with os.fdopen(read) as f:
    text = f.read()
  os.waitpid(pid, 0)
  print(json.dumps({{"name": name, **json.loads(text or '{{"ok": false, "error": "died"}}')}}))
"""


def _import_each_alone(names: list[str]) -> dict[str, dict]:
  # cwd first on sys.path: this checkout's modules, not an installed copy.
  proc = subprocess.run(
    [sys.executable, "-c", _SERVER, *names],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  results = {}
  for line in proc.stdout.splitlines():
    row = json.loads(line)
    results[row.pop("name")] = row
  for name in names:  # the server itself died: its stderr says why
    results.setdefault(name, {"ok": False, "error": proc.stderr[-3000:]})
  return results


@pytest.fixture(scope="module")
def imported() -> dict[str, dict]:
  """Every module imported into an interpreter with none of ours loaded (forked children of
  two servers, each of which loaded JAX once)."""
  names = list(MODULES)
  with ThreadPoolExecutor(2) as pool:
    halves = pool.map(_import_each_alone, (names[0::2], names[1::2]))
  return {k: v for half in halves for k, v in half.items()}


def test_modules_are_discovered():
  some = {"jaxtune", "jaxtune.models.decoder", "jaxtune.hf.load", "pallas_kernels.nf4_matmul.ops"}
  assert some <= MODULES.keys()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODULES))
def test_imports_alone(imported, name):
  child = imported[name]
  assert child["ok"], f"import {name} failed:\n{child['error']}"
  loaded = child["loaded"]
  if not _is_kernel(name):
    assert not loaded, f"import {name} loaded the Mosaic GPU kernels: {loaded}"


def _imports(name: str) -> set[str]:
  """The modules ``name`` imports anywhere in its source; ``from P import x`` counts as P.x
  when that is one of our modules, else as P."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parent, base] if base else parent)
      for alias in node.names:
        full = f"{base}.{alias.name}"
        out.add(full if full in MODULES else base)
  return out


def _ours(module: str) -> bool:
  return module.split(".")[0] in PACKAGES


def _third_party(module: str) -> str | None:
  top = module.split(".")[0]
  return None if top in PACKAGES or top in sys.stdlib_module_names else top


def _violations(rule) -> list[str]:
  return [
    f"{name} imports {m}" for name in MODULES for m in sorted(_imports(name)) if rule(name, m)
  ]


def test_kernels_depend_on_the_nf4_format_and_jax_only():
  def bad(name, m):
    if not name.startswith("pallas_kernels"):
      return False
    if _ours(m):
      return not m.startswith("pallas_kernels")
    return _third_party(m) not in (None, "jax", "numpy")

  assert not _violations(bad)


def test_nf4_format_depends_on_jax_and_numpy_only():
  def bad(name, m):
    if name not in NF4_FORMAT:
      return False
    return m not in NF4_FORMAT if _ours(m) else _third_party(m) not in (None, "jax", "numpy")

  assert not _violations(bad)


def test_nothing_imports_torch():
  """torch is for tests only (parity against transformers, peft, bitsandbytes)."""
  assert not _violations(lambda name, m: _third_party(m) == "torch")


def test_converters_do_not_import_entry_points():
  assert not _violations(lambda name, m: name.startswith("converters") and m in ENTRY_POINTS)


def test_entry_points_do_not_import_each_other():
  assert not _violations(lambda name, m: name in ENTRY_POINTS and m in ENTRY_POINTS and m != name)


# DESIGN.md's layers, bottom to top; a module imports only from its own layer or below.
# (jaxtune/__init__.py names its public API as strings, imported on first use.)
PACKAGE_LAYERS = {
  "pallas_kernels": 1,
  "converters": 2,
  "jaxtune.errors": 3,
  "jaxtune.run_config": 3,
  "jaxtune.setting_values": 3,
  "jaxtune.cli": 3,
  "jaxtune.nf4_storage": 3,
  "jaxtune.data": 3,
  "jaxtune.parallel": 4,
  "jaxtune.models": 5,
  "jaxtune.hf": 6,
  "jaxtune.training": 6,
  "jaxtune.run": 7,
  "jaxtune": 8,  # the package itself and the entry points
}


def _layer(module: str) -> int:
  """Which layer of DESIGN.md a module of ours belongs to: its longest package prefix's."""
  parts = module.split(".")
  for n in range(len(parts), 0, -1):
    prefix = ".".join(parts[:n])
    if prefix in PACKAGE_LAYERS:
      return PACKAGE_LAYERS[prefix]
  raise KeyError(module)


def test_every_module_has_a_layer_and_each_package_says_what_it_holds():
  for name in MODULES:
    _layer(name)
  for package in ("data", "parallel", "models", "hf", "training", "run"):
    init = ROOT / "jaxtune" / package / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_every_import_goes_down_the_layers():
  """NF4 format and kernels < file formats < leaves and data < parallel < models < HF in and
  out, training < the run < entry points."""
  assert not _violations(lambda name, m: _ours(m) and _layer(m) > _layer(name))


def test_converters_import_nothing_of_jaxtune_and_kernels_nothing_above_them():
  """The arrows between the top-level folders go one way: pallas_kernels <- converters <-
  jaxtune."""
  assert not _violations(lambda name, m: name.startswith("converters") and m.startswith("jaxtune"))
  assert not _violations(
    lambda name, m: name.startswith("pallas_kernels") and m.startswith(("jaxtune", "converters"))
  )


def test_package_is_lazy_and_generate_stays_the_function():
  """``import jaxtune`` loads nothing; importing the CLI module jaxtune.generate (which Python
  binds on the package) leaves ``jaxtune.generate`` the public function."""
  code = """
import sys
import jaxtune
assert "jax" not in sys.modules and "converters" not in sys.modules, sorted(sys.modules)
assert set(jaxtune.__all__) <= set(dir(jaxtune))
import jaxtune.generate
from jaxtune.run.api import generate
from jaxtune.generate import main
assert jaxtune.generate is generate, jaxtune.generate
assert main.__module__ == "jaxtune.generate"
from jaxtune import CheckpointError, from_pretrained
from pallas_kernels import nf4
assert nf4.__name__ == "pallas_kernels.nf4" and callable(from_pretrained)
"""
  child = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
  )
  assert child.returncode == 0, child.stderr

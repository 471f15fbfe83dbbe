"""The step store (``StepStore``): whole training steps, signed, kept beside JAX's persistent
compilation cache in a directory only this user can write (turned on with the cache:
compile_cache.use_compile_cache) and read back without tracing or lowering. ``plan.choose``
looks there first and keeps what it compiled there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import importlib
import importlib.util
import json
import os
import pickle
import platform
import secrets
import stat
import sys
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
  from jaxtune.training.plan import MemoryPlan


# Programs that JAX read back from its persistent compilation cache. On the CPU such a program,
# serialized again, loses functions: loaded from the step store it fails when it runs
# ("Function multiply_select_fusion not found", jax 0.11.2), and the store would only notice
# at the step, so the store keeps none of them there (a warm start then traces and lowers
# where only the compilation cache holds the step). On an H100 such programs (a Mosaic GPU
# kernel's, an XLA step's) loaded and ran with the same outputs as when first compiled
# (experiments/log/RESULTS-2026-11.md, session 27), so GPUs keep them.
FROM_CACHE: weakref.WeakSet = weakref.WeakSet()


STORE_NAME = "jaxtune-steps"  # the step store's directory, inside the compilation cache's
STORE_VAR = "JAXTUNE_STEP_STORE"  # "0": the command lines keep no whole steps (the cache only)
STORE_ENTRIES = 8  # whole steps the store keeps; the least recently used go first
_store_dir: Path | None = None  # the command lines' store (keep_steps_in, from use_compile_cache)


def keep_steps_in(directory: Path | None) -> None:
  """Where the command lines' store keeps its entries; None: the store is off
  (compile_cache.use_compile_cache decides)."""
  global _store_dir
  _store_dir = directory


class StepStore:
  """Whole training steps kept on disk, so that a later run of the same step (a second run,
  a resume) skips tracing, lowering and choosing, which JAX's compilation cache does not:
  its key is the lowered program, so every run traces and lowers the step (an 8B step: ~7 s
  on an H100, half of it the Mosaic kernels' lowering) before it can look.

  An entry's key is a digest of everything the program depends on: ``identity`` (the
  trainer's: graphdef, model config, the run's settings that reach the step, objective),
  the arguments' tree, shapes, dtypes, placements and devices, the runtime, the budget, the
  source of the packages a step runs (SOURCE_PACKAGES), the library versions, the backend
  and JAX's settings (XLA_FLAGS among them). A key that differs in anything compiles anew.

  JAX's serialized executables are pickles (and programs are machine code): an entry runs
  whatever its writer put there, so only this user's own entries are ever read. Before every
  read and write the store's directory must be this user's and writable by no one else, and
  an entry a regular file of this user's (``private_problem``); an entry is then a small
  header (JSON) and the pickled program, and the header's HMAC-SHA256 of both, keyed by a
  secret only this user can read (``KEY_NAME``, mode 0600), is checked before anything else
  of the file is parsed. An entry that fails any check is never unpickled: it is renamed
  ``*.refused`` (kept for whoever looks into it) with one line, and the step compiled anew.
  An entry is written whole or not at all (a temporary file renamed).
  Programs with host callbacks (interpreted Pallas kernels) are not kept, nor, on CPUs,
  programs that JAX read back from its compilation cache (``FROM_CACHE``)."""

  MAGIC = b"jaxtune step store 2\n"

  def __init__(self, path: Path):
    self.path = path

  @classmethod
  def open(
    cls,
    identity: str | None,
    args: tuple,
    runtime: Any,
    budget: tuple[int, str],
    logits_bytes: int,
  ) -> StepStore | None:
    """The entry of this step's key, or None where the store is off (no identity, no store,
    several processes)."""
    if identity is None or _store_dir is None or jax.process_count() > 1:
      return None
    h = hashlib.sha256()
    for part in (identity, repr(runtime), repr(budget), str(logits_bytes), _environment()):
      h.update(part.encode() + b"\0")
    h.update(str(jax.tree.structure(args)).encode())
    for leaf in jax.tree.leaves(args):
      sharding = getattr(leaf, "sharding", None)
      mesh = getattr(sharding, "mesh", None)
      ids = getattr(mesh, "device_ids", None)
      if ids is not None:
        ids = ids.tolist()
      elif sharding is not None:
        ids = sorted(d.id for d in sharding.device_set)
      h.update(f"{leaf.shape} {leaf.dtype} {sharding!r} {ids}\0".encode())
    return cls(_store_dir / f"{h.hexdigest()}.step")

  def load(self, args: tuple) -> tuple[Any, tuple] | None:
    """(compiled step, its plan's fields), or None where no entry is kept."""
    from jax.experimental import serialize_executable

    try:
      st = os.lstat(self.path)
    except OSError:
      return None
    problem = private_problem(self.path.parent) or _entry_problem(st)
    key = None if problem else _store_key(self.path.parent)
    if key is None:
      self._refuse(problem or "this user's key of the store cannot be read")
      return None
    try:
      header, payload = _read_entry(self.path.read_bytes(), key)
    except ValueError as e:  # not signed by this user's key: never unpickled
      self._refuse(str(e))
      return None
    try:
      program, in_tree, out_tree = pickle.loads(payload)  # signed by this user: their own
      plan_fields = _plan_fields(header["plan"])
      if in_tree != jax.tree.structure((tuple(args), {})):
        raise ValueError("its arguments' tree differs")
      devices = {d.id: d for d in jax.devices()}
      if jax.devices()[0].platform == "gpu":
        # A Mosaic GPU kernel in the program is compiled from its MLIR when the program
        # loads. In the train CLI that failed without this import ("Failed to lookup host
        # symbol ... body_mosaic_gpu", H100, 2 of 2 loads) and worked with it; it sets the
        # runtime library's path for that compiler. (A bare process loaded without it:
        # experiments/log/RESULTS-2026-11.md.) Tracing the step imports it otherwise.
        importlib.import_module("jax.experimental.mosaic.gpu")
      compiled = serialize_executable.deserialize_and_load(
        program, in_tree, out_tree, execution_devices=[devices[i] for i in header["devices"]]
      )
    except Exception as e:  # noqa: BLE001 (this user's own entry, of another jax or devices)
      _remove(self.path)
      print(
        f"jaxtune: the step store held an entry that could not be read ({self.path.name}: "
        f"{type(e).__name__}: {e}); compiled anew and removed it.",
        file=sys.stderr,
        flush=True,
      )
      return None
    with contextlib.suppress(OSError):  # removed meanwhile
      os.utime(self.path)  # recently used
    return compiled, plan_fields

  def _refuse(self, why: str) -> None:
    """An entry that is not certainly this user's: never read, renamed aside with one line."""
    aside = self.path.with_name(f"{self.path.name}.refused")
    try:
      os.replace(self.path, aside)
      kept = f"kept as {aside}"
    except OSError:
      kept = "left in place"
    print(
      f"jaxtune: the step store entry {self.path} was not read ({why}); {kept}, and the step "
      "compiled anew.",
      file=sys.stderr,
      flush=True,
    )

  def save(self, compiled: Any, chosen: MemoryPlan) -> None:
    """Keep ``compiled`` (best effort: a program that cannot be serialized, or on a CPU one
    that JAX read back from its compilation cache, is not kept; nor anything in a store that
    is not this user's alone)."""
    from jax.experimental import serialize_executable

    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None or unloaded.host_callbacks or unloaded.keepalive:
      return
    if compiled in FROM_CACHE and jax.default_backend() == "cpu":  # see FROM_CACHE
      return
    try:
      payload = pickle.dumps(serialize_executable.serialize(compiled), pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 (not serializable here: the compilation cache still helps)
      return
    rt = chosen.runtime
    fields = (rt.remat, rt.loss_chunk, rt.scan_layers, rt.kept_layers, chosen.planned,
              chosen.budget, chosen.budget_source, chosen.rejected)  # fmt: skip
    header = {"plan": fields, "devices": [d.id for d in unloaded.device_list]}
    directory = self.path.parent
    part = self.path.with_name(f"{self.path.name}.{os.getpid()}.part")
    try:
      directory.mkdir(mode=0o700, parents=True, exist_ok=True)
      key = None if private_problem(directory) else _store_key(directory, create=True)
      if key is None:
        return
      fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
      with os.fdopen(fd, "wb") as f:
        f.write(_entry_bytes(header, payload, key))
      os.replace(part, self.path)
    except OSError:  # a full or read-only disk: the run goes on without the entry
      _remove(part)
      return
    kept = sorted(directory.glob("*.step"), key=_mtime, reverse=True)
    for old in kept[STORE_ENTRIES:]:
      _remove(old)
    # What a writer killed mid-write left (an hour old: not a running writer's).
    for left in directory.glob("*.part"):
      if _mtime(left) < time.time() - 3600:
        _remove(left)


KEY_NAME = "key"  # the step store's secret (32 random bytes, mode 0600) in its directory


def private_problem(directory: Path) -> str | None:
  """Why ``directory`` is not this user's alone (None when it is): a symbolic link, not a
  directory, another user's, or writable by its group or by others."""
  try:
    st = os.lstat(directory)
  except OSError as e:
    return f"{directory} cannot be read ({e.strerror})"
  if stat.S_ISLNK(st.st_mode):
    return f"{directory} is a symbolic link"
  if not stat.S_ISDIR(st.st_mode):
    return f"{directory} is not a directory"
  if st.st_uid != os.getuid():
    return f"{directory} belongs to another user (uid {st.st_uid})"
  if st.st_mode & 0o022:
    return f"{directory} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
  return None


def _entry_problem(st: os.stat_result) -> str | None:
  if not stat.S_ISREG(st.st_mode):
    return "it is not a regular file"
  if st.st_uid != os.getuid():
    return f"it belongs to another user (uid {st.st_uid})"
  if st.st_mode & 0o022:
    return f"it is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
  return None


def _store_key(directory: Path, create: bool = False) -> bytes | None:
  """This user's secret of the store in ``directory`` (made on the first write), or None
  where it is missing or could be anyone's (not a private regular file of this user's)."""
  path = directory / KEY_NAME
  if create and not path.exists():
    part = directory / f"{KEY_NAME}.{os.getpid()}.part"
    try:
      fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
      with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
      os.link(part, path)  # fails where another writer made one first: theirs is kept
    except FileExistsError:
      pass
    finally:
      _remove(part)
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
  except OSError:
    return None
  with os.fdopen(fd, "rb") as f:
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
      return None
    key = f.read(64)
  return key if len(key) == 32 else None


def _entry_bytes(header: dict, payload: bytes, key: bytes) -> bytes:
  """MAGIC, the header's length (8 bytes), the header (JSON), the payload; the header holds
  the HMAC of the rest of the header and of the payload."""
  body = json.dumps(header).encode()
  mac = hmac.new(key, body + b"\0" + payload, hashlib.sha256).hexdigest()
  signed = json.dumps({"hmac": mac, "body": body.decode()}).encode()
  return StepStore.MAGIC + len(signed).to_bytes(8, "little") + signed + payload


def _read_entry(data: bytes, key: bytes) -> tuple[dict, bytes]:
  """(header, payload) of an entry whose HMAC checks out; ValueError otherwise, before any of
  it but the signed header's JSON is parsed."""
  magic = StepStore.MAGIC
  if not data.startswith(magic) or len(data) < len(magic) + 8:
    raise ValueError("it is not an entry of this jaxtune's step store")
  n = int.from_bytes(data[len(magic) : len(magic) + 8], "little")
  start = len(magic) + 8
  if n > 1 << 20 or start + n > len(data):
    raise ValueError("its header is cut short")
  try:
    signed = json.loads(data[start : start + n])
    body, mac = signed["body"].encode(), signed["hmac"]
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError("its header is damaged") from e
  payload = data[start + n :]
  want = hmac.new(key, body + b"\0" + payload, hashlib.sha256).hexdigest()
  if not isinstance(mac, str) or not hmac.compare_digest(mac, want):
    raise ValueError("it is not signed by this user's key: written by someone else, or damaged")
  return json.loads(body), payload


def _plan_fields(fields: list) -> tuple:
  """The plan's fields as saved (JSON lists back to the tuples MemoryPlan holds)."""
  if len(fields) != 8:  # (remat, loss_chunk, scan_layers, kept_layers, planned, ...)
    raise ValueError("its plan has another form")
  *head, rejected = fields
  return (*head, tuple(tuple(r) for r in rejected))


def _remove(path: Path) -> None:
  with contextlib.suppress(OSError):
    path.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
  try:
    return path.stat().st_mtime
  except OSError:
    return 0.0


# The packages whose code a training step runs: their source is part of the step store's key.
SOURCE_PACKAGES = ("jaxtune", "pallas_kernels", "converters")


@functools.cache
def _environment() -> str:
  """What, besides the step's own inputs, decides the program XLA makes: this package's
  source, the versions, the backend and devices, JAX's settings and XLA's flags."""
  import flax
  import jaxlib
  import optax

  source = hashlib.sha256()
  for package in SOURCE_PACKAGES:
    spec = importlib.util.find_spec(package)
    for place in spec.submodule_search_locations if spec is not None else ():
      for path in sorted(Path(place).rglob("*.py")):
        source.update(path.relative_to(place).as_posix().encode() + b"\0" + path.read_bytes())
  device = jax.devices()[0]
  flags = sorted(
    (k, v) for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "NVIDIA_", "CUDA_"))
  )
  settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)
  return repr(
    (
      source.hexdigest(),
      platform.python_version(),
      jax.__version__,
      jaxlib.__version__,
      flax.__version__,
      optax.__version__,
      device.platform,
      device.client.platform_version,
      [d.device_kind for d in jax.devices()],
      flags,
      settings,
    )
  )

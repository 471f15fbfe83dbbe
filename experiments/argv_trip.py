"""The trip of `python -m jaxtune.train`'s settings, from main() to the first training step.

  cd TREE && PYTHONPATH=TREE python /path/to/experiments/argv_trip.py [--tree TREE] [-- FLAGS]

Runs `python -m jaxtune.train` in this process (runpy, as `-m` does) with TREE's jaxtune (TREE
defaults to the working directory; nothing of jaxtune is imported before TREE is first on
sys.path, and a module of jaxtune, converters or pallas_kernels loaded from elsewhere stops the
script). The run is the built-in default (the small Llama on the bundled data) with
`--steps 1 --export none --report-to none --out TMP/run` and FLAGS, on CPU (JAX_PLATFORMS=cpu
unless set), with fresh caches in TMP (XDG_CACHE_HOME, JAXTUNE_COMPILE_CACHE,
HF_DATASETS_CACHE; offline), the default checkpoint written there before the trace. The main
thread is traced with sys.setprofile from the call of jaxtune/train.py's main() to the
dispatch of the first training step: the first call made from a line of TREE/jaxtune that
calls `step_fn(` (--stop-at; the training loop's; the rest of the run is not traced). It
counts:

  (a) files: the distinct files under TREE/jaxtune and TREE/converters whose functions are
      called with the run's settings as an argument (`self` included; the items of *args and
      the values of **kwargs, not those containers): the argv list (a list of the strings of
      sys.argv[1:]), a RunConfig (an instance of a class named RunConfig from jaxtune), or a
      dict of parsed settings (a non-empty dict whose keys are all RunConfig fields).
      "with flags": also the argparse.Namespace of the parsed flags (one holding every field).
  (b) returns: the return events of those calls before the stop (an exception leaving a call
      is one; a generator's yield is one, its resumption a new call); "open" counts those
      calls not returned at the stop (the ones the step's dispatch is inside of).
  (c) argv parsed: calls of argparse.ArgumentParser.parse_args or parse_known_args, outermost
      only (parse_args' own parse_known_args is not counted again); checked: calls of
      RunConfig.checked; config.json read: files named config.json opened for reading through
      builtins.open / io.open (Path.read_text, read_bytes and open go through io.open);
      json.load of such a file is listed apart (its open is counted already).

Also counted: the files of jaxtune/ and converters/ with any function called in that span
(module code not counted). Prints a table by file (--functions: each function too), where each
(c) event happened, and one JSON line (`{"bench": "argv_trip", ...}`). Exit status: the run's
(the figures are printed either way); 3 where a module of ours came from outside TREE.
"""

import argparse
import builtins
import dataclasses
import io
import json
import linecache
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CORE_KINDS = frozenset({"argv", "RunConfig", "settings"})
STOP_AT = r"\bstep_fn\("  # a line of jaxtune that calls this dispatches a training step


@dataclasses.dataclass
class Trace:
  tree: Path
  argv: list[str]
  prefixes: tuple[str, ...] = ()  # the counted source folders, as "TREE/jaxtune/"
  ours: tuple[str, ...] = ()  # jaxtune, converters, pallas_kernels: where events are placed
  main_code: object = None  # jaxtune/train.py's main, once called
  active: bool = False
  done: bool = False
  stop: str = ""
  stop_at: re.Pattern = re.compile(STOP_AT)
  stop_lines: dict = dataclasses.field(default_factory=dict)  # (file, line) -> matches
  classes: tuple[type, ...] = ()
  fields: frozenset = frozenset()
  calls: list = dataclasses.field(default_factory=list)  # [file, qualname, kinds, returns]
  open_calls: dict = dataclasses.field(default_factory=dict)  # frame -> index in calls
  parses: list = dataclasses.field(default_factory=list)
  parse_depth: int = 0
  checked: list = dataclasses.field(default_factory=list)
  config_reads: list = dataclasses.field(default_factory=list)
  config_writes: list = dataclasses.field(default_factory=list)
  json_loads: list = dataclasses.field(default_factory=list)
  entered: set = dataclasses.field(default_factory=set)  # files with any function called

  def rel(self, filename: str) -> str:
    return os.path.relpath(filename, self.tree)

  def where(self, frame, depth: int = 3) -> str:
    """The ``depth`` innermost frames of ours at or above ``frame`` (innermost first), and
    ``frame`` itself where it is not ours."""
    places, first = [], frame
    while frame is not None and len(places) < depth:
      if frame.f_code.co_filename.startswith(self.ours):
        places.append(f"{self.rel(frame.f_code.co_filename)}:{frame.f_lineno}")
      frame = frame.f_back
    place = " <- ".join(places) or "?"
    if first is not None and not first.f_code.co_filename.startswith(self.ours):
      place += f" (in {Path(first.f_code.co_filename).name}:{first.f_lineno})"
    return place

  def find_classes(self) -> None:
    found = []
    for name, module in list(sys.modules.items()):
      cls = getattr(module, "RunConfig", None) if name.split(".")[0] == "jaxtune" else None
      if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls not in found:
        found.append(cls)
    self.classes = tuple(found)
    self.fields = frozenset(f.name for c in found for f in dataclasses.fields(c))

  def kind(self, value) -> str | None:
    if self.classes and isinstance(value, self.classes):
      return "RunConfig"
    t = type(value)
    if t is list or t is tuple:
      if len(value) == len(self.argv) and all(type(s) is str for s in value):
        return "argv" if list(value) == self.argv else None
      return None
    if t is dict and value and self.fields:
      return "settings" if all(type(k) is str and k in self.fields for k in value) else None
    if t is argparse.Namespace and self.fields and self.fields <= vars(value).keys():
      return "flags"
    return None

  def arguments(self, frame) -> list:
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:n])
    star = code.co_varnames[n] if code.co_flags & 0x04 else None
    starstar = code.co_varnames[n + (star is not None)] if code.co_flags & 0x08 else None
    local = frame.f_locals
    values = [local[a] for a in names if a in local]
    if star is not None:
      values += list(local.get(star, ()))
    if starstar is not None:
      values += list(local.get(starstar, {}).values())
    return values

  def profile(self, frame, event, arg):
    if not self.active:
      if event == "call" and frame.f_code is self.main_code:
        self.active = True
        self.find_classes()
      else:
        return
    if event == "call":
      code = frame.f_code
      if code.co_filename.startswith(self.ours):
        if not self.classes:
          self.find_classes()
        kinds = {k for v in self.arguments(frame) if (k := self.kind(v))}
        if code.co_name == "checked" and "RunConfig" in kinds:
          self.checked.append(self.where(frame.f_back))
        if code.co_name != "<module>" and code.co_filename.startswith(self.prefixes):
          self.entered.add(code.co_filename)
        if kinds and code.co_filename.startswith(self.prefixes):
          self.open_calls[frame] = len(self.calls)
          self.calls.append([self.rel(code.co_filename), code.co_qualname, frozenset(kinds), 0])
      self.check_stop(frame.f_back)
    elif event == "return":
      i = self.open_calls.pop(frame, None)
      if i is not None:
        self.calls[i][3] += 1
    elif event == "c_call":
      self.check_stop(frame)

  def check_stop(self, caller) -> None:
    """Stop at the first call made from a line of jaxtune that dispatches a training step."""
    if caller is None or not caller.f_code.co_filename.startswith(self.prefixes[0]):
      return
    place = caller.f_code.co_filename, caller.f_lineno
    matches = self.stop_lines.get(place)
    if matches is None:
      matches = self.stop_lines[place] = bool(self.stop_at.search(linecache.getline(*place)))
    if matches:
      self.stop = f"{self.rel(place[0])}:{place[1]} ({caller.f_code.co_qualname})"
      self.active, self.done = False, True
      sys.setprofile(None)


def _patch(trace: Trace) -> None:
  """Count argv parses, config.json opens and json.load of config.json while tracing."""
  real_open, real_load = builtins.open, json.load
  parser = argparse.ArgumentParser

  def counted_open(file, *args, **kwargs):
    if trace.active and isinstance(file, str | bytes | os.PathLike):
      path = os.fsdecode(file)
      if os.path.basename(path) == "config.json":
        mode = args[0] if args else kwargs.get("mode", "r")
        writes = any(c in mode for c in "wax+")
        entry = f"{trace.where(sys._getframe(1))}: {path}"
        (trace.config_writes if writes else trace.config_reads).append(entry)
    return real_open(file, *args, **kwargs)

  def counted_load(fp, *args, **kwargs):
    name = getattr(fp, "name", "")
    if trace.active and isinstance(name, str) and os.path.basename(name) == "config.json":
      trace.json_loads.append(f"{trace.where(sys._getframe(1))}: {name}")
    return real_load(fp, *args, **kwargs)

  def counted(method):
    def parse(self, *args, **kwargs):
      if trace.active and trace.parse_depth == 0:
        trace.parses.append(f"{method.__name__} at {trace.where(sys._getframe(1))}")
      trace.parse_depth += 1
      try:
        return method(self, *args, **kwargs)
      finally:
        trace.parse_depth -= 1

    parse.__name__ = method.__name__
    return parse

  builtins.open = io.open = counted_open
  json.load = counted_load
  parser.parse_args = counted(parser.parse_args)
  parser.parse_known_args = counted(parser.parse_known_args)


def _git(tree: Path) -> dict:
  def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    return done.stdout.strip()

  changed = git("status", "--porcelain", "--", "jaxtune", "converters", "pallas_kernels")
  return {
    "commit": git("rev-parse", "--short", "HEAD"),
    "commit_date": git("log", "-1", "--format=%cI"),
    "changed_files": len(changed.splitlines()),
  }


def _write_default_checkpoint(tree: Path) -> None:
  """The built-in checkpoint, written once before the trace (as on a machine that has run it)."""
  name = "jaxtune.run.default_model"
  if not (tree / "jaxtune" / "run" / "default_model.py").is_file():
    name = "jaxtune.default_model"  # trees before the packages (2026-12-02)
  __import__(name, fromlist=["ensure_default_checkpoint"]).ensure_default_checkpoint()


def _foreign_modules(tree: Path) -> list[str]:
  root = str(tree) + os.sep
  return sorted(
    f"{name} ({module.__file__})"
    for name, module in list(sys.modules.items())
    if name.split(".")[0] in ("jaxtune", "converters", "pallas_kernels")
    and getattr(module, "__file__", None)
    and not module.__file__.startswith(root)
  )


def _report(trace: Trace, status, info: dict, functions: bool) -> dict:
  def tally(kinds: frozenset) -> dict:
    calls = [c for c in trace.calls if c[2] & kinds]
    files = sorted({c[0] for c in calls})
    return {
      "files": len(files),
      "functions": len({(c[0], c[1]) for c in calls}),
      "calls": len(calls),
      "returns": sum(c[3] for c in calls),
      "open_at_stop": sum(1 for i in trace.open_calls.values() if trace.calls[i][2] & kinds),
      "file_list": files,
    }

  core = tally(CORE_KINDS)
  with_flags = tally(CORE_KINDS | {"flags"})
  print("\nfile | functions | calls | returns | kinds (core kinds; + flags in the last column)")
  print("---|---|---|---|---")
  for f in with_flags["file_list"]:
    rows = [c for c in trace.calls if c[0] == f]
    kinds = sorted(set().union(*(c[2] for c in rows)))
    core_rows = [c for c in rows if c[2] & CORE_KINDS]
    print(
      f"{f} | {len({c[1] for c in core_rows})} | {len(core_rows)} | "
      f"{sum(c[3] for c in core_rows)} | {', '.join(kinds)}"
    )
    for name in sorted({c[1] for c in rows}) if functions else ():
      named = [c for c in rows if c[1] == name]
      print(f"  {name}: {len(named)} calls, {sum(c[3] for c in named)} returns")
  print(
    f"\n(a) files: {core['files']} ({with_flags['files']} with flags)  "
    f"(b) returns: {core['returns']} of {core['calls']} calls to {core['functions']} functions, "
    f"{core['open_at_stop']} open at the stop ({with_flags['returns']} / {with_flags['calls']} "
    f"/ {with_flags['functions']} / {with_flags['open_at_stop']} with flags)"
  )
  print(f"    files of jaxtune/ and converters/ with any function called: {len(trace.entered)}")
  print(f"(c) argv parsed {len(trace.parses)}x: {'; '.join(trace.parses)}")
  print(f"    RunConfig.checked {len(trace.checked)}x: {'; '.join(trace.checked)}")
  print(f"    config.json read {len(trace.config_reads)}x:")
  for entry in trace.config_reads:
    print(f"      {entry}")
  if trace.json_loads:
    print(f"    json.load of config.json {len(trace.json_loads)}x: {'; '.join(trace.json_loads)}")
  print(f"stopped at: {trace.stop or 'the end of the run (no step dispatched)'}; exit {status}")
  row = {
    "bench": "argv_trip",
    **info,
    "files": core["files"],
    "returns": core["returns"],
    "calls": core["calls"],
    "functions": core["functions"],
    "open_at_stop": core["open_at_stop"],
    "files_with_flags": with_flags["files"],
    "returns_with_flags": with_flags["returns"],
    "files_entered": len(trace.entered),
    "argv_parsed": len(trace.parses),
    "checked": len(trace.checked),
    "config_json_read": len(trace.config_reads),
    "config_json_written": len(trace.config_writes),
    "json_load_config_json": len(trace.json_loads),
    "stopped_at": trace.stop or None,
    "exit": status,
    "file_list": core["file_list"],
  }
  print(json.dumps(row))
  return row


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tree", default=".", help="the source tree to measure (default: .)")
  p.add_argument("--keep", action="store_true", help="keep the temporary run and caches")
  p.add_argument(
    "--stop-at", default=STOP_AT, help=f"the dispatch line's pattern (default: {STOP_AT})"
  )
  p.add_argument("--functions", action="store_true", help="list the functions of each file")
  p.add_argument("flags", nargs="*", help="more flags for jaxtune.train (after --)")
  args = p.parse_args()
  tree = Path(args.tree).resolve()
  if not (tree / "jaxtune" / "train.py").is_file():
    sys.exit(f"argv_trip: no jaxtune/train.py in {tree}")
  work = Path(tempfile.mkdtemp(prefix="argv-trip-"))
  env = {
    "XDG_CACHE_HOME": work / "cache",
    "JAXTUNE_COMPILE_CACHE": work / "xla",
    "HF_DATASETS_CACHE": work / "datasets",
  }
  os.environ.update({k: str(v) for k, v in env.items()})
  for name, value in (("JAX_PLATFORMS", "cpu"), ("HF_HUB_OFFLINE", "1")):
    os.environ.setdefault(name, value)
  sys.path.insert(0, str(tree))
  flags = ["--steps", "1", "--export", "none", "--report-to", "none", "--out", str(work / "run")]
  flags += args.flags
  info = {
    "tree": str(tree),
    **_git(tree),
    "python": sys.version.split()[0],
    "command": "python -m jaxtune.train " + " ".join(flags),
  }
  trace = Trace(tree=tree, argv=flags, stop_at=re.compile(args.stop_at))
  trace.prefixes = tuple(f"{tree / d}{os.sep}" for d in ("jaxtune", "converters"))
  trace.ours = (*trace.prefixes, f"{tree / 'pallas_kernels'}{os.sep}")
  status = None
  try:
    _write_default_checkpoint(tree)
    if _foreign_modules(tree):
      sys.exit(f"argv_trip: modules not from {tree}: {', '.join(_foreign_modules(tree))}")
    train_py = str(tree / "jaxtune" / "train.py")
    _patch(trace)
    sys.argv = ["python -m jaxtune.train", *flags]

    def start(frame, event, arg):  # until main() is called: one comparison a call
      code = frame.f_code
      if event == "call" and code.co_name == "main" and code.co_filename == train_py:
        trace.main_code = code
        sys.setprofile(trace.profile)
        trace.profile(frame, event, arg)

    sys.setprofile(start)
    try:
      runpy.run_module("jaxtune.train", run_name="__main__", alter_sys=True)
      status = 0
    except SystemExit as e:
      status = e.code
    finally:
      sys.setprofile(None)
      trace.active = False
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)
  _report(trace, status, info, args.functions)
  foreign = _foreign_modules(tree)
  if foreign:  # then the figures are not the tree's
    print(f"argv_trip: modules not from {tree}: {', '.join(foreign)}", file=sys.stderr)
    return 3
  return status if isinstance(status, int) else 1


if __name__ == "__main__":
  sys.exit(main())

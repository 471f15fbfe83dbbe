"""A run's output directory: one run at a time in it, room and permission to write before
anything expensive runs, and a record of every start.

- ``Lock``: an exclusive ``flock`` on ``OUT/.jaxtune.lock``, held for the run's life and
  released on any exit (the kernel drops it when the process dies, so a lock left by a killed
  run is taken over, with a line saying whose it was). The file names the holder (pid, host,
  start time, command) so a second run can say which run is using the directory.
- ``check_place``: ``--out`` (and ``OUT/export``) usable: not a file, on a writable disk.
- ``check_room``: free space against what the run will write (checkpoints, the export).
- ``check_links``: no symbolic link inside ``--out`` (a write would follow it outside).
- ``record_start``: ``OUT/config-history/NNN.yaml``, one per start, with what changed.

Only process 0 of a multi-process run takes the lock and writes the history.
"""

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from jaxtune.errors import SaveError, UserError, size_text
from jaxtune.run_config import RunConfig
from jaxtune.training.files import link_error, write_error

LOCK_NAME = ".jaxtune.lock"


def _existing_ancestor(path: Path) -> Path:
  path = path.absolute()
  while not path.exists() and path != path.parent:
    path = path.parent
  return path


def _writable(directory: Path) -> bool:
  """Whether this process can create files in ``directory`` (read-only mounts included)."""
  return os.access(directory, os.W_OK | os.X_OK)


def check_place(out: Path, export: str | None = None) -> None:
  """Refuse an output place the run cannot use, before anything is loaded: ``--out`` a file,
  under a file, or not writable; ``OUT/export`` a file when the run exports."""
  out = Path(out)
  if out.exists() and not out.is_dir():
    raise UserError(f"--out {out} is a file; pass a directory (new or a run's).")
  base = _existing_ancestor(out)
  if not base.is_dir():
    raise UserError(f"--out {out} is under {base}, which is a file; pass a directory.")
  if not _writable(base):
    why = "a read-only disk" if _read_only_mount(base) else "not writable by this user"
    raise UserError(f"--out {out}: {base} is {why}; choose another --out.")
  if export:
    target = out / "export"
    if target.exists() and not target.is_dir():
      raise UserError(
        f"{target} is a file, where the export is written; move it away or choose another --out."
      )


def _read_only_mount(path: Path) -> bool:
  try:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
  except OSError:
    return False


def check_links(out: Path) -> None:
  """Refuse a run directory holding a symbolic link anywhere inside it: every file jaxtune
  writes there (lock, metrics, logs, config history, checkpoints, the export) would follow
  it and write outside ``--out``. (``--out`` itself may be a link: the user named it.)"""
  for root, dirs, files in os.walk(out):
    for name in sorted(dirs + files):
      path = Path(root) / name
      if path.is_symlink():
        raise link_error(path)


def free_bytes(path: Path) -> int:
  return shutil.disk_usage(_existing_ancestor(Path(path))).free


def check_room(out: Path, needs: dict[str, int]) -> None:
  """Refuse to start when the disk holding ``out`` has less free space than ``needs`` (what ->
  bytes: checkpoints, the export) adds up to."""
  total = sum(needs.values())
  free = free_bytes(out)
  if total > free:
    parts = ", ".join(f"{what} about {size_text(n)}" for what, n in needs.items() if n)
    raise SaveError(
      f"the disk holding {out} has {size_text(free)} free and this run writes more ({parts}); free "
      "some space or choose another --out."
    )


class Lock:
  """An exclusive lock on a run directory; a context manager, or ``acquire``/``release``.

  ``acquire`` creates ``out`` if needed; ``release`` removes the lock file, and ``out`` again
  when this lock created it and nothing else was written there (a run refused before it
  started leaves nothing behind).
  """

  def __init__(self, out: Path, command: str | None = None):
    self.out = Path(out)
    self.path = self.out / LOCK_NAME
    self.command = command
    self.fd: int | None = None
    self.created: list[Path] = []
    self.took_over: str | None = None  # the holder of a stale lock this one replaced

  def acquire(self) -> "Lock":
    missing = []
    p = self.out.absolute()
    while not p.exists():
      missing.append(p)
      p = p.parent
    try:
      self.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise UserError(f"cannot write into {self.out} ({e.strerror}); choose another --out.") from e
    self.created = missing
    try:
      check_links(self.out)
    except UserError:
      self._remove_created()
      raise
    fd = self._locked_fd()
    previous = _read_holder(fd)
    if previous:
      self.took_over = _describe(previous)
    info = {
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "started": time.strftime("%Y-%m-%d %H:%M:%S"),
      "command": self.command or " ".join(sys.argv),
    }
    try:
      os.ftruncate(fd, 0)
      os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    except OSError as e:
      os.close(fd)
      self._remove_created()
      raise write_error(self.path, e) from e
    self.fd = fd
    return self

  def _locked_fd(self) -> int:
    """The lock file, opened and locked; retried when a run releasing it removed the file
    between our open and our lock (the lock would then be on a file no one else sees)."""
    while True:
      try:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
      except OSError as e:
        self._remove_created()
        if e.errno == errno.ELOOP:
          raise link_error(self.path) from None
        raise UserError(
          f"cannot write into {self.out} ({e.strerror}); choose another --out."
        ) from e
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        holder = _describe(_read_holder(fd))
        os.close(fd)
        self._remove_created()
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
          raise UserError(
            f"{self.out} is in use by another run ({holder}); wait for it to finish, or "
            "choose another --out."
          ) from None
        raise
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if same:
        return fd
      os.close(fd)

  def release(self) -> None:
    if self.fd is None:
      return
    try:
      self.path.unlink(missing_ok=True)
    except OSError:
      pass
    fcntl.flock(self.fd, fcntl.LOCK_UN)
    os.close(self.fd)
    self.fd = None
    self._remove_created()

  def _remove_created(self) -> None:
    for p in self.created:  # deepest first
      try:
        p.rmdir()
      except OSError:
        break
    self.created = []

  def __enter__(self) -> "Lock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _read_holder(fd: int) -> dict | None:
  try:
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    return json.loads(text) if text else None
  except (OSError, ValueError):
    return {}


def _describe(holder: dict | None) -> str:
  if not holder:
    return "its holder is unknown"
  where = f"pid {holder.get('pid')} on {holder.get('host')}"
  return f"{where}, started {holder.get('started')}: {holder.get('command')}"


def resumed_settings(out: Path, given: dict) -> dict:
  """A resumed run's settings: those of ``OUT/config.yaml`` (the run as it ran), with the
  ``given`` ones (flags, a --config file, Python's) over them; check_resume lists and
  records each that differs. ``given`` steps or epochs replace the saved pair whole."""
  path = Path(out) / "config.yaml"
  if not path.is_file():
    return given  # no saved settings: check_resume says what --resume needs
  saved = {k: v for k, v in RunConfig.read_yaml(path).items() if k != "out"}
  if "steps" in given or "epochs" in given:
    saved.pop("steps", None)
    saved.pop("epochs", None)
  return {**saved, **given}


def record_start(out: Path, yaml_text: str, header: str) -> Path:
  """Keep this start's settings as ``OUT/config-history/NNN.yaml`` (``header``: comment lines
  saying when and what changed); returns the file."""
  history = Path(out) / "config-history"
  history.mkdir(exist_ok=True)
  numbers = [int(p.stem) for p in history.glob("*.yaml") if p.stem.isdigit()]
  path = history / f"{max(numbers, default=0) + 1:03d}.yaml"
  comments = "".join(f"# {line}\n" for line in header.splitlines())
  tmp = path.with_suffix(".yaml.tmp")
  try:
    tmp.write_text(comments + yaml_text)
    tmp.replace(path)
  except OSError as e:
    tmp.unlink(missing_ok=True)
    raise write_error(path, e) from e
  return path

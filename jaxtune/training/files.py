"""Writing inside a run's --out: one sentence for a write that failed (a full disk, no
permission), and appends that never follow a symbolic link (run.run_dir.check_links refuses
any link inside --out before a run writes anything)."""

import errno
import os
from pathlib import Path
from typing import TextIO

from jaxtune.errors import SaveError, UserError


def full_disk(e: BaseException) -> bool:
  return getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)


def write_error(path: Path, e: OSError) -> SaveError:
  """One sentence for a failed write of ``path``."""
  if full_disk(e):
    return SaveError(f"the disk is full: {path} could not be written; free some space, then retry.")
  return SaveError(f"{path} could not be written ({e.strerror or e}); choose another --out.")


def link_error(path: Path) -> UserError:
  try:
    target = f" (to {os.readlink(path)})"
  except OSError:
    target = ""
  return UserError(
    f"{path} is a symbolic link{target}, and jaxtune writes only inside --out, following no "
    "links there; remove the link, or choose another --out."
  )


def open_append(path: Path) -> TextIO:
  """``path`` opened to append text, refusing to follow a symbolic link (``check_links``)."""
  try:
    return open(path, "a", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW, 0o644))
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise link_error(path) from None
    raise

"""What the command lines (train, export, generate) share, light enough to import before
their arguments parse: --help and a mistyped flag answer without importing JAX."""

import argparse
from typing import NoReturn

CACHE_HELP = (
  "compile everything anew: without it, compiled programs are kept in "
  "~/.cache/jaxtune/xla ($JAXTUNE_COMPILE_CACHE, a directory of your own) and a second run, a "
  "resume, an export or a generate of the same shapes reads them from there"
)


class Parser(argparse.ArgumentParser):
  """argparse, but a bad flag gets one line (no usage block)."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"error: {message}; see {self.prog} --help.\n")

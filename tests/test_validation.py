"""Damaged or hostile inputs are refused where they are parsed, with one sentence naming the
file and the field: safetensors headers (converters/safetensors_read.py). The files are
written byte by byte here, so each test controls exactly what the header says; nothing
compiles. The same inputs through the command line are in tests/test_catalogue.py.
"""

import contextlib
import json
import os
import re
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from converters.safetensors_read import Prefetcher, iter_tensors, safetensors_files
from jaxtune.errors import CheckpointError

A = np.arange(2, dtype=np.float32)  # tensor a: F32 [2], 8 bytes
B = np.arange(4, dtype=np.float16).reshape(2, 2) * 0.5  # tensor b: F16 [2, 2], 8 bytes
GOOD = {
  "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
  "b": {"dtype": "F16", "shape": [2, 2], "data_offsets": [8, 16]},
}


def _write(path: Path, header, data: bytes = A.tobytes() + B.tobytes(), length=None) -> Path:
  """A safetensors file: the 8-byte little-endian header length, the header, the data."""
  raw = header if isinstance(header, bytes) else json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
  return path


def _with(name: str, **changes) -> dict:
  """GOOD with tensor ``name``'s fields changed (a change to None removes the field)."""
  entry = {k: v for k, v in {**GOOD[name], **changes}.items() if v is not None}
  return {**GOOD, name: entry}


def _assert_sentence(error: Exception, *parts: str) -> None:
  message = str(error)
  assert message.endswith("."), message
  assert "\n" not in message, message
  assert not re.search(r"(?<!e\.g)\.\s+[A-Z]", message), message  # one sentence
  for part in parts:
    assert re.search(part, message), f"{part!r} not in {message!r}"


# --- safetensors ------------------------------------------------------------------------


def test_a_good_file_reads_in_file_order(tmp_path):
  """The tensors come back with their values, in the order of their bytes in the file."""
  header = {
    "__metadata__": {"format": "pt"},
    "b": GOOD["b"],
    "empty": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
    "a": GOOD["a"],
  }
  tensors = list(iter_tensors([_write(tmp_path / "m.safetensors", header)]))
  assert [name for name, _, _ in tensors] == ["a", "empty", "b"]
  np.testing.assert_array_equal(tensors[0][2], A)
  assert tensors[1][2].shape == (0, 3)
  np.testing.assert_array_equal(tensors[2][2], B)
  assert tensors[2][2].dtype == np.float16


def test_a_file_without_tensors_reads_as_none(tmp_path):
  assert list(iter_tensors([_write(tmp_path / "m.safetensors", {}, data=b"")])) == []


HEADERS = [
  # data_offsets
  (
    "offsets-negative",
    _with("a", data_offsets=[-8, 0]),
    r"tensor a has the data_offsets \[-8, 0\]",
  ),
  ("offsets-not-a-list", _with("a", data_offsets="0,8"), r"tensor a has the data_offsets \"0,8\""),
  ("offsets-one", _with("a", data_offsets=[8]), r"tensor a has the data_offsets \[8\]"),
  ("offsets-three", _with("a", data_offsets=[0, 4, 8]), r"tensor a has the data_offsets"),
  ("offsets-floats", _with("a", data_offsets=[0.0, 8.0]), r"tensor a has the data_offsets"),
  ("offsets-infinite", _with("a", data_offsets=[0, float("inf")]), r"data_offsets \[0, Infinity\]"),
  ("offsets-nan", _with("a", data_offsets=[float("nan"), 8]), r"data_offsets \[NaN, 8\]"),
  ("offsets-strings", _with("a", data_offsets=["0", "8"]), r"tensor a has the data_offsets"),
  ("offsets-booleans", _with("a", data_offsets=[False, True]), r"tensor a has the data_offsets"),
  ("offsets-missing", _with("a", data_offsets=None), r"tensor a has no data_offsets"),
  (
    "offsets-end-before-begin",
    _with("b", data_offsets=[16, 8]),
    r"tensor b has the data_offsets \[16, 8\], which end before they begin",
  ),
  (
    "offsets-past-the-end",
    _with("b", shape=[2, 4], data_offsets=[8, 24]),
    r"tensor b runs past the end of the file: its data_offsets end at 24, the data holds 16",
  ),
  (
    "offsets-overlap",
    _with("b", data_offsets=[4, 12]),
    r"tensor b's data_offsets \[4, 12\] overlap tensor a's \[0, 8\]",
  ),
  (
    "offsets-same-bytes",
    _with("b", dtype="F32", shape=[2], data_offsets=[0, 8]),
    r"tensor (a|b)'s data_offsets \[0, 8\] overlap tensor (a|b)'s \[0, 8\]",
  ),
  (
    "offsets-gap",
    {"a": GOOD["a"], "b": {**GOOD["b"], "shape": [2], "data_offsets": [12, 16]}},
    r"4 bytes before tensor b belong to no tensor",
  ),
  (
    "offsets-gap-at-the-start",
    {"b": GOOD["b"]},
    r"8 bytes before tensor b belong to no tensor",
  ),
  ("offsets-unused-end", {"a": GOOD["a"]}, r"its last 8 bytes belong to no tensor"),
  # shape
  ("shape-negative", _with("a", shape=[-2]), r"tensor a has the shape \[-2\], not a list"),
  ("shape-two-negatives", _with("a", shape=[-1, -2]), r"tensor a has the shape \[-1, -2\]"),
  ("shape-string-entry", _with("a", shape=["2"]), r"tensor a has the shape \[\"2\"\]"),
  ("shape-float-entry", _with("a", shape=[2.0]), r"tensor a has the shape \[2\.0\]"),
  ("shape-boolean-entry", _with("a", shape=[True, 2]), r"tensor a has the shape \[true, 2\]"),
  ("shape-not-a-list", _with("a", shape=2), r"tensor a has the shape 2,"),
  ("shape-null", _with("a", shape=None), r"tensor a has no shape"),
  (
    "shape-overflows",
    _with("a", shape=[2**32, 2**32, 4]),
    r"tensor a has the shape \[4294967296, 4294967296, 4\], too large",
  ),
  ("shape-overflows-with-a-zero", _with("a", shape=[0, 2**62]), r"too large for any file"),
  (
    "shape-too-few-bytes",
    _with("a", shape=[3]),
    r"tensor a has 8 bytes, but its shape \(3,\) of F32 needs 12",
  ),
  (
    "shape-product-too-large",
    _with("a", shape=[2**20, 2**20]),
    r"tensor a has 8 bytes, but its shape \(1048576, 1048576\) of F32 needs 4398046511104",
  ),
  # dtype and the entry itself
  ("dtype-missing", _with("a", dtype=None), r"tensor a has no dtype"),
  ("entry-not-an-object", {**GOOD, "a": [0, 8]}, r"tensor a is a JSON list, not an object"),
  ("entry-a-number", {**GOOD, "a": 5}, r"tensor a is a JSON number, not an object"),
  # the header as a whole
  ("header-a-list", [GOOD["a"]], r"its header is a JSON list, not an object"),
  ("header-a-string", "a", r"its header is a JSON string, not an object"),
  ("header-null", None, r"its header is a JSON null, not an object"),
  ("header-not-json", b"{oops", r"its header is not valid JSON"),
  ("header-not-utf8", b'{"\xff": 1}', r"its header is not valid JSON"),
  ("header-nested-too-deep", b"[" * 100_000, r"its header is not valid JSON"),
  ("metadata-a-list", {**GOOD, "__metadata__": ["pt"]}, r"its __metadata__ is not an object of"),
  ("metadata-a-number", {**GOOD, "__metadata__": {"format": 1}}, r"its __metadata__ is not an"),
  ("metadata-nested", {**GOOD, "__metadata__": {"a": {"b": "c"}}}, r"its __metadata__ is not"),
]


@pytest.mark.parametrize("header, match", [c[1:] for c in HEADERS], ids=[c[0] for c in HEADERS])
def test_a_damaged_header_is_refused_naming_the_file_and_tensor(tmp_path, header, match):
  path = _write(tmp_path / "model.safetensors", header)
  with pytest.raises(CheckpointError) as e:
    list(iter_tensors([path]))
  _assert_sentence(e.value, re.escape(f"{path} is truncated or corrupt ("), match, "re-download")


@pytest.mark.parametrize("dtype", ["F8", "F8_E4M3", "f32", "", 5, ["F32"]])
def test_a_dtype_jaxtune_does_not_read_is_named(tmp_path, dtype):
  path = _write(tmp_path / "model.safetensors", _with("a", dtype=dtype))
  with pytest.raises(CheckpointError) as e:
    list(iter_tensors([path]))
  shown = re.escape(json.dumps(dtype))
  _assert_sentence(e.value, rf"{re.escape(str(path))} holds tensor a in the dtype {shown}, which")
  assert "F32, F16, BF16" in str(e.value)


@pytest.mark.parametrize(
  "length, data, match",
  [
    (None, b"", r"it holds 4 bytes, too few for the 8-byte header length"),
    (0, b"", r"its header length field says 0 bytes"),
    (1000, b"", r"its header length field says 1000 bytes, but \d+ bytes follow it"),
    (2**64 - 1, b"", r"its header length field says 18446744073709551615 bytes"),
  ],
  ids=["shorter-than-the-length", "length-zero", "length-past-the-end", "length-huge"],
)
def test_a_wrong_header_length_is_refused(tmp_path, length, data, match):
  path = tmp_path / "model.safetensors"
  if length is None:
    path.write_bytes(b"\x10\x00\x00\x00")
  else:
    _write(path, GOOD, length=length)
  with pytest.raises(CheckpointError) as e:
    list(iter_tensors([path]))
  _assert_sentence(e.value, re.escape(str(path)), match)


def test_header_bytes_are_never_read_as_weights(tmp_path):
  """Offsets reaching back into the header (the old reader read its JSON as a weight) and the
  prefetching reader the loader uses, which hands the error to the caller's thread."""
  header = {"a": {"dtype": "F16", "shape": [4], "data_offsets": [-8, 0]}, "b": GOOD["b"]}
  path = _write(tmp_path / "model.safetensors", header, data=B.tobytes())
  with pytest.raises(CheckpointError, match=r"tensor a has the data_offsets \[-8, 0\]"):
    with Prefetcher([path], lambda t: t) as tensors:
      list(tensors)


def _unreadable(kind: str, path: Path) -> None:
  if kind == "no-permission":
    if os.geteuid() == 0:
      pytest.skip("root reads a file without read permission; the directory case covers it")
    _write(path, GOOD).chmod(0)
  elif kind == "a-directory":
    path.mkdir()
  elif kind == "a-link-loop":
    path.symlink_to(path.name)
  elif kind == "a-dangling-link":
    path.symlink_to("nowhere.safetensors")
  elif kind == "a-fifo":
    os.mkfifo(path)  # opening it would block: it must be refused before
    # Should a reader open it after all, a writer comes in 10 s and leaves: the reader sees the
    # end of the file (and the test fails) instead of waiting forever.
    unblock = threading.Timer(10, lambda: _open_and_close(path))
    unblock.daemon = True
    unblock.start()


def _open_and_close(fifo: Path) -> None:
  with contextlib.suppress(OSError):  # ENXIO: nobody is reading it, as it should be
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


UNREADABLE = {
  "no-permission": r"\(Permission denied\)",
  "a-directory": r"\(it is a directory\)",
  "a-link-loop": r"\(Too many levels of symbolic links\)",
  "a-dangling-link": r"\(No such file or directory\)",
  "a-fifo": r"\(it is not a regular file\)",
}


@pytest.mark.parametrize("kind", UNREADABLE)
def test_an_unreadable_weights_file_is_named(tmp_path, kind):
  path = tmp_path / "model.safetensors"
  _unreadable(kind, path)
  files = safetensors_files(tmp_path)
  assert files == [path]
  with pytest.raises(CheckpointError) as e:
    list(iter_tensors(files))
  _assert_sentence(e.value, rf"^cannot read {re.escape(str(path))} {UNREADABLE[kind]}")


def test_an_unreadable_shard_listed_in_the_index_is_named_not_called_missing(tmp_path):
  (tmp_path / "model.safetensors.index.json").write_text(
    json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})
  )
  _write(tmp_path / "model-1.safetensors", GOOD)
  (tmp_path / "model-2.safetensors").symlink_to("model-2.safetensors")
  with pytest.raises(CheckpointError) as e:
    list(iter_tensors(safetensors_files(tmp_path)))
  _assert_sentence(e.value, r"cannot read .*model-2\.safetensors \(Too many levels of symbolic")


@pytest.mark.parametrize(
  "index",
  [
    b"{oops",
    b"\xff\xfe",
    b"[]",
    b'{"weight_map": ["model.safetensors"]}',
    b'{"weight_map": {"a": 5}}',
    b'{"weight_map": {"a": "../../elsewhere/model.safetensors"}}',
    b'{"metadata": {}}',
  ],
  ids=["not-json", "not-utf8", "a-list", "map-a-list", "file-a-number", "file-elsewhere", "no-map"],
)
def test_a_damaged_index_is_refused(tmp_path, index):
  (tmp_path / "model.safetensors.index.json").write_bytes(index)
  with pytest.raises(CheckpointError) as e:
    safetensors_files(tmp_path)
  _assert_sentence(e.value, r"model\.safetensors\.index\.json is not a valid safetensors index")

"""Damaged or hostile inputs are refused where they are parsed, with one sentence naming the
file and the field: safetensors headers (converters/safetensors_read.py) and config.json
(jaxtune/models/config.py). The files are written byte by byte here, so each test controls exactly
what the header says; nothing compiles. The same inputs through the command line are in
tests/cli/test_catalogue.py.
"""

import contextlib
import json
import os
import re
import shutil
import struct
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from converters.safetensors_read import Prefetcher, iter_tensors, safetensors_files
from jaxtune.errors import CheckpointError, ConfigError
from jaxtune.models.config import ModelConfig

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
def test_an_unreadable_weights_file_is_named(tmp_path, kind, request):
  if kind == "no-permission" and os.geteuid() == 0:
    # root reads any file: the reading is done by a child that gives up root for "nobody"
    # (in a directory it may enter; pytest's own are root's alone).
    tmp_path = Path(tempfile.mkdtemp(dir="/tmp"))
    tmp_path.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
  path = tmp_path / "model.safetensors"
  _unreadable(kind, path)
  files = safetensors_files(tmp_path)
  assert files == [path]
  if kind == "no-permission" and os.geteuid() == 0:
    message = _read_as_nobody(files)
  else:
    with pytest.raises(CheckpointError) as e:
      list(iter_tensors(files))
    message = str(e.value)
  _assert_sentence(message, rf"^cannot read {re.escape(str(path))} {UNREADABLE[kind]}")


def _read_as_nobody(files: list[Path]) -> str:
  """The CheckpointError that reading ``files`` gives a process of user "nobody"."""
  read, write = os.pipe()
  # A fork of this process, whose JAX threads run: the child only fails to open a file and
  # writes to a pipe, taking no lock another thread could hold. (A fresh interpreter as
  # nobody cannot start here: the Python it would run sits under root's home.)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # "...use of fork() may lead to..."
    pid = os.fork()
  if pid == 0:  # the child: no pytest machinery, only the reader and the pipe
    text = "no error"
    try:
      os.setgid(65534)
      os.setuid(65534)
      list(iter_tensors(files))
    except CheckpointError as e:
      text = str(e)
    except BaseException as e:
      text = f"{type(e).__name__}: {e}"
    os.write(write, text.encode())
    os._exit(0)
  os.close(write)
  with os.fdopen(read, "rb") as f:
    text = f.read().decode()
  os.waitpid(pid, 0)
  return text


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


# --- config.json ------------------------------------------------------------------------

LLAMA = {
  "model_type": "llama",
  "vocab_size": 256,
  "hidden_size": 64,
  "intermediate_size": 128,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-5,
  "rope_theta": 10000.0,
  "max_position_embeddings": 128,
}
GEMMA2 = {**LLAMA, "model_type": "gemma2", "head_dim": 16, "sliding_window": 32}


def _config(tmp_path: Path, config) -> Path:
  path = tmp_path / "config.json"
  path.write_text(json.dumps(config))
  return path


def test_a_good_config_reads(tmp_path):
  cfg = ModelConfig.from_hf(_config(tmp_path, LLAMA))
  assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
  assert cfg.rope.theta == 10000.0 and cfg.rms_norm_eps == 1e-5
  # null means "not set" for optional fields, as transformers reads it
  cfg = ModelConfig.from_hf({**LLAMA, "num_key_value_heads": None, "head_dim": None})
  assert (cfg.num_kv_heads, cfg.head_dim) == (4, 16)


WHOLE = r"must be a whole number >= 1, got "
CONFIGS = [
  (
    "layers-a-billion",
    {"num_hidden_layers": 10**9},
    r"num_hidden_layers",
    r"from 1 to 100000, got 1000000000",
  ),
  (
    "layers-minus-one",
    {"num_hidden_layers": -1},
    r"num_hidden_layers",
    r"from 1 to 100000, got -1",
  ),
  ("layers-zero", {"num_hidden_layers": 0}, r"num_hidden_layers", r"from 1 to 100000, got 0"),
  ("layers-null", {"num_hidden_layers": None}, r"num_hidden_layers", r", got null"),
  ("layers-a-string", {"num_hidden_layers": "2"}, r"num_hidden_layers", r', got "2"'),
  ("layers-a-boolean", {"num_hidden_layers": True}, r"num_hidden_layers", r", got true"),
  ("layers-a-float", {"num_hidden_layers": 2.5}, r"num_hidden_layers", r", got 2\.5"),
  ("vocab-minus-one", {"vocab_size": -1}, r"vocab_size", WHOLE + "-1"),
  ("hidden-zero", {"hidden_size": 0}, r"hidden_size", WHOLE + "0"),
  ("heads-zero", {"num_attention_heads": 0}, r"num_attention_heads", WHOLE + "0"),
  ("heads-a-list", {"num_attention_heads": [4]}, r"num_attention_heads", WHOLE + r"\[4\]"),
  ("kv-heads-zero", {"num_key_value_heads": 0}, r"num_key_value_heads", WHOLE + "0"),
  ("kv-heads-a-string", {"num_key_value_heads": "2"}, r"num_key_value_heads", WHOLE + '"2"'),
  ("head-dim-negative", {"head_dim": -16}, r"head_dim", WHOLE + "-16"),
  ("intermediate-zero", {"intermediate_size": 0}, r"intermediate_size", WHOLE + "0"),
  ("intermediate-negative", {"intermediate_size": -128}, r"intermediate_size", WHOLE + "-128"),
  ("positions-zero", {"max_position_embeddings": 0}, r"max_position_embeddings", r"from 1 to"),
  (
    "positions-beyond-int32",
    {"max_position_embeddings": 2**31},
    r"max_position_embeddings",
    r"got 2147483648",
  ),
  ("rope-theta-negative", {"rope_theta": -1.0}, r"rope_theta", r"a finite number > 0, got -1\.0"),
  ("rope-theta-zero", {"rope_theta": 0}, r"rope_theta", r"a finite number > 0, got 0"),
  ("rope-theta-infinite", {"rope_theta": float("inf")}, r"rope_theta", r"got Infinity"),
  ("rope-theta-nan", {"rope_theta": float("nan")}, r"rope_theta", r"got NaN"),
  ("rope-theta-a-string", {"rope_theta": "1e4"}, r"rope_theta", r'got "1e4"'),
  ("eps-negative", {"rms_norm_eps": -1e-5}, r"rms_norm_eps", r"a finite number >= 0, got -1e-05"),
  ("eps-nan", {"rms_norm_eps": float("nan")}, r"rms_norm_eps", r"got NaN"),
  ("eps-infinite", {"rms_norm_eps": float("-inf")}, r"rms_norm_eps", r"got -Infinity"),
  (
    "tie-a-string",
    {"tie_word_embeddings": "false"},
    r"tie_word_embeddings",
    r'true or false, got "false"',
  ),
  ("bias-a-number", {"attention_bias": 1}, r"attention_bias", r"true or false, got 1"),
  ("rope-scaling-a-list", {"rope_scaling": [1]}, r"rope_scaling", r"an object, got \[1\]"),
  (
    "rope-factor-negative",
    {"rope_scaling": {"rope_type": "linear", "factor": -2.0}},
    r"rope_scaling\.factor",
    r"a finite number > 0, got -2\.0",
  ),
  (
    "rope-original-positions-a-string",
    {
      "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": "8192",
      }
    },
    r"rope_scaling\.original_max_position_embeddings",
    r"a whole number from 1 to 2147483647, got \"8192\"",
  ),
]


@pytest.mark.parametrize(
  "changes, field, allowed", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS]
)
def test_an_absurd_config_value_is_refused_naming_the_field(tmp_path, changes, field, allowed):
  path = _config(tmp_path, {**LLAMA, **changes})
  with pytest.raises(ConfigError) as e:
    ModelConfig.from_hf(tmp_path)
  _assert_sentence(e.value, rf"^{field} in {re.escape(str(path))} must be ", allowed)


@pytest.mark.parametrize(
  "changes, match",
  [
    ({"sliding_window": 0}, r"^sliding_window in .*config\.json must be a whole number from 1"),
    ({"sliding_window": None}, r"config\.json lacks the key 'sliding_window' that a gemma2 needs"),
    ({"layer_types": ["full_attention"]}, r"^layer_types in .* must be a list of full_attention"),
    ({"layer_types": ["sliding_attention", "global"]}, r"^layer_types in .* for each of the 2 "),
    ({"attn_logit_softcapping": -50.0}, r"^attn_logit_softcapping in .* finite number > 0"),
    (
      {"query_pre_attn_scalar": "16"},
      r"^query_pre_attn_scalar in .* finite number > 0, got \"16\"",
    ),
    ({"sliding_window_pattern": 0}, r"^sliding_window_pattern in .* whole number from 1"),
  ],
)
def test_an_absurd_gemma2_value_is_refused(tmp_path, changes, match):
  _config(tmp_path, {k: v for k, v in {**GEMMA2, **changes}.items() if v is not None})
  with pytest.raises(ConfigError) as e:
    ModelConfig.from_hf(tmp_path)
  _assert_sentence(e.value, match)


def test_hidden_not_a_multiple_of_heads_without_head_dim(tmp_path):
  path = _config(tmp_path, {**LLAMA, "hidden_size": 66})
  with pytest.raises(ConfigError) as e:
    ModelConfig.from_hf(path)
  _assert_sentence(
    e.value,
    rf"hidden_size=66 in {re.escape(str(path))} is not a multiple of num_attention_heads=4, "
    "and it sets no head_dim",
  )
  assert ModelConfig.from_hf({**LLAMA, "hidden_size": 66, "head_dim": 16}).head_dim == 16


def test_kv_heads_not_dividing_heads_names_both(tmp_path):
  path = _config(tmp_path, {**LLAMA, "num_key_value_heads": 3, "head_dim": 16})
  with pytest.raises(ConfigError) as e:
    ModelConfig.from_hf(path)
  _assert_sentence(
    e.value, rf"num_attention_heads=4 is not a multiple of num_key_value_heads=3 \({path}\)"
  )


@pytest.mark.parametrize(
  "changes, count",
  [
    # q and o d x d, k and v d x d/2: 3 x 10^18 a layer, 2 layers; the rest is small
    ({"hidden_size": 10**9}, "6e+18"),
    ({"vocab_size": 10**13}, "1.28e+15"),  # embeddings and lm_head, 10^13 x 64 each
    ({"intermediate_size": 10**12, "num_hidden_layers": 100}, "1.92e+16"),  # 3 x 64 x 10^14
  ],
  ids=["hidden", "vocab", "mlp"],
)
def test_a_model_no_machine_holds_is_refused_before_anything_is_built(tmp_path, changes, count):
  path = _config(tmp_path, {**LLAMA, **changes})
  with pytest.raises(ConfigError) as e:
    ModelConfig.from_hf(path)
  _assert_sentence(e.value, rf"^{re.escape(str(path))} describes a model of {re.escape(count)} ")
  assert "more than the 1e+13 any machine holds" in str(e.value)


def test_the_largest_real_models_are_not_refused():
  """Llama 3.1 405B's config: 4.1e11 parameters, far below the limit."""
  cfg = ModelConfig.from_hf(
    {
      **LLAMA,
      "vocab_size": 128256,
      "hidden_size": 16384,
      "intermediate_size": 53248,
      "num_hidden_layers": 126,
      "num_attention_heads": 128,
      "num_key_value_heads": 8,
    }
  )
  assert 4.0e11 < cfg.num_params() < 4.2e11


@pytest.mark.parametrize(
  "text, match",
  [
    ("[1, 2]", r"config\.json holds a JSON list, not an object of settings"),
    ('"llama"', r"config\.json holds a JSON string, not an object of settings"),
    ("null", r"config\.json holds a JSON null, not an object of settings"),
  ],
  ids=["list", "string", "null"],
)
def test_a_config_that_is_not_an_object_is_refused(tmp_path, text, match):
  (tmp_path / "config.json").write_text(text)
  with pytest.raises(ConfigError) as e:
    ModelConfig.from_hf(tmp_path)
  _assert_sentence(e.value, match)


def test_a_config_that_is_not_text_is_refused(tmp_path):
  (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
  with pytest.raises(ConfigError) as e:
    ModelConfig.from_hf(tmp_path)
  _assert_sentence(e.value, r"config\.json is not valid JSON")

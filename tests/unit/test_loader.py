"""The streaming loader: what it writes is what NF4 of each weight is, it reads ahead within its
byte budget, it stops its threads when loading stops, and a second load compiles nothing."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtune
from converters import safetensors_read
from converters.synthetic import write_random_checkpoint
from pallas_kernels import nf4

CONFIG = dict(
  model_type="llama",
  hidden_size=128,
  intermediate_size=256,
  num_hidden_layers=3,  # 21 quantized weights: more than the loader keeps waiting for a mean
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=32,
  vocab_size=512,
  rms_norm_eps=1e-5,
  rope_theta=10000.0,
  max_position_embeddings=256,
  tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  # Small shards, so tensors of one layer are spread over several files.
  return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), CONFIG, shard_bytes=200_000)


def _reader_threads():
  return [t for t in threading.enumerate() if t.name == "jaxtune-reader"]


def test_nf4_bytes_are_quantize_linear_of_each_weight(ckpt):
  model = jaxtune.from_pretrained(ckpt, quantization="nf4", dtype="bfloat16")
  weights = {
    name: tensor
    for name, _, tensor in safetensors_read.iter_tensors(safetensors_read.safetensors_files(ckpt))
  }
  for layer in range(CONFIG["num_hidden_layers"]):
    for module, proj in [("self_attn", p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
      ("mlp", p) for p in ("gate_proj", "up_proj", "down_proj")
    ]:
      w = weights[f"model.layers.{layer}.{module}.{proj}.weight"]
      expected = nf4.quantize_linear(jnp.asarray(w))
      linear = getattr(getattr(model.layers, module), proj)
      for field, want in zip(("codes", "absmax", "nested_absmax", "offset"), expected, strict=True):
        got = getattr(linear, field)[layer]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{proj} {field}")
  embed = np.asarray(model.embed_tokens.embedding[...])
  np.testing.assert_array_equal(embed, np.asarray(weights["model.embed_tokens.weight"]))


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["8", "2x4"])
def test_loading_onto_a_mesh_writes_what_one_device_loads(ckpt, spec, monkeypatch):
  """Under a mesh, tensors cross from the host split over data and are gathered on the devices:
  every array holds the single-device bytes, in its variable's own layout."""
  from jaxtune.hf import device_put
  from jaxtune.parallel import mesh as meshlib
  from jaxtune.parallel import sharding

  one = nnx.state(jaxtune.from_pretrained(ckpt, quantization="nf4", dtype="bfloat16"))
  mesh = meshlib.make_mesh(spec)
  from_host = []  # (shape, spec) of every numpy array the loader sends to the devices
  real_put = device_put.jax.device_put

  def put(x, where=None, **kw):
    if isinstance(x, np.ndarray) and isinstance(where, jax.sharding.NamedSharding):
      from_host.append((x.shape, str(where.spec)))
    return real_put(x, where, **kw)

  monkeypatch.setattr(device_put.jax, "device_put", put)
  state = nnx.state(jaxtune.from_pretrained(ckpt, quantization="nf4", dtype="bfloat16", mesh=mesh))
  monkeypatch.undo()
  weights = [s for shape, s in from_host if len(shape) == 2]
  assert len(weights) == 3 * 7 + 2 and all("data" in s for s in weights), from_host
  flat_one, flat = dict(one.flat_state()), dict(state.flat_state())
  assert flat.keys() == flat_one.keys()
  split = 0
  for path, var in flat.items():
    got = var.get_value()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(flat_one[path].get_value()), path)
    axes = tuple(var.get_metadata().get("axes") or (None,) * got.ndim)
    want = sharding.sharding_for(axes, got.shape, mesh)
    assert got.sharding.is_equivalent_to(want, got.ndim), (path, got.sharding, want)
    split += "tensor" in str(want.spec)
  assert split or spec == "8"  # 2x4 really splits weights over tensor


def test_prefetcher_yields_what_the_reader_reads_within_its_budget(ckpt):
  files = safetensors_read.safetensors_files(ckpt)
  expected = list(safetensors_read.iter_tensors(files))
  budget = 3 * max(t.nbytes for _, _, t in expected if t.ndim == 2 and t.shape[0] < 512)
  got = []
  with safetensors_read.Prefetcher(files, lambda t: t * 1, budget=budget) as tensors:
    for name, file, tensor in tensors:
      time.sleep(0.002)  # let the reader run ahead as far as it may
      # What is read ahead (including this tensor) stays within the budget, or is one tensor.
      assert tensors._ahead <= max(budget, tensor.nbytes)
      got.append((name, file, tensor))
  assert [(n, f) for n, f, _ in got] == [(n, f) for n, f, _ in expected]
  for (_, _, a), (_, _, b) in zip(got, expected, strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  assert not _reader_threads()


def test_reader_threads_stop_when_the_caller_stops(ckpt):
  files = safetensors_read.safetensors_files(ckpt)
  with safetensors_read.Prefetcher(files, lambda t: t, budget=1) as tensors:
    next(iter(tensors))
  assert not _reader_threads()


def test_reader_threads_stop_when_loading_fails(ckpt, tmp_path):
  import json
  import shutil

  bad = tmp_path / "bad"
  shutil.copytree(ckpt, bad)
  cfg = json.loads((bad / "config.json").read_text())
  cfg["intermediate_size"] = 128
  (bad / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(jaxtune.CheckpointError, match="has shape"):
    jaxtune.from_pretrained(bad)
  assert not _reader_threads()


def test_second_load_compiles_nothing(ckpt):
  def load():
    model = jaxtune.from_pretrained(ckpt, quantization="nf4", dtype="float32")
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))

  load()
  compiles = []

  def listen(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    load()
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert not compiles

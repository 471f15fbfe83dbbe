"""Context parallelism (a ``context`` mesh axis): ring attention over zigzag-ordered tokens.

On 8 fake CPU devices: the loss and LoRA gradients of packed rows under context=4 and
tensor=2,context=4 equal one device's (float32) for a plain Llama, and under
data=2,context=4 for a Gemma 2 (sliding window, softcaps); the step's per-device
temporary memory falls with the context size; the zigzag layout gives every device the same
causal work.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MESH_SHAPE, build_hf_llama, mesh_lora_model

from jaxtune.data import rows as data
from jaxtune.models.config import ModelConfig
from jaxtune.parallel import distributed, runtime
from jaxtune.parallel import mesh as meshlib
from jaxtune.parallel import ring_attention as context
from jaxtune.run import resolve as resolver
from jaxtune.run_config import RunConfig
from jaxtune.training import losses, step

SEQ = 64


def _packed_rows(seed: int, rows: int = 4, seq: int = SEQ) -> dict:
  """Rows of ``seq`` tokens packing examples of 5 to seq/2 tokens (several per row, padding at
  the end of some): ids, labels, segment ids and positions as the trainer takes them."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(5, seq // 2, 4 * rows)
  examples = [list(rng.integers(1, 256, int(n))) for n in lengths]
  ds = data.to_rows(examples, [e[1:] + [data.IGNORE] for e in examples], seq)
  assert ds.packed and len(ds) >= rows
  return ds.rows(np.arange(rows))


def _runtime(path, run: RunConfig, spec: str):
  devices = jax.devices()[: math.prod(meshlib.parse_mesh(spec, 8).values())]
  return resolver.resolve(
    run.replace(mesh=spec), ModelConfig.from_hf(path), devices=devices
  ).runtime


def _loss_and_grads(model, rt, host: dict):
  """(mean token loss, LoRA gradient leaves, the compiled step's temporary bytes per device)
  of ``host`` [B, T] under ``rt``, the rows put in the context axis's zigzag order and placed
  as the trainer places them."""
  graphdef, lora, frozen = step.place(model, rt)
  lora = jax.tree.map(lambda x: x + 0.01, lora)  # B = 0 would leave A's gradient zero
  host = context.zigzag_batch(host, rt.context, 1)
  at = rt.sharding("batch", "length")
  batch = {k: distributed.global_batch(v, at) for k, v in host.items()}

  def mean(lo):
    s, n = losses.loss_sums(graphdef, lo, frozen, batch, None, rt)
    return s / n

  compiled = jax.jit(jax.value_and_grad(mean)).lower(lora).compile()
  loss, grads = compiled(lora)
  temp = compiled.memory_analysis().temp_size_in_bytes
  return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)], temp


def _check_equal(path, specs, host, run) -> dict:
  """The model loaded once (one device), then placed on each mesh of ``specs`` ("mesh" or
  "mesh:flash_xla": the ring's blocks by the flash op, --attention pallas); returns the
  compiled steps' temporary bytes per device, by spec."""
  _, model = mesh_lora_model(path, run, "1")
  want, want_grads, temp = _loss_and_grads(model, runtime.DEFAULT, host)
  temps = {"1": temp}
  assert all(np.abs(g).max() > 0 for g in want_grads)
  for spec in specs:
    spec, blocks = spec.split(":") if ":" in spec else (spec, "xla")
    attention = "pallas" if blocks == "flash_xla" else None
    rt = _runtime(path, run.replace(attention=attention), spec)
    assert (rt.attention, rt.ring_blocks, rt.context) == ("ring", blocks, 4), spec
    loss, grads, temps[spec] = _loss_and_grads(model, rt, host)
    np.testing.assert_allclose(loss, want, rtol=1e-5, err_msg=spec)
    for g, w in zip(grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max(), err_msg=spec)
  return temps


RUN = RunConfig(batch_size=4, dtype="float32", lora_rank=4, remat="full", seq_len=SEQ)


@pytest.mark.slow
@pytest.mark.beside
def test_context_meshes_train_like_one_device_in_a_quarter_of_the_memory(tmp_path):
  """Packed rows of 256 tokens (segments restarting positions, padding): loss and every LoRA
  gradient under context=4 (XLA tiles) and tensor=2,context=4 (the flash op per chunk pair,
  --attention pallas: its jnp reference on CPU) equal one device (data=2,context=4: the Gemma 2
  case below); the compiled step's temporary memory per device (XLA's memory analysis, remat
  full) under context=4 is at most 1.5x a quarter of one device's (measured 10 of 62 MiB with
  the tiled ring: 0.16; 32 of 174 MiB at 512 tokens)."""
  path = tmp_path / "llama"
  build_hf_llama(21, **MESH_SHAPE, max_position_embeddings=256).save_pretrained(path)
  specs = ("context=4", "tensor=2,context=4:flash_xla")
  temps = _check_equal(path, specs, _packed_rows(3, 2, 256), RUN.replace(seq_len=256, batch_size=2))
  assert temps["context=4"] <= 1.5 / 4 * temps["1"], temps


@pytest.mark.slow
@pytest.mark.beside
def test_context_keeps_sliding_windows_and_softcaps(tmp_path):
  """Gemma 2 (window 8 on alternate layers, attention and final softcaps): windows and
  segments are carried across the chunk boundaries of the zigzag layout."""
  from test_packing import _gemma2_dir

  _check_equal(_gemma2_dir(tmp_path), ("data=2,context=4",), _packed_rows(4), RUN)


def test_zigzag_gives_every_device_the_same_causal_work():
  """Chunks i and 2C-1-i on device i: equal (query, key) pairs under the causal mask, where
  a contiguous split gives the last device more than twice the first's."""
  for seq_len, size in ((64, 4), (96, 2), (4096, 8)):
    order = context.zigzag_order(seq_len, size)
    assert sorted(order) == list(range(seq_len))
    work = context.causal_pairs(order, size)
    assert len(set(work)) == 1 and work.sum() == seq_len * (seq_len + 1) // 2, work
    contiguous = context.causal_pairs(np.arange(seq_len), size)
    assert contiguous[-1] > 2 * contiguous[0], contiguous


def test_zigzag_batch_moves_every_token_leaf_together():
  host = {
    "input_ids": np.arange(2 * 3 * 16).reshape(2, 3, 16),
    "labels": np.arange(2 * 3 * 16).reshape(2, 3, 16) + 1000,
    "advantages": np.arange(6.0).reshape(2, 3),
  }
  out = context.zigzag_batch(host, 2, 2)
  order = [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
  np.testing.assert_array_equal(out["input_ids"][1, 2], host["input_ids"][1, 2, order])
  np.testing.assert_array_equal(out["labels"] - out["input_ids"], 1000)
  np.testing.assert_array_equal(out["positions"][0, 0], order)  # made explicit, then moved
  np.testing.assert_array_equal(out["segment_ids"], 1)
  np.testing.assert_array_equal(out["advantages"], host["advantages"])


def test_ring_blocks_are_the_kernel_where_asked_and_exact():
  """The flash kernel per chunk pair on Hopper (16-bit inputs) unset or with --attention
  pallas; XLA's tiles with --attention xla, for sliding windows (named when pallas was asked
  for) and, unset, off Hopper; --attention pallas there: the op's jnp reference."""
  from types import SimpleNamespace

  from jaxtune.models.config import ModelConfig

  dims = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
              num_kv_heads=1, head_dim=64)  # fmt: skip
  plain = ModelConfig(model_type="llama", **dims)
  sliding = ModelConfig(model_type="gemma2", layer_types=("sliding_attention",) * 2, **dims)
  h100 = SimpleNamespace(platform="gpu", compute_capability="9.0")
  cpu = SimpleNamespace(platform="cpu")
  blocks = lambda asked, cfg, device, dtype="bfloat16": resolver.resolve_ring_blocks(  # noqa: E731
    asked, cfg, dtype=dtype, device=device
  )
  assert blocks("pallas", plain, h100) == ("mosaic", None)
  assert blocks(None, plain, h100) == ("mosaic", None)
  assert blocks("xla", plain, h100) == ("xla", None)
  assert blocks(None, plain, h100, "float32") == ("xla", None)
  assert blocks("pallas", plain, h100, "float32")[0] == "flash_xla"  # the kernel takes 16-bit
  assert blocks(None, sliding, h100) == ("xla", None)
  tiles, note = blocks("pallas", sliding, h100)
  assert tiles == "xla" and "sliding windows" in note
  assert blocks(None, plain, cpu) == ("xla", None)
  assert blocks("pallas", plain, cpu)[0] == "flash_xla"


def test_grpo_with_a_context_axis_is_one_sentence(tmp_path):
  """GRPO generates whole sequences: a context axis is refused before anything is built."""
  from jaxtune.errors import MeshError

  path = tmp_path / "llama"
  build_hf_llama(23, **MESH_SHAPE).save_pretrained(path)
  run = RUN.replace(method="grpo", reward="length_penalty")
  with pytest.raises(MeshError, match=r"GRPO generates its rollouts on whole sequences"):
    _runtime(path, run, "context=8")


@pytest.mark.slow
@pytest.mark.parametrize("window, kernel", [(6, None), (0, "xla")])
def test_ring_attention_equals_masked_attention(window, kernel):
  """The ring on its own, with packed segments, positions restarting and softcap: output and
  the gradients of q, k and v equal jaxtune.models.attention's masked attention on the natural
  order.
  XLA's tiles smaller than a chunk (4 tokens: 2 x 2 tiles per chunk pair) with a window; or the
  flash op per chunk pair (its jnp reference here: the kernel's own tests are
  test_flash_attention's), blocks merged by their log-sum-exp, where some queries see no key
  of a block."""
  from jax.sharding import NamedSharding

  from jaxtune.models import attention

  rng = np.random.default_rng(7)
  b, t, n, kv, h, size = 2, 64, 4, 2, 16, 4
  q, k, v, cot = (rng.standard_normal(s).astype(np.float32) for s in [(b, t, n, h)] * 4)
  k, v = k[:, :, :kv], v[:, :, :kv]
  seg = np.repeat([[1] * 30 + [2] * 20 + [3] * 14, [1] * 50 + [0] * 14], 1, axis=0)
  pos = np.stack([np.concatenate([np.arange(30), np.arange(20), np.arange(14)]), np.r_[
    np.arange(50), np.zeros(14, int)]]).astype(np.int32)  # fmt: skip
  seg = seg.astype(np.int32)
  cot = cot * (seg > 0)[:, :, None, None]  # padding rows attend among themselves: unread

  def reference(q, k, v):
    mask = attention.window_mask(attention.make_mask(jnp.asarray(seg)), window)
    return attention.masked_attention(q, k, v, mask, 0.25, softcap=3.0)

  want, vjp = jax.vjp(reference, q, k, v)
  want_grads = vjp(cot)
  rt = runtime.Runtime(mesh=meshlib.make_mesh(f"context={size}", jax.devices()[:size]))
  order = context.zigzag_order(t, size)
  heads, tokens = rt.spec("batch", "length", "heads", "head_dim"), rt.spec("batch", "length")
  put = lambda a, spec: jax.device_put(a[:, order], NamedSharding(rt.mesh, spec))  # noqa: E731

  def ring(q, k, v):
    return context.ring_attention(
      q, k, v, put(pos, tokens), put(seg, tokens), scale=0.25, window=window, softcap=3.0,
      mesh=rt.mesh, specs=(heads, tokens), tile=4, kernel=kernel,
    )  # fmt: skip

  got, vjp = jax.vjp(jax.jit(ring), put(q, heads), put(k, heads), put(v, heads))
  grads = vjp(put(cot, heads))
  real = seg[:, order] > 0
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[:, order][real], atol=1e-5)
  for g, w in zip(grads, want_grads, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w)[:, order], atol=1e-4)

"""Packing: rows of several examples train each example as if it ran alone; the kernel path
(NF4 and flash attention in Mosaic GPU's interpreter) computes the XLA path's loss."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import background_run, build_hf_llama, run_cli
from flax import nnx

import jaxtune
from jaxtune.data import rows as data
from jaxtune.models import attention
from jaxtune.models import lora as lora_lib
from jaxtune.parallel import runtime
from jaxtune.training import losses, step

SEQ = 128  # one flash-attention block multiple, so the kernel path pads nothing


def test_pack_rows_places_every_example_once_within_the_row_length():
  rng = np.random.default_rng(0)
  lengths = list(rng.integers(1, 60, 200)) + [64, 64, 0]
  rows = data.pack_rows(lengths, 64)
  placed = sorted(i for row in rows for i in row)
  assert placed == [i for i, n in enumerate(lengths) if n]  # the empty example is dropped
  assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
  assert all(row == sorted(row) for row in rows)
  # Near the lower bound: no fewer rows than the volume needs, nor than examples over half a
  # row (no two of them share one); 103 here, against 202 rows unpacked.
  bound = max(-(-sum(lengths) // 64), sum(n > 32 for n in lengths))
  assert bound <= len(rows) <= bound + 5


def test_packed_dataset_restarts_positions_and_numbers_segments():
  examples = [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6], [3]]
  labels = [[6, 7, -100], [9, -100], [2, 3, 4, 5, 6, -100], [-100]]
  ds = data.to_rows(examples, labels, 8)
  assert (len(ds), ds.examples) == (2, 4)
  assert ds.packed and ds.packing_efficiency == 12 / 16
  for r in range(len(ds)):
    segs, pos, ids = ds.segment_ids[r], ds.positions[r], ds.input_ids[r]
    for s in range(1, segs.max() + 1):
      at = np.flatnonzero(segs == s)
      np.testing.assert_array_equal(pos[at], np.arange(len(at)))  # restart at 0
      assert list(ids[at]) in examples
    assert (ids[segs == 0] == 0).all()
  plain = data.to_rows(examples, labels, 8, pack=False)
  assert (len(plain), plain.packed, plain.packing_efficiency) == (4, False, 12 / 32)


def _gemma2_dir(tmp_path):
  """Tiny Gemma 2: attention softcap, final-logit softcap and a sliding window of 8."""
  import torch
  import transformers as tf

  torch.manual_seed(0)
  cfg = tf.Gemma2Config(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=48,
    sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
    max_position_embeddings=256,
  )  # fmt: skip
  model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
  model.save_pretrained(tmp_path / "gemma2")
  return tmp_path / "gemma2"


def _token_losses(model, ids, labels, positions=None, segments=None, rt=runtime.DEFAULT):
  logits = model(jnp.asarray(ids), positions, segments, runtime=rt)
  mask = labels != data.IGNORE
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
  return np.asarray(ce) * mask


def _use_kernels(on: bool) -> runtime.Runtime:
  """Every NF4 layer and the attention on the Mosaic GPU kernels' interpreter, or on XLA."""
  if on:
    return runtime.Runtime(attention="interpret", nf4_matmul="interpret", dtype="bfloat16")
  return runtime.Runtime(attention="xla", nf4_matmul="xla")


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [False, True], ids=["xla", "interpret-kernels"])
def test_packed_rows_give_each_example_its_own_loss(tmp_path, kernels):
  """Three examples packed into one row (segment ids, positions restarting) have the per-token
  losses they have alone; the sliding window, softcaps and rope all see the restart."""
  dtype = "bfloat16" if kernels else "float32"  # the kernels take bf16
  model = jaxtune.from_pretrained(_gemma2_dir(tmp_path), quantization="nf4", dtype=dtype)
  rt = _use_kernels(kernels)
  rng = np.random.default_rng(1)
  examples = [list(rng.integers(1, 256, n)) for n in (40, 25, 50)]
  labels = [e[1:] + [data.IGNORE] for e in examples]
  packed = data.to_rows(examples, labels, SEQ)
  assert len(packed) == 1 and packed.segment_ids.max() == 3
  got = _token_losses(
    model, packed.input_ids, packed.labels, packed.positions, packed.segment_ids, rt
  )[0]
  tol = dict(rtol=3e-2, atol=3e-2) if kernels else dict(rtol=1e-5, atol=1e-5)
  # Each example alone in a row of its own (no segment ids), the three rows in one batch, on
  # XLA: the interpreted kernels' packed losses must equal XLA's unpacked ones (the
  # interpreter is what costs here, so it runs the packed row only).
  alone = data.to_rows(examples, labels, SEQ, pack=False)
  assert len(alone) == 3 and not alone.packed
  want = _token_losses(model, alone.input_ids, alone.labels, rt=_use_kernels(False))
  for s, example in enumerate(examples, 1):
    np.testing.assert_allclose(got[packed.segment_ids[0] == s], want[s - 1, : len(example)], **tol)
  # Without segment ids the later examples would attend to the earlier ones: not the same.
  if kernels:
    return  # shown on XLA by the other case; the kernels' segments are what this case adds
  mixed = _token_losses(model, packed.input_ids, packed.labels, packed.positions, rt=rt)[0]
  second = packed.segment_ids[0] == 2
  assert np.abs(mixed[second] - got[second]).max() > 10 * tol["atol"]


@background_run("kernel_path")
def _kernel_path(directory, runs):
  """``_kernel_path_figures`` in a process of its own, beside the other tests (the
  interpreted kernels cost ~30 s of one core)."""
  out = directory / "figures.json"
  code = (  # tests/ (conftest) beside this folder
    "import sys; sys.path.insert(0, '..'); "
    "import test_packing as t; t._write_kernel_path(sys.argv[1], sys.argv[2])"
  )
  proc = run_cli(
    [sys.executable, "-c", code, str(directory), str(out)], timeout=900, cwd=Path(__file__).parent
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


def _write_kernel_path(directory: str, out: str) -> None:
  Path(out).write_text(json.dumps(_kernel_path_figures(Path(directory))))


def _kernel_path_figures(directory: Path) -> dict:
  """A training micro-batch of packed rows through the Mosaic GPU kernels (NF4 matmul
  forward and backward, flash attention forward and backward, interpreted; the NF4 operands
  made for the run as the trainer places them) and through XLA's dequantize-then-dot and
  masked softmax attention: what the test compares."""
  path = directory / "llama"
  build_hf_llama(
    hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
    head_dim=64, num_hidden_layers=1,
  ).save_pretrained(path)  # fmt: skip
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="bfloat16")
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0)
  rng = np.random.default_rng(2)
  examples = [list(rng.integers(1, 256, n)) for n in (70, 50, 90, 30, 16)]
  ds = data.to_rows(examples, [e[1:] + [data.IGNORE] for e in examples], SEQ)
  batch = {
    "input_ids": ds.input_ids,
    "labels": ds.labels,
    "segment_ids": ds.segment_ids,
    "positions": ds.positions,
  }
  figures = {"packed": bool(ds.packed)}

  def loss_and_grads(kernels):
    rt = _use_kernels(kernels)
    graphdef, lora, frozen = step.place(model, rt)  # as the trainer does
    # On the kernels the run's operands are made once, in the frozen state, not the model.
    made = [v for p, v in nnx.to_flat_state(frozen) if p[-1] == "kernel_codes_t"]
    figures[f"operands made, kernels {kernels}"] = len(made)
    figures[f"model keeps none, kernels {kernels}"] = all(
      lin.kernel_codes_t is None for _, lin in lora_lib.iter_linears(model)
    )
    lora = jax.tree.map(lambda x: x + 0.02, lora)  # B = 0 would hide the adapters' gradients

    def mean_loss(lora):
      s, n = losses.loss_sums(graphdef, lora, frozen, batch, None, rt)
      return s / n

    traced = jax.jit(jax.value_and_grad(mean_loss)).trace(lora)  # traced once, run once
    return traced.lower().compile()(lora), str(traced.jaxpr)

  (ref, ref_g), ref_jaxpr = loss_and_grads(False)
  (got, got_g), got_jaxpr = loss_and_grads(True)
  # wgmma (both kernels), exp2 (the flash softmax) and int4 codes (the NF4 kernel reads bnb's
  # bytes as int4): in the interpreted program and in XLA's.
  figures["markers"] = {m: [m in got_jaxpr, m in ref_jaxpr] for m in ("wgmma", "exp2", "i4[")}
  figures["loss"] = [float(got), float(ref)]
  figures["gradients"] = [
    [float(np.linalg.norm(g - r)), float(np.linalg.norm(r))]
    for g, r in (
      (np.asarray(g, np.float32), np.asarray(r, np.float32))
      for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(ref_g), strict=True)
    )
  ]
  return figures


@pytest.mark.slow
@pytest.mark.late
def test_kernel_path_computes_the_xla_loss_and_gradients(kernel_path):
  """A training micro-batch of packed rows: loss and LoRA gradients of the Mosaic GPU kernels
  (interpreted) against XLA's dequantize-then-dot and masked softmax attention
  (``_kernel_path_figures``, run beside the other tests)."""
  figures = kernel_path
  assert figures["packed"]
  assert figures["operands made, kernels True"] == 7
  assert figures["operands made, kernels False"] == 0
  assert figures["model keeps none, kernels True"]
  # The kernels really ran: their markers in the interpreted program, none in XLA's.
  assert figures["markers"] == {m: [True, False] for m in ("wgmma", "exp2", "i4[")}
  got, ref = figures["loss"]
  np.testing.assert_allclose(got, ref, rtol=1e-2)
  assert len(figures["gradients"]) == 14  # A and B of seven projections
  for err, norm in figures["gradients"]:
    assert err <= 5e-2 * norm + 1e-6, (err, norm)


def test_pallas_attention_runs_per_shard_of_a_data_tensor_mesh():
  """Under --mesh 2x4 the flash op runs per (data, tensor) shard in a shard_map (on CPU its
  fallback runs inside): the same output as the unsharded reference, window traced."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxtune.parallel import mesh as meshlib

  mesh = meshlib.make_mesh("2x4", jax.devices())
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (4, 64, 8, 32), jnp.float32)
  k, v = (jax.random.normal(x, (4, 64, 4, 32), jnp.float32) for x in ks[1:])
  seg = jnp.asarray(np.repeat([[1] * 40 + [2] * 24], 4, axis=0), jnp.int32)
  kw = dict(segment_ids=seg, scale=0.2, softcap=4.0)
  want = attention.attention(q, k, v, window=jnp.int32(16), **kw)
  heads = NamedSharding(mesh, P("data", None, "tensor", None))
  q, k, v = (jax.device_put(x, heads) for x in (q, k, v))

  @jax.jit
  def sharded(q, k, v, window):
    rt = runtime.Runtime(mesh=mesh, attention="flash_xla")
    return attention.attention(q, k, v, window=window, runtime=rt, **kw)

  got = sharded(q, k, v, jnp.int32(16))
  assert got.sharding.spec == P("data", None, "tensor", None)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_chunked_loss_equals_the_full_loss_under_the_final_logit_softcap(tmp_path):
  """Gemma 2's final-logit softcap (3.0 here) inside the chunked cross-entropy, by token pieces
  and by token and vocabulary pieces (online log-sum-exp): loss sums and
  LoRA gradients equal those of the full [B, T, V] logits (the head is the tied embedding)."""
  model = jaxtune.from_pretrained(_gemma2_dir(tmp_path), quantization="nf4", dtype="float32")
  assert model.config.final_logit_softcap == 3.0
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0, targets=("q_proj", "down_proj"))
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  lora = jax.tree.map(lambda x: x + 0.01, lora)
  rng = np.random.default_rng(4)
  ids = rng.integers(1, 256, (2, 24)).astype(np.int32)
  labels = np.where(rng.random((2, 24)) < 0.3, data.IGNORE, np.roll(ids, -1, axis=1))
  batch = {"input_ids": ids, "labels": labels, "segment_ids": np.ones_like(ids)}

  def loss(lora, chunk):
    rt = runtime.Runtime(loss_chunk=chunk)
    s, n = losses.loss_sums(graphdef, lora, frozen, batch, None, rt)
    return s, n

  def vocab_pieces(lora):  # the tied embedding in 4 pieces of 64 entries, softcap on each
    m = nnx.merge(graphdef, lora, frozen)
    h = m.hidden_states(jnp.asarray(ids))
    vocab = (m.logits_piece, 256, 64)
    return losses.chunked_loss_sums(m.logits_from_hidden, h, jnp.asarray(labels), 5, vocab)

  (ref, ref_n), ref_g = jax.jit(jax.value_and_grad(lambda x: loss(x, 0), has_aux=True))(lora)
  for fn in (lambda x: loss(x, 5), vocab_pieces):
    (got, got_n), got_g = jax.jit(jax.value_and_grad(fn, has_aux=True))(lora)
    assert int(got_n) == int(ref_n) > 0
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(ref_g), strict=True):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)

"""Training: mesh equivalence on 8 fake CPU devices, export round trips, the default run."""

import itertools
import json
import math
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from conftest import MESH_SHAPE, background_run, build_hf_llama, max_rel_err, run_cli
from flax import nnx

import jaxtune
from jaxtune.data import rows as data
from jaxtune.data import tokenize as data_tokenize
from jaxtune.data.settings import DataSettings
from jaxtune.parallel import mesh as meshlib
from jaxtune.parallel import runtime
from jaxtune.run import default_model
from jaxtune.run import resolve as resolver
from jaxtune.run_config import RunConfig
from jaxtune.training import loop as trainer
from jaxtune.training import losses, plan, step

SHAPE = MESH_SHAPE


def _tiny_dir(hf_llama_dir, seed=11, **overrides):
  return hf_llama_dir(seed=seed, **{**SHAPE, **overrides})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """_tiny_dir's checkpoint (seed 11), written once: the tests below only read it."""
  path = tmp_path_factory.mktemp("tiny") / "llama"
  build_hf_llama(11, **SHAPE).save_pretrained(path)
  return path


def _dataset(vocab=256, n=16, t=32, seed=0, masked=False):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (n, t)).astype(np.int32)
  labels = np.roll(ids, -1, axis=1)
  labels[:, -1] = data.IGNORE
  labels[: n // 2, : t // 3] = data.IGNORE  # uneven masks make the normalisation matter
  if masked:
    labels[:] = data.IGNORE
  return data.to_rows(list(ids), list(labels), t, pack=False)


def _losses(path, mesh_spec, tmp_path, steps=3, accum=2, quantization="nf4", **run_kw):
  tmp_path.mkdir(parents=True, exist_ok=True)
  run = RunConfig(
    out=str(tmp_path / f"run_{mesh_spec}"),
    steps=steps,
    batch_size=16,
    grad_accum=accum,
    learning_rate=1e-2,
    warmup_steps=0,
    dtype="float32",
    lora_rank=4,
    remat="full",
    quantization=quantization,
  ).replace(**run_kw)
  (tmp_path / f"run_{mesh_spec}").mkdir(exist_ok=True)
  devices = jax.devices()[: math.prod(meshlib.parse_mesh(mesh_spec, 8).values())]
  model = jaxtune.from_pretrained(path, quantization=quantization, dtype="float32")
  rt = resolver.resolve(run.replace(mesh=mesh_spec), model.config, devices=devices)
  model = jaxtune.from_pretrained(path, quantization=quantization, dtype="float32", mesh=rt.mesh)
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0)
  _, history = trainer.train(model, _dataset(), run, rt)
  return np.array([h["loss"] for h in history])


def _one_device(run, model):
  """The runtime ``run`` resolves to on one device."""
  return resolver.resolve(run, model.config, devices=jax.devices()[:1])


def _spy_on_residual_sharding(monkeypatch, seen: set) -> None:
  """Record (residual sharding spec, sequence length) at every residual add while tracing."""
  from jaxtune.models import blocks

  real = blocks.Block._residual

  def spy(self, x, rt):
    if rt.sequence_parallel:
      seen.add((tuple(rt.spec("batch", "norm_length", "embed")), x.shape[1]))
    return real(self, x, rt)

  monkeypatch.setattr(blocks.Block, "_residual", spy)


@pytest.fixture(scope="module")
def single(tiny, tmp_path_factory):
  """_losses' 3 steps on one device with XLA attention (CPU's default), trained once: the
  reference of every mesh test below. Also the residual shardings its trace asked for, and
  the order in which the loop dispatched steps and read their figures."""
  seen, events = set(), []
  real_row, real_choose = trainer._row, plan.choose

  def row(i, *args):
    events.append(("read", i))
    return real_row(i, *args)

  def choose(*args, **kwargs):
    step_fn, chosen = real_choose(*args, **kwargs)
    taken = itertools.count()

    def counted(*step_args):
      events.append(("step", next(taken)))
      return step_fn(*step_args)

    return counted, chosen

  with pytest.MonkeyPatch.context() as m:
    _spy_on_residual_sharding(m, seen)
    m.setattr(trainer, "_row", row)
    m.setattr(plan, "choose", choose)
    losses = _losses(tiny, "1", tmp_path_factory.mktemp("one"), attention="xla")
  return losses, seen, events


@pytest.mark.slow
def test_a_step_is_dispatched_before_the_previous_one_is_read(single):
  """The device never waits for the host between steps: step i + 1 is queued before step i's
  figures are read; the last step, which ends the run, is read at once."""
  *_, events = single
  assert events == [
    ("step", 0), ("step", 1), ("read", 0), ("step", 2), ("read", 1), ("read", 2)
  ]  # fmt: skip


@pytest.mark.slow
def test_mesh_losses_equal_single_device(tiny, single, tmp_path):
  assert jax.device_count() == 8
  single, *_ = single
  assert single[-1] < single[0]  # it learns, so the comparison is not of constants
  # "data=2,tensor=4" spells the 2x4 mesh: the same Mesh, hence the same program and losses.
  assert meshlib.make_mesh("data=2,tensor=4", jax.devices()) == meshlib.make_mesh("2x4")
  # (tensor=8 does not divide the 4 key/value heads: the resolve refuses 1x8 here.)
  # (tensor alone: 2x4 and the pipeline tests split over tensor; 1x4 added 5 s and nothing.)
  for spec in ("2x4", "8"):
    np.testing.assert_allclose(_losses(tiny, spec, tmp_path), single, rtol=2e-5, err_msg=spec)


@pytest.mark.slow
def test_pallas_attention_under_a_mesh_trains_like_one_device(tiny, single, tmp_path):
  """--attention pallas under --mesh 2x4 runs the flash op per (data, tensor) shard in a
  shard_map (on CPU its jnp fallback inside): the losses of one device with XLA attention."""
  sharded = _losses(tiny, "2x4", tmp_path / "mesh", attention="pallas")
  np.testing.assert_allclose(sharded, single[0], rtol=2e-5)


@pytest.mark.slow
def test_sequence_parallel_trains_like_one_device(tiny, single, tmp_path, monkeypatch):
  """--sequence-parallel keeps the residual stream's tokens split over tensor after every
  residual add (checked while tracing) and trains exactly like one device: 2x4 with XLA
  attention, 2x4 with the flash op per shard."""
  single, seen_single, _ = single
  assert not seen_single
  seen = set()
  _spy_on_residual_sharding(monkeypatch, seen)
  for spec, attention in (("2x4", "xla"), ("2x4", "pallas")):
    seen.clear()
    split = _losses(tiny, spec, tmp_path / attention, attention=attention, sequence_parallel=True)
    assert seen == {(("data", "tensor", None), 32)}, attention
    np.testing.assert_allclose(split, single, rtol=2e-5, err_msg=attention)


def test_default_attention_separates_packed_held_out_rows():
  """On a GPU where cuDNN would be the default, packed evaluation rows (even with unpacked
  training rows) make the runtime choose an attention that keeps examples apart."""
  from types import SimpleNamespace

  rng = np.random.default_rng(5)
  short = [list(rng.integers(1, 256, 10)) for _ in range(8)]
  held_out = data.to_rows(short, [e[1:] + [data.IGNORE] for e in short], 32)
  assert held_out.packed and not _dataset().packed
  cfg = jaxtune.ModelConfig(
    model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
    num_heads=8, num_kv_heads=4, head_dim=32,
  )  # fmt: skip
  gpu = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="A100")
  chosen = []
  for eval_dataset in (None, held_out):
    packed = _dataset().packed or (eval_dataset is not None and eval_dataset.packed)
    impl, _ = resolver.resolve_attention(None, cfg, dtype="float32", packed=packed, device=gpu)
    chosen.append(impl)
  assert chosen == ["cudnn", "xla"]


@pytest.mark.slow
def test_pipeline_run_settings_train_like_one_device(tiny, single, tmp_path):
  """--mesh 2x2x2 with --shard-frozen, --microbatches, --remat offload and --loss-chunk, via the
  trainer's own placement: the same losses as one device."""
  settings = dict(shard_frozen=True, microbatches=2, remat="offload", loss_chunk=8)
  piped = _losses(tiny, "2x2x2", tmp_path / "piped", **settings)
  np.testing.assert_allclose(piped, single[0], rtol=2e-5)


@pytest.mark.slow
def test_chunked_loss_equals_the_full_logits_loss(tiny, monkeypatch):
  """Loss sums and LoRA gradients of the chunked cross-entropy (pieces of 4 tokens, 4 being
  the largest divisor of 24 not above 5) equal those of the full [B, T, V] logits."""
  path = tiny
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0, targets=("q_proj", "lm_head"))
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  lora = jax.tree.map(lambda x: x + 0.01, lora)  # B = 0 would hide the adapters' gradients
  ds = _dataset(vocab=model.config.vocab_size, n=2, t=24, seed=3)
  ids, labels = jnp.asarray(ds.input_ids), jnp.asarray(ds.labels)

  def full(lora):
    m = nnx.merge(graphdef, lora, frozen)
    logits = m(ids)
    mask = labels != data.IGNORE
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
    return jnp.sum(ce * mask), jnp.sum(mask)

  def chunked(lora, vocab_piece=None):
    m = nnx.merge(graphdef, lora, frozen)
    vocab = None if vocab_piece is None else (m.logits_piece, m.config.vocab_size, vocab_piece)
    h = m.hidden_states(ids)
    return losses.chunked_loss_sums(m.logits_from_hidden, h, labels, 5, vocab)

  (ref, ref_n), ref_g = jax.value_and_grad(full, has_aux=True)(lora)
  # Token pieces; token and vocabulary pieces (lm_head rows and its LoRA B columns sliced).
  for vocab_piece in (None, 100):  # 100 -> pieces of 64, the largest divisor of 256
    (got, got_n), got_g = jax.value_and_grad(chunked, has_aux=True)(lora, vocab_piece)
    assert int(got_n) == int(ref_n) > 0
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(ref_g), strict=True):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)

  # The output layer trains here (LoRA on lm_head): --loss-chunk recomputes each piece's
  # logits in the backward. Without it, the pieces' forward takes their gradient instead (one
  # custom VJP, nothing recomputed): the same sums and gradients.
  def through_step(lora, graphdef, frozen, chunk):
    s, n = losses.loss_sums(
      graphdef, lora, frozen, ds_batch, None, runtime.Runtime(loss_chunk=chunk)
    )
    return 3.7 * s, n  # a cotangent other than 1 reaches the pieces' gradients

  ds_batch = {"input_ids": ids, "labels": labels, "segment_ids": jnp.ones_like(ids)}
  frozen_head = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  frozen_head = jaxtune.apply_lora(frozen_head, rank=4, alpha=8, seed=0, targets=("q_proj",))
  parts = nnx.split(frozen_head, nnx.LoRAParam, ...)
  lora_q = jax.tree.map(lambda x: x + 0.01, parts[1])
  fused_calls = []
  fused_loss_sums = losses.fused_loss_sums
  monkeypatch.setattr(
    losses, "fused_loss_sums", lambda *a: fused_calls.append(1) or fused_loss_sums(*a)
  )
  for parts_, lora_, fused in ((parts, lora_q, True), ((graphdef, lora, frozen), lora, False)):
    g_def, _, g_frozen = parts_
    fused_calls.clear()
    jax.make_jaxpr(through_step, static_argnums=(1, 3))(lora_, g_def, g_frozen, 5)
    assert bool(fused_calls) == fused
    want, want_g = jax.value_and_grad(through_step, has_aux=True)(lora_, g_def, g_frozen, 0)
    got, got_g = jax.value_and_grad(through_step, has_aux=True)(lora_, g_def, g_frozen, 5)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    assert int(got[1]) == int(want[1]) > 0
    for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)
  # float16 (loss scaling) keeps the recomputing pieces: the fused ones take their gradients
  # before the scale would multiply them.
  half = jaxtune.from_pretrained(path, quantization="nf4", dtype="float16")
  half = nnx.split(
    jaxtune.apply_lora(half, rank=4, alpha=8, seed=0, targets=("q_proj",)), nnx.LoRAParam, ...
  )
  fused_calls.clear()
  jax.make_jaxpr(through_step, static_argnums=(1, 3))(half[1], half[0], half[2], 5)
  assert not fused_calls


@pytest.mark.beside
@pytest.mark.slow
def test_chunked_mlp_trains_like_the_whole_mlp_in_less_memory(tiny, hf_llama_dir):
  """--mlp-chunk: the MLP over pieces of 10 tokens (24 = 10 + 10 + 4, zero-padded) under
  remat gives the loss and LoRA gradients of the whole-sequence MLP; and XLA's plan for a long
  row (CPU) needs far less temporary memory, the [T, intermediate] buffers existing one piece
  at a time."""
  path = tiny
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0)
  lora0 = jax.tree.map(lambda x: x + 0.01, nnx.state(model, nnx.LoRAParam))
  nnx.update(model, lora0)

  def grads(mlp_chunk, t):
    rt = runtime.Runtime(remat="full", mlp_chunk=mlp_chunk)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    ds = _dataset(vocab=model.config.vocab_size, n=2, t=t, seed=3)
    batch = {k: jnp.asarray(getattr(ds, k)) for k in ("input_ids", "labels", "segment_ids")}
    fn = jax.value_and_grad(losses.loss_sums, argnums=1, has_aux=True)
    return jax.jit(fn, static_argnums=(0, 5)), (graphdef, lora, frozen, batch, None, rt)

  fn, args = grads(0, 24)
  (ref, _), ref_g = fn(*args)
  fn, args = grads(10, 24)
  (got, _), got_g = fn(*args)
  np.testing.assert_allclose(float(got), float(ref), rtol=1e-5)
  for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(ref_g), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)

  # A wide MLP (as in real models, where [T, intermediate] outweighs [T, T] per head at long T).
  wide, _ = _tiny_dir(hf_llama_dir, seed=12, intermediate_size=8192, num_hidden_layers=1)
  model = jaxtune.apply_lora(jaxtune.from_pretrained(wide, quantization="nf4"), rank=4)

  def temp_bytes(mlp_chunk):
    fn, args = grads(mlp_chunk, 512)
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

  whole, pieces = temp_bytes(0), temp_bytes(64)
  print(
    f"XLA:CPU temporaries, T=512: {whole / 2**20:.1f} MiB whole, {pieces / 2**20:.1f} MiB chunked"
  )
  assert pieces < 0.5 * whole, (pieces, whole)


@pytest.mark.slow
def test_grad_accumulation_normalises_over_all_micro_batches(tiny, tmp_path):
  path = tiny
  one = _losses(path, "1", tmp_path / "a", steps=2, accum=1)
  four = _losses(path, "1", tmp_path / "b", steps=2, accum=8)
  np.testing.assert_allclose(four, one, rtol=2e-5)


@pytest.mark.slow
def test_export_round_trips_to_transformers_and_peft(tiny, tmp_path):
  from peft import PeftModel
  from transformers import LlamaForCausalLM

  path = tiny
  mesh = meshlib.make_mesh("2x4")
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32", mesh=mesh)
  model = jaxtune.apply_lora(model, rank=4, alpha=8)
  run = RunConfig(
    out=str(tmp_path),
    steps=3,
    batch_size=8,
    learning_rate=1e-2,
    warmup_steps=0,
    dtype="float32",
    lora_rank=4,
  )
  model, _ = trainer.train(
    model, _dataset(), run, resolver.resolve(run.replace(mesh="2x4"), model.config)
  )
  ids = np.random.default_rng(5).integers(0, 256, (2, 20))
  ours = np.asarray(model(jnp.asarray(ids)))

  merged_dir = jaxtune.export_merged(model, tmp_path / "merged", dtype="float32")
  hf = LlamaForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf(torch.from_numpy(ids)).logits.numpy()
  assert max_rel_err(theirs, ours) <= 1e-5

  # PEFT on the original (unquantized) checkpoint: same adapters, base without NF4 error.
  peft_dir = jaxtune.export_peft(model, tmp_path / "peft")
  base = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
  peft_model = PeftModel.from_pretrained(base, peft_dir).eval()
  dense = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  dense = jaxtune.apply_lora(dense, rank=4, alpha=8)
  for (_, a), (_, b) in zip(
    jaxtune.models.lora.iter_linears(dense), jaxtune.models.lora.iter_linears(model), strict=True
  ):
    if a.lora_a is not None:
      a.lora_a[...] = jax.device_get(b.lora_a[...])
      a.lora_b[...] = jax.device_get(b.lora_b[...])
  with torch.no_grad():
    peft_logits = peft_model(torch.from_numpy(ids)).logits.numpy()
  assert max_rel_err(peft_logits, np.asarray(dense(jnp.asarray(ids)))) <= 1e-5
  # The adapters are trained (non-zero B), so the PEFT check is not of the base alone.
  assert any(
    np.abs(np.asarray(b.lora_b[...])).max() > 0
    for _, b in jaxtune.models.lora.iter_linears(model)
    if b.lora_b is not None
  )


def test_chat_loss_covers_assistant_turns_only(tmp_path):
  # The error cases of data files are in test_catalogue.py.
  tok_dir = default_model.ensure_default_checkpoint(tmp_path / "ckpt")
  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(tok_dir)
  chat = tmp_path / "chat.jsonl"
  chat.write_text(
    json.dumps(
      {
        "messages": [
          {"role": "user", "content": "hi " * 50},
          {"role": "assistant", "content": "yo"},
        ]
      }
    )
    + "\n"
  )
  ds, _, _ = data_tokenize.load(str(chat), tok, DataSettings(seq_len=256))
  # Loss only on the assistant turn: its tokens (and the closing eos) and nothing before.
  labelled = ds.labels[0][ds.labels[0] != data.IGNORE]
  assert tok.decode(labelled) == "yo<|eos|>"


@background_run("default_run_export")
def _default_run_export(directory, runs):
  """The export command line on the default run: (its --out, the finished process)."""
  out, _ = runs.result("default_run")
  again = directory / "again"
  argv = [sys.executable, "-m", "jaxtune.export", "--checkpoint", str(out), "--format", "merged"]
  return again, run_cli([*argv, "--out", str(again)], timeout=600)


@pytest.mark.slow
def test_default_run_learns_and_exports(default_run, default_run_export):
  out, proc = default_run  # `python -m jaxtune.train --out OUT --steps 40`, see conftest.py
  assert proc.returncode == 0, proc.stderr[-2000:]
  # A quiet run: our lines only (no third-party warnings), ending in the run's summary.
  ours = ("jaxtune: ", "step ", "eval at step ")
  assert [x for x in proc.stderr.splitlines() if not x.startswith(ours)] == []
  summary = proc.stdout.strip().splitlines()[-1]
  assert summary.startswith("jaxtune: trained steps 1-40 of 40 in ")
  assert f"merged export in {out.resolve() / 'export'}" in summary
  rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 40
  first, last = np.mean([r["loss"] for r in rows[:5]]), np.mean([r["loss"] for r in rows[-5:]])
  assert last < 0.6 * first
  assert (out / "export" / "model.safetensors").is_file() and (out / "config.yaml").is_file()

  # The export CLI rebuilds the model from the run directory and writes the same weights.
  again, cli = default_run_export
  assert cli.returncode == 0, cli.stderr[-2000:]
  assert cli.stderr == ""  # no absl warning that the run's checkpoints are read only
  from safetensors.numpy import load_file

  a, b = load_file(out / "export" / "model.safetensors"), load_file(again / "model.safetensors")
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _tiny_model(path):
  return jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4)


@pytest.mark.slow
def test_zero_loss_stops_or_is_skipped(tiny, tmp_path):
  masked = _dataset(masked=True)
  run = RunConfig(out=str(tmp_path), steps=3, batch_size=4, dtype="float32", lora_rank=4)
  with pytest.raises(trainer.TrainingError, match="loss is 0.0 at step 1, most likely no token"):
    trainer.train(_tiny_model(tiny), masked, run, _one_device(run, _tiny_model(tiny)))
  model = _tiny_model(tiny)
  before = np.asarray(model.layers.self_attn.q_proj.lora_a[...])
  model, history = trainer.train(
    model, masked, run.replace(skip_nonfinite=True), _one_device(run, model)
  )
  assert [h["skipped_steps"] for h in history] == [1, 2, 3]
  np.testing.assert_array_equal(np.asarray(model.layers.self_attn.q_proj.lora_a[...]), before)


@pytest.mark.slow
def test_overflow_stops_or_is_skipped(tiny, tmp_path):
  run = RunConfig(
    out=str(tmp_path),
    steps=6,
    batch_size=4,
    dtype="float32",
    lora_rank=4,
    learning_rate=1e30,
    warmup_steps=0,
    max_grad_norm=1e30,
    schedule="constant",
  )
  model = _tiny_model(tiny)
  with pytest.raises(trainer.TrainingError, match="most likely an overflow"):
    trainer.train(model, _dataset(), run, _one_device(run, model))
  model = _tiny_model(tiny)
  model, history = trainer.train(
    model, _dataset(), run.replace(skip_nonfinite=True), _one_device(run, model)
  )
  assert history[-1]["skipped_steps"] > 0
  assert all(
    np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
  )


@background_run("overflow_cli")
def _overflow_cli(directory, runs):
  """A command-line run whose first step overflows."""
  flags = ["--steps", "6", "--learning-rate", "1e30", "--warmup-steps", "0"]
  flags += ["--schedule", "constant", "--max-grad-norm", "1e30", "--export", "none"]
  out = directory / "r"
  return run_cli([sys.executable, "-m", "jaxtune.train", "--out", str(out), *flags], timeout=600)


@pytest.mark.slow
def test_overflow_from_the_cli_is_one_sentence(overflow_cli):
  proc = overflow_cli
  assert proc.returncode == 2
  assert "pass --skip-nonfinite" in proc.stderr and "Traceback" not in proc.stderr


def test_loss_scale_rule():
  """Halve on overflow (not below the minimum), double after `period` good steps in a row."""
  scale = step.LossScale(initial=8.0, factor=2.0, period=3, minimum=1.0)
  state = scale.init()
  seen = []
  for overflow in [True, False, False, False, True, True, True, True, False]:
    state = scale.update(state, jnp.bool_(overflow))
    seen.append(float(state["scale"]))
  assert seen == [4, 4, 4, 8, 4, 2, 1, 1, 1]


@pytest.mark.slow
def test_float16_skips_overflowing_steps_and_keeps_float32_master(tiny, tmp_path):
  """fp16 compute with dynamic loss scaling: a step whose scaled gradients overflow is skipped
  (nothing changes but the scale), the scale comes down, rises after good steps; adapters and
  optimizer state stay float32 throughout."""
  from jaxtune.training import checkpoint

  path = tiny
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float16"), rank=4)
  run = RunConfig(
    out=str(tmp_path),
    steps=6,
    batch_size=4,
    dtype="float16",
    lora_rank=4,
    learning_rate=1e-2,
    warmup_steps=0,
  )
  ckpts = checkpoint.Checkpoints(tmp_path / "checkpoints")
  # 2^16 times a per-token gradient of ~1 overflows float16 (max 65504) at once.
  rule = step.LossScale(initial=2.0**16, factor=4.0, period=2)
  model, history = trainer.train(
    model, _dataset(), run, _one_device(run, model), ckpts, loss_scale=rule
  )

  skipped = np.diff([0] + [h["overflow_steps"] for h in history]).astype(bool)
  assert skipped[0] and 0 < skipped.sum() < len(history)
  scale, good = rule.initial, 0
  for h, skip in zip(history, skipped, strict=True):
    assert np.isfinite(h["loss"])
    if skip:
      assert not np.isfinite(h["grad_norm"])
      scale, good = max(scale / rule.factor, rule.minimum), 0
    else:
      good += 1
      if good == rule.period:
        scale, good = scale * rule.factor, 0
    assert h["loss_scale"] == scale

  saved = ckpts.manager.item_metadata(6)["state"]
  floats = [x.dtype for x in jax.tree.leaves((saved["lora"], saved["opt_state"]))]
  assert {str(d) for d in floats} <= {"float32", "int32"} and "float32" in map(str, floats)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
  # Adam counted only the steps that were applied.
  graphdef, lora, _ = step.place(model, runtime.DEFAULT)
  tx, _ = step.make_optimizer(run)
  target = {
    "lora": lora,
    "opt_state": step.init_opt_state(tx, lora, rule),
    "key": jax.random.key(0),
  }
  state, _ = ckpts.restore_latest(target)
  counts = {int(x) for x in jax.tree.leaves(state["opt_state"]["tx"]) if x.ndim == 0}
  assert counts == {len(history) - int(skipped.sum())}
  assert float(state["opt_state"]["loss_scale"]["scale"]) == history[-1]["loss_scale"]


def _optax_optimizer(run: RunConfig):
  """make_optimizer's (transformation, schedule) as optax's own schedules build them, from the
  run's Python numbers: the reference."""
  warmup = max(0, min(run.warmup_steps, run.steps - 1))
  span = max(1, run.steps - warmup)
  decay = {
    "cosine": lambda: optax.cosine_decay_schedule(run.learning_rate, span),
    "linear": lambda: optax.linear_schedule(run.learning_rate, 0.0, span),
    "constant": lambda: optax.constant_schedule(run.learning_rate),
  }[run.schedule]()
  first = float(np.float32(run.learning_rate) / np.float32(warmup + 1))  # step 1 trains
  warm = optax.linear_schedule(first, run.learning_rate, warmup)
  schedule = optax.join_schedules([warm, decay], [warmup])
  clip = optax.clip_by_global_norm(run.max_grad_norm)
  return optax.chain(clip, optax.adamw(schedule, weight_decay=run.weight_decay)), schedule


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_the_learning_rate_schedule_is_optaxs_from_arrays(kind):
  """The schedule written out for numbers that are arrays gives optax's values at every
  step and past the end, within float32 rounding: from the run's numbers, with them traced
  (the training step's case) and in NumPy (the rows' figure)."""
  for steps, warmup, lr in ((10, 0, 2e-4), (10, 4, 3e-3), (1, 5, 1.0), (37, 36, 5e-5)):
    run = RunConfig(steps=steps, warmup_steps=warmup, learning_rate=lr, schedule=kind)
    counts = jnp.arange(steps + 3, dtype=jnp.int32)
    want = np.asarray(jax.vmap(_optax_optimizer(run)[1])(counts))
    assert want.max() > 0 and want[0] > 0, (steps, warmup)  # the first step trains
    # Within float32 rounding: optax subtracts its Python start and peak in float64.
    got = jax.vmap(step.make_optimizer(run)[1])(counts)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * lr)
    traced = jax.jit(lambda n, c, run=run: jax.vmap(step.make_optimizer(run, n)[1])(c))
    # Traced, XLA divides by a number it no longer sees: within float32 rounding of the peak
    # (near the cosine's end 1 + cos cancels, so relative to the peak, not to the value).
    got = traced(step.optimizer_numbers(run), counts)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * lr)
    # The rows' figure, computed in NumPy (nothing queued on the device): the same there.
    host = [step.host_learning_rate(run)(int(c)) for c in counts]
    np.testing.assert_allclose(host, want, rtol=1e-6, atol=1e-6 * lr)


def _least_squares(graphdef, lora, frozen, mb, key, rt):
  """A toy objective for the optimizer's part of the step: sum of squared errors of x @ w."""
  residual = mb["x"] @ lora["w"] - mb["y"]
  return jnp.sum(residual**2), jnp.int32(residual.size), {}


_least_squares.figures, _least_squares.zero_loss_ok = {}, False  # objective.Objective's


def test_runs_differing_in_the_optimizers_numbers_share_one_step():
  """The learning rate, step count, warmup, weight decay and clipping norm are the step's
  last argument, not constants of its program: two runs that differ in all of them lower to
  the same program (one entry of the compilation cache) and have one step store key, while
  the schedule's kind still changes both; and the shared program trains as optax's AdamW
  built from the second run's numbers. (The objective is a toy: what is checked is the
  optimizer's part of the step.)"""
  base = RunConfig(steps=3, learning_rate=1e-2, warmup_steps=0)
  other = base.replace(steps=7, learning_rate=3e-3, warmup_steps=2, weight_decay=0.1)
  other = other.replace(max_grad_norm=0.05)  # clipped: the gradients' norm is larger
  linear = base.replace(schedule="linear")
  rng = np.random.default_rng(0)
  lora = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)}
  batch = {
    "input_ids": jnp.zeros((2, 3, 1), jnp.int32),  # [accum, micro, T]: the step reads accum
    "x": jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32),
    "y": jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32),
  }
  opt_state = step.init_opt_state(step.make_optimizer(base)[0], lora)
  key, rt = jax.random.key(0), runtime.Runtime()

  def program(run, numbers_of):
    tx = step.make_optimizer(run)[0]
    fn = step.make_train_step(None, tx, rt, objective=_least_squares, run=run)
    numbers = step.optimizer_numbers(numbers_of)
    return fn, fn.lower(lora, opt_state, None, batch, key, numbers).as_text()

  shared, text = program(base, base)
  # each run's own step (as the trainer builds it) and the shared one with the other's numbers
  assert text == program(other, other)[1] == program(base, other)[1] != program(linear, linear)[1]
  model = SimpleNamespace(config="a model")
  identity = lambda run: trainer._step_identity(None, model, run, step.sft_objective, None, None)  # noqa: E731
  assert identity(base) == identity(other) != identity(linear)

  reference = step.make_train_step(None, _optax_optimizer(other)[0], rt, objective=_least_squares)
  got = want = None
  for fn, extra in ((shared, (step.optimizer_numbers(other),)), (reference, ())):
    state = jax.tree.map(jnp.copy, (lora, opt_state))  # donated by each step
    for i in range(4):
      *state, metrics = fn(*state, None, batch, jax.random.fold_in(key, i), *extra)
    got, want = want, (state, float(metrics["grad_norm"]))
  assert want[1] > 0.05  # the clipping norm is met
  assert float(jnp.abs(want[0][0]["w"] - lora["w"]).max()) > 1e-4  # it trained
  for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


def test_adapters_made_in_bfloat16_train_in_float32(tiny):
  path = tiny
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="bfloat16"), rank=4)
  for _, linear in jaxtune.models.lora.iter_linears(model):
    if linear.lora_a is not None:
      linear.lora_a.set_value(linear.lora_a[...].astype(jnp.bfloat16))
  assert model.layers.self_attn.q_proj.lora_a[...].dtype == jnp.bfloat16
  _, lora, _ = step.place(model, runtime.DEFAULT)
  tx, _ = step.make_optimizer(RunConfig(steps=10))
  for x in jax.tree.leaves((lora, step.init_opt_state(tx, lora, step.LossScale()))):
    assert x.dtype in (jnp.float32, jnp.int32), x.dtype


def test_gpus_without_bfloat16_train_in_float16():
  from types import SimpleNamespace

  from jaxtune.parallel.runtime import compute_dtype

  t4 = SimpleNamespace(platform="gpu", compute_capability="7.5", device_kind="Tesla T4")
  h100 = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100")
  cpu = SimpleNamespace(platform="cpu", device_kind="cpu")
  assert compute_dtype("bfloat16", [t4]) == (
    "float16",
    "Tesla T4 (compute capability 7.5) has no bfloat16: float16 with dynamic loss scaling",
  )
  assert compute_dtype("bfloat16", [h100]) == ("bfloat16", None)
  assert compute_dtype("bfloat16", [cpu]) == ("bfloat16", None)
  assert compute_dtype("float32", [t4]) == ("float32", None)

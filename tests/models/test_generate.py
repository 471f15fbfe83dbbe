"""Greedy generation with the KV cache equals transformers' generate, token for token."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import background_run, run_cli

import jaxtune
from jaxtune.models import kernel_operands
from jaxtune.models.decoding import generate_ids, init_cache, sample
from jaxtune.models.lora import iter_linears
from jaxtune.parallel.runtime import Decode


def _hf_greedy(hf, prompt, n):
  hf.generation_config.eos_token_id = None
  hf.generation_config.pad_token_id = 0
  with torch.no_grad():
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
  return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers(hf_llama_dir):
  path, hf = hf_llama_dir(seed=31)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  prompt = [5, 17, 99, 3, 42, 7]
  ours = generate_ids(model, [prompt], max_new_tokens=12)[0]
  assert ours == _hf_greedy(hf, prompt, 12)
  assert len(set(ours)) > 1  # not a degenerate repeat that any bug would reproduce


@pytest.mark.slow
def test_greedy_with_adapter_matches_transformers_on_merged(hf_llama_dir, tmp_path):
  from transformers import LlamaForCausalLM

  path, _ = hf_llama_dir(seed=32)
  model = jaxtune.apply_lora(
    jaxtune.from_pretrained(path, quantization=None, dtype="float32"), rank=4, alpha=8
  )
  rng = np.random.default_rng(0)
  for _, linear in iter_linears(model):
    if linear.lora_b is not None:
      linear.lora_b[...] = jnp.asarray(
        0.2 * rng.standard_normal(linear.lora_b[...].shape), jnp.float32
      )
  merged = LlamaForCausalLM.from_pretrained(
    jaxtune.export_merged(model, tmp_path / "m", dtype="float32"), torch_dtype=torch.float32
  ).eval()
  prompt = [9, 8, 7, 200, 1, 64]
  ours = generate_ids(model, [prompt], max_new_tokens=10)[0]
  assert ours == _hf_greedy(merged, prompt, 10)
  base = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  assert generate_ids(base, [prompt], max_new_tokens=10)[0] != ours  # the adapter matters


@pytest.mark.slow
def test_sliding_window_model_past_its_window(tmp_path):
  import transformers as tf

  torch.manual_seed(0)
  cfg = tf.Gemma2Config(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    query_pre_attn_scalar=48,
    sliding_window=6,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0,
    max_position_embeddings=128,
  )
  hf = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if name.endswith("norm.weight"):
        p.add_(0.3 * torch.randn_like(p))
  hf.save_pretrained(tmp_path / "g2")
  model = jaxtune.from_pretrained(tmp_path / "g2", quantization=None, dtype="float32")
  # Sliding layers keep a ring of `window` slots; full layers keep every slot.
  cache = init_cache(model, 3, 40)
  # [layers, rows, kv heads, slots, head_dim]: heads before slots (decoding.init_cache).
  assert cache["local"][0].shape[:4] == (2, 3, 2, 6)
  assert cache["global"][0].shape[:4] == (2, 3, 2, 40)
  prompt = [3, 1, 4, 1, 5]
  ours = generate_ids(model, [prompt], max_new_tokens=12)  # 17 tokens, window 6
  assert ours[0] == _hf_greedy(hf, prompt, 12)
  long_prompt = [7, 3, 9, 200, 14, 1, 60, 61, 2, 33]  # prefill longer than the window
  assert generate_ids(model, [long_prompt], max_new_tokens=8)[0] == _hf_greedy(hf, long_prompt, 8)
  # Batched with left padding through the ring as well.
  both = generate_ids(model, [prompt, long_prompt], max_new_tokens=8)
  assert both == [generate_ids(model, [p], max_new_tokens=8)[0] for p in (prompt, long_prompt)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2"])  # (llama: 11.6 s, a subset of gemma2's layers)
def test_decode_layers_unrolled_compute_what_the_scan_computes(
  family, hf_llama_dir, tmp_path, monkeypatch
):
  """forward_cached with its layers unrolled (``decoding.UNROLL_LAYERS_UP_TO``: the default
  for these models) and as a loop of one layer an iteration (70B's): the same logits and KV
  caches after a prompt and after one more token (NF4 weights, float32). Gemma 2 alternates
  sliding-window layers (a ring of 8 slots, the prompt longer) with global ones."""
  from flax import nnx
  from test_packing import _gemma2_dir

  from jaxtune.models import decoding

  path = hf_llama_dir(seed=36)[0] if family == "llama" else _gemma2_dir(tmp_path)
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  assert model.config.num_layers <= decoding.UNROLL_LAYERS_UP_TO
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(1, 256, (2, 10)), jnp.int32)

  def two_calls(up_to):
    monkeypatch.setattr(decoding, "UNROLL_LAYERS_UP_TO", up_to)

    @jax.jit
    def f(state, ids):
      m = nnx.merge(graphdef, state)
      cache, valid = init_cache(m, 2, 16), jnp.ones((2, 16), bool)
      pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
      first, cache = decoding.forward_cached(m, ids, pos, cache, 0, valid)
      nxt = jnp.asarray([[3], [200]], jnp.int32)
      second, cache = decoding.forward_cached(m, nxt, pos[:, -1:] + 1, cache, 10, valid)
      return first, second, cache

    return jax.tree.leaves(f(state, ids))

  scanned, unrolled = two_calls(0), two_calls(model.config.num_layers)
  # Two logits, then keys and values of the global cache (and of the local ring: Gemma 2).
  assert len(scanned) == len(unrolled) == (4 if family == "llama" else 6)
  for got, want in zip(unrolled, scanned, strict=True):
    assert float(jnp.abs(want).max()) > 0  # every cache was written
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_batched_left_padding_equals_one_by_one(hf_llama_dir):
  path, _ = hf_llama_dir(seed=33)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 3], [42, 42, 17, 1]]
  batched = generate_ids(model, prompts, max_new_tokens=8)
  assert batched == [generate_ids(model, [p], max_new_tokens=8)[0] for p in prompts]


def test_the_wide_batch_loop_generates_the_same_tokens(hf_llama_dir, monkeypatch):
  """From decoding.WIDE_ROWS rows (GPUs) the loop is compiled with other XLA options (its
  products through cuBLAS, reading the cache's layer in place): the same tokens; here on
  the CPU, from two rows."""
  from jaxtune.models import decoding

  path, _ = hf_llama_dir(seed=35)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 3]]
  narrow = generate_ids(model, prompts, max_new_tokens=6)
  decoding._decode_wide.clear_cache()
  wide = Decode(wide_rows=2)  # the plan's on a GPU: Decode(wide_rows=decoding.WIDE_ROWS)
  assert generate_ids(model, prompts, max_new_tokens=6, decode=wide) == narrow
  assert decoding._decode_wide._cache_size() == 1  # the wide loop ran


@pytest.mark.gpu
def test_the_wide_batch_loop_generates_the_same_tokens_on_a_gpu(hf_llama_dir, monkeypatch):
  """On a GPU the wide loop's options take effect (dynamic-slice fusion, cuBLAS products):
  16 rows of a float32 model give the tokens of the loop compiled without them. At full
  float32 precision: at the GPU's default one the two paths' products round differently, and
  a near tie of two logits flipped one of 384 greedy tokens (H100)."""
  from jaxtune.models import decoding

  path, _ = hf_llama_dir(seed=36)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 200, rng.integers(3, 40)).tolist() for _ in range(16)]
  decoding._decode_wide.clear_cache()
  with jax.default_matmul_precision("highest"):
    wide = generate_ids(model, prompts, max_new_tokens=24)
    assert decoding._decode_wide._cache_size() == 1
    monkeypatch.setattr(decoding, "WIDE_ROWS", 10**9)
    assert generate_ids(model, prompts, max_new_tokens=24) == wide


def test_prompts_of_one_bucket_share_the_compiled_programs(hf_llama_dir):
  """Prompt lengths and new-token counts round up to decoding.BUCKET: other lengths in the
  same buckets reuse the compiled prefill and decode loop, and still generate what they
  would alone (left padding is masked)."""
  from jaxtune.models import decoding

  path, _ = hf_llama_dir(seed=34)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  first = generate_ids(model, [[5, 6, 7]], max_new_tokens=5)
  sizes = decoding._prefill._cache_size(), decoding._decode._cache_size()
  second = generate_ids(model, [[9, 8, 7, 6, 5, 4, 3]], max_new_tokens=9)
  assert (decoding._prefill._cache_size(), decoding._decode._cache_size()) == sizes
  assert len(first[0]) == 5 and len(second[0]) == 9
  # The bucket's padding changes nothing: greedy decoding of the 3-token prompt, 5 tokens, is
  # the start of its 9-token continuation.
  assert generate_ids(model, [[5, 6, 7]], max_new_tokens=9)[0][:5] == first[0]


def test_sampling_options():
  logits = jnp.log(jnp.asarray([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1]]))
  assert sample(logits, jax.random.key(0)).tolist() == [1, 0]
  # top_k=1 and a tiny top_p both reduce sampling to the argmax
  for kw in (dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_p=0.05)):
    for seed in range(5):
      assert sample(logits, jax.random.key(seed), **kw).tolist() == [1, 0]
  # plain sampling at high temperature does visit other tokens
  seen = {tuple(sample(logits, jax.random.key(s), temperature=5.0).tolist()) for s in range(40)}
  assert len(seen) > 1


def test_eos_stops_only_its_row(hf_llama_dir):
  path, _ = hf_llama_dir(seed=34)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  prompts = [[5, 6, 7], [100, 3, 9]]
  free = generate_ids(model, prompts, max_new_tokens=6)
  eos = free[0][2]
  assert eos not in free[1]
  stopped = generate_ids(model, prompts, max_new_tokens=6, eos_token_ids=[eos])
  assert stopped[0] == free[0][: free[0].index(eos) + 1] and stopped[1] == free[1]


@background_run("cli_generation")
def _cli_generation(directory, runs):
  """The generate command line on the default run (conftest.py), and without any model."""
  out, _ = runs.result("default_run")
  prompt = ["--prompt", "What is 2 plus 3?", "--chat", "--max-new-tokens", "5"]
  generate = [sys.executable, "-m", "jaxtune.generate"]
  proc = run_cli([*generate, "--adapter", str(out), *prompt], timeout=600)
  return proc, run_cli([*generate, "--prompt", "hi"], timeout=300)


@pytest.mark.slow
def test_cli_generates_from_a_trained_run(default_run, cli_generation):
  out, train = default_run  # the default run (40 steps), shared with test_train.py
  assert train.returncode == 0, train.stderr[-2000:]
  proc, bad = cli_generation
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stderr == ""  # quiet: no third-party warnings
  assert "### What is 2 plus 3?" in proc.stdout
  assert bad.returncode == 2 and "pass --model" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("n", [3])  # (one prompt: the command line's, cli_generation)
def test_python_api(n):
  from transformers import AutoTokenizer

  from jaxtune.run.default_model import ensure_default_checkpoint

  path = ensure_default_checkpoint()
  tok = AutoTokenizer.from_pretrained(path)
  model = jaxtune.from_pretrained(path, dtype="float32")
  texts = jaxtune.generate(model, tok, ["Count to 3."] * n, max_new_tokens=4, chat=True)
  assert len(texts) == n and all(isinstance(t, str) for t in texts)
  assert len(set(texts)) == 1  # the same prompt gives the same greedy text in every row


@pytest.mark.slow
def test_decode_step_with_fused_kernel_operands(hf_llama_dir):
  """Decoding's prepared operands (prepare_kernel_operands, as on a Hopper GPU: every NF4
  layer taken as a kernel layer here) run q/k/v and gate/up as one product each
  (layers.Fused); with biases and a trained adapter the logits stay those of the plain
  model, within the kernel operands' bf16 scales."""
  from jaxtune.models import decoding
  from jaxtune.models.layers import Fused

  path, _ = hf_llama_dir(seed=35, attention_bias=True)
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4, alpha=8)
  rng = np.random.default_rng(1)
  adapted = [lin for _, lin in iter_linears(model) if lin.lora_b is not None]
  for linear in adapted:
    linear.lora_b[...] = jnp.asarray(0.2 * rng.standard_normal(linear.lora_b.shape), jnp.float32)
  ids = jnp.asarray([[5, 17, 99, 3, 42, 7]])
  positions = jnp.arange(6)[None]

  def logits(m):
    cache = init_cache(m, 1, 64)
    return np.asarray(
      decoding.forward_cached(m, ids, positions, cache, 0, jnp.ones((1, 64), bool))[0]
    )

  plain = logits(model)
  launches = kernel_operands.prepare_kernel_operands(model, 1, word=True, every=True)
  assert launches == 4  # q/k/v, o, gate/up, down: o and down alone
  assert isinstance(model.layers.self_attn.qkv_fused, Fused)
  assert model.layers.mlp.gate_up_fused.sizes == (192, 192)
  assert model.layers.self_attn.qkv_fused.codes.shape == (3, 256, 64)  # stacked over layers
  fused = logits(model)
  for linear in adapted:
    linear.lora_b[...] = jnp.zeros_like(linear.lora_b[...])
  no_adapter = logits(model)
  off = np.linalg.norm(fused - plain) / np.linalg.norm(plain)
  assert off < 1e-2 and np.linalg.norm(no_adapter - plain) / np.linalg.norm(plain) > 20 * off


@pytest.mark.slow
def test_codes_put_in_word_order_in_place_for_the_loop_and_back(hf_llama_dir):
  """kernel_operands.codes_in_word_order (no room for a copy of the codes: 70B on one GPU): inside,
  every kernel layer's codes are in the kernel's word order in their own buffer (the old
  array donated, not copied); a token step given them as word codes (XLA's path here) reads
  them back in bitsandbytes' order, so its logits are the plain model's bit for bit, while
  the same step not told of the order is off; on the way out the codes are the originals.
  With LoRA adapters (random B), so gate/up's folded products read the codes that way too."""
  from flax import nnx

  from jaxtune.models import decoding
  from pallas_kernels.nf4_matmul import word_codes

  path, _ = hf_llama_dir(seed=36)
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4)
  linears = [lin for _, lin in iter_linears(model) if lin.quantized]
  for n, lin in enumerate(linears):
    b = lin.lora_b.get_value()
    lin.lora_b.set_value(0.2 * jax.random.normal(jax.random.key(n), b.shape, b.dtype))
  before = [np.array(lin.codes.get_value(), copy=True) for lin in linears]  # not a view
  held = linears[0].codes.get_value()
  ids, positions = jnp.asarray([[5, 17, 99]]), jnp.arange(3)[None]

  def logits(prepare):
    m = nnx.merge(*nnx.split(model))
    if prepare:
      kernel_operands.prepare_kernel_operands(m, 3, word="inplace", every=True)
    cache = init_cache(m, 1, 64)
    out = decoding.forward_cached(m, ids, positions, cache, 0, jnp.ones((1, 64), bool))[0]
    return np.asarray(out)

  plain = logits(False)
  with kernel_operands.codes_in_word_order(model, 3, every=True) as permuted:
    assert permuted == len(linears) == 7
    assert held.is_deleted()
    for lin, old in zip(linears, before, strict=True):
      np.testing.assert_array_equal(np.asarray(lin.codes.get_value()), word_codes(jnp.asarray(old)))
    np.testing.assert_array_equal(logits(True), plain)
    assert np.abs(logits(False) - plain).max() > 1e-3
  for lin, old in zip(linears, before, strict=True):
    np.testing.assert_array_equal(np.asarray(lin.codes.get_value()), old)
  np.testing.assert_array_equal(logits(False), plain)


@pytest.mark.slow
def test_generate_with_codes_in_place_gives_the_same_tokens(hf_llama_dir, monkeypatch):
  """generate_ids(decode=Decode(word_codes="inplace")), the plan where no copy fits: the
  decode loop runs on the model's own codes permuted in place (every NF4 layer taken as a
  kernel layer; the op's XLA path reads them back in order), gives the tokens of a plain
  call, and leaves the codes as they were."""

  path, _ = hf_llama_dir(seed=37)
  model = jaxtune.from_pretrained(path, dtype="float32")
  prompts = [[5, 17, 99, 3], [42, 7]]
  plain = generate_ids(model, prompts, max_new_tokens=6)
  linears = [lin for _, lin in iter_linears(model) if lin.quantized]
  before = [np.array(lin.codes.get_value(), copy=True) for lin in linears]
  swaps = []
  swap = kernel_operands._swap_word_order
  monkeypatch.setattr(kernel_operands, "call_impl", lambda nf4_matmul, tokens, weights: "kernel")
  monkeypatch.setattr(kernel_operands, "_swap_word_order", lambda c: swaps.append(1) or swap(c))
  decode = Decode(word_codes="inplace", nf4_matmul="few-tokens")
  got = generate_ids(model, prompts, max_new_tokens=6, decode=decode)
  assert got == plain
  assert len(swaps) == 2 * len(linears)  # each layer's codes out of order and back
  for lin, old in zip(linears, before, strict=True):
    np.testing.assert_array_equal(np.asarray(lin.codes.get_value()), old)

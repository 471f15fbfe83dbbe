"""Text generation with a preallocated KV cache: jitted prefill, then one jitted decode loop.

Prompts of a batch are left-padded to one length; padding slots are masked out of attention
and positions count real tokens only, so each row generates what it would alone. Prompt
lengths and new-token counts are rounded up to buckets (``BUCKET``), so prompts of similar
lengths reuse one compiled prefill and decode loop; the loop's token count is an argument.
Each token step writes only its new keys and values into the cache (in place), and NF4
layers that go through the Pallas kernel get its scales made once per loop, and its codes in
the word order its faster lookups ("plut", "lut", "word") read, where the device has room for that
copy (``kernel_operands``). The command line is jaxtune/generate.py.
"""

import contextlib
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtune.errors import UserError
from jaxtune.models import attention
from jaxtune.models.decoder import Decoder
from jaxtune.models.kernel_operands import loop_codes, prepare_kernel_operands
from jaxtune.parallel.runtime import DEFAULT, NO_WORD_CODES, Decode
from jaxtune.run_config import shown

# Prompt lengths and new-token counts are rounded up to multiples of this (compiled once per
# bucket, not per length).
BUCKET = 64
# The most new tokens one call may ask for: the loop counts them in int32, bucket rounding
# included.
MAX_NEW_TOKENS = 2**31 - 1 - BUCKET


def init_cache(model: Decoder, batch: int, length: int) -> dict:
  """An empty KV cache for ``length`` slots.

  Full-attention layers keep every slot: {"global": (k, v)} of [Lg, B, K, length, H].
  Sliding-window layers keep only their window, as a ring: {"local": (k, v)} of
  [Ll, B, K, min(window, length), H]; slot a lives at ring index a % window. Heads before
  slots: the attention products read a layer's keys and values without a transposed copy
  (8B on an H100 at batch 16: 1-2% more tokens/s than slots before heads,
  experiments/RESULTS.md).
  """
  cfg = model.config
  window, _ = model.per_layer()
  n_local = int(np.sum(window > 0))
  n_global = cfg.num_layers - n_local
  ring = min(cfg.sliding_window or length, length)

  def zeros(n, slots):
    shape = (n, batch, cfg.num_kv_heads, slots, cfg.head_dim)
    return (jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype)) if n else None

  return {"global": zeros(n_global, length), "local": zeros(n_local, ring)}


# forward_cached puts every layer in its program (the layer loop unrolled) for models of at
# most this many layers, and loops over one layer an iteration above it. One H100, NF4, Llama
# shapes, experiments/check_decode_unroll.py: 8B (32 layers) decodes 1.05-1.09x / 1.09-1.12x
# faster unrolled at batch 1 / 16, its first call 23-27 s against 8-12 s; 70B (80 layers)
# 1.03x at batch 1 for a first call of 52 s against 14 s, so it keeps the loop. 48 is a cut
# between those two sizes, not measured. Unrolled and looped logits are one float32 program
# apart (test_generate) and equally far from float32 in bfloat16 (2.1-2.2%, random weights).
# 4 or 8 layers an iteration ran 0.56-0.65x the loop.
UNROLL_LAYERS_UP_TO = 48


def forward_cached(
  model: Decoder,
  input_ids: jax.Array,
  positions: jax.Array,
  cache: dict,
  start: int | jax.Array,
  key_valid: jax.Array,
  nf4_matmul: str = "xla",
) -> tuple[jax.Array, dict]:
  """Logits of the last position [B, V] (float32) and the cache with this chunk stored.

  input_ids/positions [B, T] take cache slots start .. start + T - 1; key_valid [B, S]
  marks the slots that hold real tokens (left padding does not). ``nf4_matmul``: how NF4
  layers multiply (``Decode.nf4_matmul``).
  """
  runtime = dataclasses.replace(DEFAULT, nf4_matmul=nf4_matmul)
  t = input_ids.shape[1]
  x, rope_global, rope_local = model.embed(input_ids, positions)
  window, local = model.per_layer()
  is_sliding = window > 0
  type_index = jnp.asarray(
    np.where(is_sliding, np.cumsum(is_sliding) - 1, np.cumsum(~is_sliding) - 1), jnp.int32
  )
  q_slot = start + jnp.arange(t)  # [T]

  def attend_global(cache, i, q, k, v, scale, softcap, sinks):
    ks, vs = cache["global"]
    # Only the new slots are written, into the whole stack (in place in the loop's carry).
    at = (i, 0, 0, start, 0)
    ks = jax.lax.dynamic_update_slice(ks, k.astype(ks.dtype).swapaxes(1, 2)[None], at)
    vs = jax.lax.dynamic_update_slice(vs, v.astype(vs.dtype).swapaxes(1, 2)[None], at)
    slots = jnp.arange(ks.shape[3])
    mask = key_valid[:, None, :] & (slots[None, None, :] <= q_slot[None, :, None])
    if t == 1 and q.shape[0] == 1 and sinks is None:  # a token step of one row
      out = _one_token_attention(q, ks, vs, i, mask[:, 0], scale, softcap)
    else:
      out = attention.masked_attention(
        q, ks[i], vs[i], mask[:, None, None], scale, softcap, heads_first=True, sinks=sinks
      )
    return out, {**cache, "global": (ks, vs)}

  def attend_local(cache, i, q, k, v, scale, softcap, sinks):
    ks, vs = cache["local"]
    ring = ks.shape[3]
    # Slot held by each ring entry before this chunk (negative: never written).
    held = start - 1 - jnp.mod(start - 1 - jnp.arange(ring), ring)
    slots = jnp.concatenate([held, q_slot])  # [ring + T]
    k_all = jnp.concatenate([ks[i], k.astype(ks.dtype).swapaxes(1, 2)], axis=2)
    v_all = jnp.concatenate([vs[i], v.astype(vs.dtype).swapaxes(1, 2)], axis=2)
    valid = (slots >= 0)[None, :] & jnp.take(key_valid, jnp.maximum(slots, 0), axis=1)
    distance = q_slot[:, None] - slots[None, :]
    mask = valid[:, None, :] & ((distance >= 0) & (distance < ring))[None]
    out = attention.masked_attention(
      q, k_all, v_all, mask[:, None, None], scale, softcap, heads_first=True, sinks=sinks
    )
    keep = min(t, ring)  # only the newest `ring` keys survive
    where = jnp.mod(start + t - keep + jnp.arange(keep), ring)
    # (i and where index around two slices: the indexed dims come first, [keep, B, K, H].)
    ks = ks.at[i, :, :, where].set(k[:, t - keep :].astype(ks.dtype).swapaxes(0, 1))
    vs = vs.at[i, :, :, where].set(v[:, t - keep :].astype(vs.dtype).swapaxes(0, 1))
    return out, {**cache, "local": (ks, vs)}

  graphdef, state = nnx.split(model.layers)

  def step(carry, xs):
    x, cache = carry
    layer_state, sliding, i, is_local = xs
    c = jnp.where(is_local, rope_local[0], rope_global[0])
    s = jnp.where(is_local, rope_local[1], rope_global[1])
    block = nnx.merge(graphdef, layer_state)

    def run(attend):
      attend_here = functools.partial(attend, cache, i)
      return block(x, c, s, None, None, None, runtime, cache=attend_here)

    if cache["local"] is None:
      x, cache = run(attend_global)
    elif cache["global"] is None:
      x, cache = run(attend_local)
    else:
      x, cache = jax.lax.cond(sliding, lambda: run(attend_local), lambda: run(attend_global))
    return (x, cache), None

  (x, cache), _ = jax.lax.scan(
    step,
    (x, cache),
    (state, jnp.asarray(is_sliding), type_index, jnp.asarray(local)),
    unroll=True if model.config.num_layers <= UNROLL_LAYERS_UP_TO else 1,
  )
  logits = model.logits_from_hidden(model.norm(x[:, -1:]))
  return logits[:, -1].astype(jnp.float32), cache


def _one_token_attention(q, ks, vs, i, mask, scale, softcap):
  """Attention of one new token a row, q [B, 1, N, H], over layer ``i`` of the stacked cache
  ks/vs [L, B, K, S, H] (mask [B, S]), in float32. Written as multiplies and sums rather than
  dots, so that XLA reads part of layer i's keys and values in place where a dot's operand is
  a copy of the layer's slice. Faster at one row only (H100, 8B, experiments/RESULTS.md: 280
  against 272 tok/s at batch 1; at batch 16 2,870 against 3,415, its sum over the slots
  costing 1.2 ms a token step), so taken there only."""
  b, _, n, h = q.shape
  kv = ks.shape[2]
  q = q.reshape(b, kv, n // kv, 1, h).astype(jnp.float32)  # [B, K, G, 1, H]
  keys = ks[i][:, :, None].astype(jnp.float32)  # [B, K, 1, S, H]
  scores = jnp.sum(q * keys, axis=-1) * scale  # [B, K, G, S]
  if softcap is not None:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)[..., None]  # [B, K, G, S, 1]
  out = jnp.sum(probs * vs[i][:, :, None].astype(jnp.float32), axis=-2)  # [B, K, G, H]
  return out.reshape(b, 1, n, h).astype(ks.dtype)


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample(
  logits: jax.Array, key: jax.Array, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> jax.Array:
  """Next tokens [B] from logits [B, V]: greedy at temperature 0, else top-k / top-p sampling."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the most likely token).
    drop_sorted = (cumulative - jax.nn.softmax(sorted_logits, axis=-1)) >= top_p
    drop = (
      jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
    )
    logits = jnp.where(drop, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 6))
def _prefill(graphdef, state, ids, positions, cache, key_valid, nf4_matmul):
  model = nnx.merge(graphdef, state)
  return forward_cached(model, ids, positions, cache, 0, key_valid, nf4_matmul)


def _decode_loop(
  graphdef,
  state,
  logits,
  cache,
  key_valid,
  first,
  room,
  temperature,
  top_k,
  top_p,
  positions,
  eos,
  key,
  n,
  word,
  fuse,
  nf4_matmul,
):
  """Up to ``n`` (traced, at most ``room``) tokens [B, room] on the device; stops early once
  every row has emitted EOS. ``word``, ``fuse``: the NF4 kernel's operands made for the loop
  (``prepare_kernel_operands``); ``nf4_matmul``: how NF4 layers multiply."""
  model = nnx.merge(graphdef, state)
  b = logits.shape[0]
  prepare_kernel_operands(model, b, word, fuse=fuse, nf4_matmul=nf4_matmul)

  def body(carry):
    i, logits, cache, key, tokens, done = carry
    key, sub = jax.random.split(key)
    nxt = sample(logits, sub, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = tokens.at[:, i].set(nxt)
    done = done | jnp.isin(nxt, eos)
    logits, cache = forward_cached(
      model, nxt[:, None], (positions + i)[:, None], cache, first + i, key_valid, nf4_matmul
    )
    return i + 1, logits, cache, key, tokens, done

  def cond(carry):
    i, *_, done = carry
    return (i < n) & ~jnp.all(done)

  init = (0, logits, cache, key, jnp.zeros((b, room), jnp.int32), jnp.zeros((b,), jnp.bool_))
  steps, *_, tokens, _ = jax.lax.while_loop(cond, body, init)
  return tokens, steps


_STATIC = (0, 6, 7, 8, 9, 14, 15, 16)
_decode = jax.jit(_decode_loop, static_argnums=_STATIC)
# From WIDE_ROWS rows on a GPU (the plan's ``Decode.wide_rows``) the loop is compiled with
# XLA's dynamic-slice fusion (a cuBLAS product reads a slice of its operand in place: the KV
# cache's layer) and cuBLAS for every product (Triton's fused products copy that slice
# first): H100, 8B, experiments/RESULTS.md, the same options as XLA_FLAGS: 3,716 against
# 3,576 tok/s at batch 16; with the heads-first KV cache 1.065x the previous tree at batch 16
# and 1.28x at batch 64 (GRPO rollouts); at batch 1 268 against 271, so not there.
WIDE_ROWS = 16
_WIDE_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False}
_decode_wide = jax.jit(_decode_loop, static_argnums=_STATIC, compiler_options=_WIDE_OPTIONS)


def check_sampling(
  max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int
) -> None:
  """Refuse sampling settings that cannot run, in one sentence naming the flag of
  ``python -m jaxtune.generate`` (which checks them before it loads a model)."""
  if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
    raise UserError(
      f"--max-new-tokens must be from 1 to {MAX_NEW_TOKENS}, got {shown(max_new_tokens)}."
    )
  if not (math.isfinite(temperature) and temperature >= 0):
    raise UserError(f"--temperature must be 0 (greedy) or more, got {temperature}.")
  if top_k < 0:
    raise UserError(f"--top-k must be 0 (off) or more, got {shown(top_k)}.")
  if not 0 < top_p <= 1:
    raise UserError(f"--top-p must be in (0, 1] (1: off), got {top_p}.")
  if not 0 <= seed < 2**32:
    raise UserError(f"--seed must be a whole number from 0 to {2**32 - 1}, got {shown(seed)}.")


def generate_ids(
  model: Decoder,
  prompts: Sequence[Sequence[int]],
  max_new_tokens: int = 64,
  eos_token_ids: Sequence[int] = (),
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  pad_id: int = 0,
  decode: Decode = NO_WORD_CODES,
  fuse: bool = True,
  max_positions: int | None = None,
) -> list[list[int]]:
  """New token ids per prompt (up to and including an EOS, if one is generated).

  Prefill and the whole decode loop each run as one compiled call (a while loop on the
  device), cached across calls for the same model structure and sampling settings.
  ``decode``: how the loop computes, as a run's plan decides (``Plan.decode``,
  run.choices.resolve_decode; the public ``jaxtune.generate`` resolves one): its NF4 products
  and whether it copies the NF4 kernel's codes into its faster lookup's order (True),
  permutes the model's own codes for the loop and back after it ("inplace",
  ``codes_in_word_order``: only for a caller that owns the model) or neither (False).
  ``fuse``: with those codes, q/k/v and gate/up each in one kernel launch (False: one per
  layer, to compare). ``max_positions``: refuse a prompt whose tokens and max_new_tokens
  need more positions (the command line passes the model's max_position_embeddings; None:
  no limit, as past it rope models run on, less well).
  """
  check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
  if top_k > model.config.vocab_size:
    raise UserError(
      f"--top-k must be at most the vocabulary's {model.config.vocab_size} tokens, got {top_k}."
    )
  if not prompts or any(len(p) == 0 for p in prompts):
    raise UserError("every prompt needs at least one token.")
  longest = max(len(p) for p in prompts)
  if max_positions is not None and longest + max_new_tokens > max_positions:
    raise UserError(
      f"a prompt of {longest} tokens and --max-new-tokens {max_new_tokens} need "
      f"{longest + max_new_tokens} positions, more than the model's {max_positions} "
      "(max_position_embeddings); shorten the prompt or lower --max-new-tokens."
    )
  b = len(prompts)
  p_len = _bucket(longest)
  room = _bucket(max_new_tokens)
  pad = np.array([p_len - len(p) for p in prompts])
  tokens = np.full((b, p_len), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, pad[i] :] = p
  length = p_len + room
  key_valid = jnp.asarray(np.arange(length)[None, :] >= pad[:, None])
  positions = jnp.asarray(np.maximum(np.arange(p_len)[None, :] - pad[:, None], 0))

  graphdef, state = nnx.split(model)
  cache = init_cache(model, b, length)
  logits, cache = _prefill(
    graphdef, state, jnp.asarray(tokens), positions, cache, key_valid, decode.nf4_matmul
  )
  eos = jnp.asarray(list(eos_token_ids), jnp.int32)
  with contextlib.ExitStack() as stack:
    word = loop_codes(model, b, stack, decode)
    if word == "inplace":
      graphdef, state = nnx.split(model)
    wide = decode.wide_rows is not None and b >= decode.wide_rows
    loop = _decode_wide if wide else _decode
    new, steps = jax.block_until_ready(  # the loop ends before in-place codes are put back
      loop(
        graphdef, state, logits, cache, key_valid, p_len, room, float(temperature),
        int(top_k), float(top_p), jnp.asarray(p_len - pad, jnp.int32), eos,
        jax.random.key(seed), jnp.int32(max_new_tokens), word, fuse and word is True,
        decode.nf4_matmul,
      )
    )  # fmt: skip
  new = np.asarray(new)[:, : int(steps)]
  out = []
  for row in new.tolist():
    stop = next((i for i, t in enumerate(row) if t in set(eos_token_ids)), None)
    out.append(row if stop is None else row[: stop + 1])
  return out


def _bucket(n: int) -> int:
  return -(-n // BUCKET) * BUCKET


def generate(
  model: Decoder,
  tokenizer: Any,
  prompts: str | Sequence[str],
  max_new_tokens: int = 128,
  chat: bool = False,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  decode: Decode = NO_WORD_CODES,
  max_positions: int | None = None,
) -> list[str]:
  """Completions of ``prompts`` (chat=True renders each as a user turn with the chat template).
  ``decode``, ``max_positions``: as ``generate_ids``'s."""
  if isinstance(prompts, str):
    prompts = [prompts]
  if chat:
    ids = [
      list(
        tokenizer.apply_chat_template(
          [{"role": "user", "content": p}],
          add_generation_prompt=True,
          tokenize=True,
          return_dict=True,
        )["input_ids"]
      )
      for p in prompts
    ]
  else:
    ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
  eos = tokenizer.eos_token_id
  eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
  new = generate_ids(
    model,
    ids,
    max_new_tokens,
    eos_ids,
    temperature,
    top_k,
    top_p,
    seed,
    pad_id=tokenizer.pad_token_id or 0,
    decode=decode,
    max_positions=max_positions,
  )
  return [tokenizer.decode(t, skip_special_tokens=True) for t in new]

"""Text generation with a preallocated KV cache: jitted prefill, then one jitted decode loop.

Prompts of a batch are left-padded to one length; padding slots are masked out of attention
and positions count real tokens only, so each row generates what it would alone. The command
line is jaxtune/generate.py.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample(logits, key, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
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


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, state, ids, positions, cache, key_valid):
  return nnx.merge(graphdef, state).forward_cached(ids, positions, cache, 0, key_valid)


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8, 9))
def _decode(
  graphdef,
  state,
  logits,
  cache,
  key_valid,
  first,
  n,
  temperature,
  top_k,
  top_p,
  positions,
  eos,
  key,
):
  """Up to ``n`` tokens [B, n] on the device; stops early once every row has emitted EOS."""
  model = nnx.merge(graphdef, state)
  b = logits.shape[0]

  def body(carry):
    i, logits, cache, key, tokens, done = carry
    key, sub = jax.random.split(key)
    nxt = sample(logits, sub, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = tokens.at[:, i].set(nxt)
    done = done | jnp.isin(nxt, eos)
    logits, cache = model.forward_cached(
      nxt[:, None], (positions + i)[:, None], cache, first + i, key_valid
    )
    return i + 1, logits, cache, key, tokens, done

  def cond(carry):
    i, *_, done = carry
    return (i < n) & ~jnp.all(done)

  init = (0, logits, cache, key, jnp.zeros((b, n), jnp.int32), jnp.zeros((b,), jnp.bool_))
  steps, *_, tokens, _ = jax.lax.while_loop(cond, body, init)
  return tokens, steps


def generate_ids(
  model,
  prompts: Sequence[Sequence[int]],
  max_new_tokens: int = 64,
  eos_token_ids: Sequence[int] = (),
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  pad_id: int = 0,
) -> list[list[int]]:
  """New token ids per prompt (up to and including an EOS, if one is generated).

  Prefill and the whole decode loop each run as one compiled call (a while loop on the
  device), cached across calls for the same model structure and sampling settings.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token.")
  b = len(prompts)
  p_len = max(len(p) for p in prompts)
  pad = np.array([p_len - len(p) for p in prompts])
  tokens = np.full((b, p_len), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, pad[i] :] = p
  length = p_len + max_new_tokens
  key_valid = jnp.asarray(np.arange(length)[None, :] >= pad[:, None])
  positions = jnp.asarray(np.maximum(np.arange(p_len)[None, :] - pad[:, None], 0))

  graphdef, state = nnx.split(model)
  logits, cache = _prefill(
    graphdef, state, jnp.asarray(tokens), positions, model.init_cache(b, length), key_valid
  )
  eos = jnp.asarray(list(eos_token_ids), jnp.int32)
  new, steps = _decode(
    graphdef,
    state,
    logits,
    cache,
    key_valid,
    p_len,
    max_new_tokens,
    float(temperature),
    int(top_k),
    float(top_p),
    jnp.asarray(p_len - pad, jnp.int32),
    eos,
    jax.random.key(seed),
  )
  new = np.asarray(new)[:, : int(steps)]
  out = []
  for row in new.tolist():
    stop = next((i for i, t in enumerate(row) if t in set(eos_token_ids)), None)
    out.append(row if stop is None else row[: stop + 1])
  return out


def generate(
  model,
  tokenizer,
  prompts: str | Sequence[str],
  max_new_tokens: int = 128,
  chat: bool = False,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
) -> list[str]:
  """Completions of ``prompts`` (chat=True renders each as a user turn with the chat template)."""
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
  )
  return [tokenizer.decode(t, skip_special_tokens=True) for t in new]

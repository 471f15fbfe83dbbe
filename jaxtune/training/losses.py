"""The training losses: token cross-entropy over a micro-batch, whole or in pieces.

Each returns (sum of token losses, number of loss tokens), so that the step can normalise over
every token of the accumulated batch (DESIGN.md, Numerics).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtune.data.rows import IGNORE
from jaxtune.parallel.runtime import DEFAULT, LARGE_VOCAB, Runtime


def loss_sums(
  graphdef: Any,
  lora: nnx.State,
  frozen: nnx.State,
  batch: dict[str, jax.Array],
  key: jax.Array | None,
  runtime: Runtime = DEFAULT,
) -> tuple[jax.Array, jax.Array]:
  """(sum of token losses, number of loss tokens) of one micro-batch.

  ``runtime.loss_chunk`` > 0: the float32 logits exist that many tokens per row at a time
  (``chunked_loss_sums``), trading one recomputation of the output layer for their memory.
  """
  return balanced_loss_sums(graphdef, lora, frozen, batch, key, runtime)[:2]


def balanced_loss_sums(
  graphdef: Any,
  lora: nnx.State,
  frozen: nnx.State,
  batch: dict[str, jax.Array],
  key: jax.Array | None,
  runtime: Runtime = DEFAULT,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """``loss_sums`` and the forward's load-balancing loss over its routers (a mixture of
  experts: Decoder.hidden_and_balance; None for other models)."""
  model = nnx.merge(graphdef, lora, frozen)
  labels = batch["labels"]
  chunk = runtime.loss_chunk
  h, balance = _hidden(model, batch, key, runtime)
  if chunk:
    vocab = _vocab(model)
    with jax.named_scope("loss"):
      # Not in float16: the pieces' gradients would be taken before the loss scale.
      if vocab is None and h.dtype != jnp.float16 and not _head_trains(model, lora):
        return (*fused_loss_sums(model.logits_from_hidden, h, labels, chunk), balance)
      return (*chunked_loss_sums(model.logits_from_hidden, h, labels, chunk, vocab), balance)
  logits = model.logits_from_hidden(h).astype(jnp.float32)
  with jax.named_scope("loss"):
    mask = labels != IGNORE
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
    return jnp.sum(ce * mask), jnp.sum(mask), balance


def token_log_probs(
  model: Any, batch: dict[str, jax.Array], key: jax.Array | None, runtime: Runtime = DEFAULT
) -> jax.Array:
  """log p(label) of every token [B, T] (float32; 0 where the label is IGNORE), whole or, with
  ``runtime.loss_chunk``, a piece of the sequence at a time as ``loss_sums`` computes them."""
  labels = batch["labels"]
  chunk = runtime.loss_chunk
  if chunk:
    h = _hidden(model, batch, key, runtime)[0]
    with jax.named_scope("loss"):
      return -chunked_token_losses(model.logits_from_hidden, h, labels, chunk, _vocab(model))
  logits = _logits(model, batch, key, runtime)
  with jax.named_scope("loss"):
    mask = labels != IGNORE
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
    return -jnp.where(mask, ce, 0.0)


def _hidden(model, batch, key, runtime):
  """(final-norm hidden states, the load-balancing loss or None)."""
  return model.hidden_and_balance(
    batch["input_ids"],
    batch.get("positions"),  # packed rows restart positions at each example
    batch["segment_ids"],
    dropout_key=key,
    runtime=runtime,
    inputs_embeds=batch.get("inputs_embeds"),  # --embeddings host: rows gathered there
  )


def _logits(model, batch, key, runtime):
  return model(
    batch["input_ids"],
    batch.get("positions"),
    batch["segment_ids"],
    dropout_key=key,
    runtime=runtime,
    inputs_embeds=batch.get("inputs_embeds"),
  )


def _head_trains(model, lora: nnx.State) -> bool:
  """Whether the output layer has parameters in ``lora`` (LoRA on lm_head, or a trained
  embedding table that a tied model's output layer reads)."""
  head = "lm_head" if model.lm_head is not None else "embed_tokens"
  return any(path[0] == head for path, _ in nnx.to_flat_state(lora))


def _vocab(model):
  """Chunked losses of vocabularies above LARGE_VOCAB also walk the vocabulary in pieces."""
  v = model.config.vocab_size
  return (model.logits_piece, v, VOCAB_PIECE) if v > LARGE_VOCAB else None


def _largest_divisor(n: int, most: int) -> int:
  return max(x for x in range(1, min(most, n) + 1) if n % x == 0)


# With --loss-chunk, vocabularies larger than LARGE_VOCAB (Gemma's 256k) are also cut into
# pieces of at most VOCAB_PIECE entries (the largest divisor of V not above it).
VOCAB_PIECE = 32768


def chunked_loss_sums(
  head: Callable[[jax.Array], jax.Array],
  h: jax.Array,
  labels: jax.Array,
  chunk: int,
  vocab: tuple[Callable[[jax.Array, jax.Array, int], jax.Array], int, int] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy sums over hidden states [B, T, D] without the full [B, T, V] float32 logits.

  The sequence is cut into pieces of ``chunk`` tokens per row (the largest divisor of T not
  above it); a scan computes each piece's logits, loss and count, and remat makes the backward
  recompute them piece by piece, so at most [B, chunk, V] logits are alive in either pass. The
  batch axis stays whole, so its data sharding is untouched.

  ``vocab`` = (logits_piece, V, piece): the vocabulary too is walked in pieces,
  ``logits_piece(h, start, size)`` giving the logits of entries start .. start + size - 1,
  with an online log-sum-exp, so at most [B, chunk, piece] logits exist.
  """
  pieces = _pieces(h, labels, chunk)

  @jax.checkpoint
  def piece(h_c, labels_c):
    ce, mask = _piece_ce(head, vocab, h_c, labels_c)
    return jnp.sum(ce * mask), jnp.sum(mask)

  def step(carry, xs):
    total, count = piece(*xs)
    return (carry[0] + total, carry[1] + count), None

  zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
  return jax.lax.scan(step, zero, pieces)[0]


def fused_loss_sums(
  head: Callable[[jax.Array], jax.Array], h: jax.Array, labels: jax.Array, chunk: int
) -> tuple[jax.Array, jax.Array]:
  """``chunked_loss_sums`` for an output layer ``head`` with no trained parameters, whose
  backward recomputes nothing: each piece's forward also takes the loss's gradient with
  respect to its hidden states (softmax minus the label's one-hot, back through ``head``),
  and the backward only scales those by the loss's cotangent. The same products as the whole
  logits' forward and backward; at most one piece's [B, c, V] logits and their gradient
  alive; [B, T, D] kept for the backward. Differentiable with respect to ``h`` only: ``head``
  must close over frozen values (``_head_trains`` says where it does not). Not for float16
  under loss scaling: the gradients are taken unscaled."""

  def piece(carry, xs):
    h_c, labels_c = xs
    mask = labels_c != IGNORE
    safe = jnp.where(mask, labels_c, 0)
    logits, back = jax.vjp(lambda x: head(x).astype(jnp.float32), h_c)  # [B, c, V]
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    # d ce / d logits = softmax - one-hot (the softmax from lse: one more pass over the
    # logits, not three), for the loss tokens only.
    g = jnp.exp(logits - lse[..., None]) - jax.nn.one_hot(safe, logits.shape[-1])
    (dh,) = back(g * mask[..., None])
    return (carry[0] + jnp.sum((lse - picked) * mask), carry[1] + jnp.sum(mask)), dh

  @jax.custom_vjp
  def sums(h, labels):  # not differentiated (evaluation): the plain pieces
    return chunked_loss_sums(head, h, labels, chunk)

  def forward(h, labels):
    zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    return jax.lax.scan(piece, zero, _pieces(h, labels, chunk))  # dh [T / c, B, c, D]

  def backward(dh, cotangents):
    d_total, _ = cotangents
    n, b, c, d = dh.shape
    grad = dh.swapaxes(0, 1).reshape(b, n * c, d).astype(jnp.float32) * d_total
    return (grad.astype(dh.dtype), None)

  sums.defvjp(forward, backward)
  return sums(h, labels)


def chunked_token_losses(
  head: Callable[[jax.Array], jax.Array],
  h: jax.Array,
  labels: jax.Array,
  chunk: int,
  vocab: tuple[Callable[[jax.Array, jax.Array, int], jax.Array], int, int] | None = None,
) -> jax.Array:
  """The per-token cross-entropy [B, T] (0 where the label is IGNORE) of ``chunked_loss_sums``,
  its logits alive a piece at a time in either pass."""
  b, t, _ = h.shape

  @jax.checkpoint
  def piece(h_c, labels_c):
    ce, mask = _piece_ce(head, vocab, h_c, labels_c)
    return jnp.where(mask, ce, 0.0)

  ce = jax.lax.map(lambda xs: piece(*xs), _pieces(h, labels, chunk))  # [T / c, B, c]
  return ce.swapaxes(0, 1).reshape(b, t)


def _pieces(h: jax.Array, labels: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
  """[B, T, D] and [B, T] -> [T / c, B, c, D] and [T / c, B, c], c the largest divisor of T
  not above ``chunk``."""
  b, t, d = h.shape
  c = _largest_divisor(t, chunk)
  return h.reshape(b, t // c, c, d).swapaxes(0, 1), labels.reshape(b, t // c, c).swapaxes(0, 1)


def _piece_ce(head, vocab, h_c, labels_c):
  """(cross-entropy [B, c], label mask [B, c]) of one piece of hidden states."""
  mask = labels_c != IGNORE
  safe = jnp.where(mask, labels_c, 0)
  if vocab is None:
    logits = head(h_c).astype(jnp.float32)  # [B, c, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, safe), mask
  return _vocab_pieces_ce(*vocab, h_c, safe), mask


def _vocab_pieces_ce(logits_piece, v: int, most: int, h, labels):
  """Per-token cross-entropy [B, c] from vocabulary pieces: running max, running sum of
  exponentials and the label's logit, each piece's logits recomputed in the backward."""
  p = _largest_divisor(v, most)
  piece_logits = jax.checkpoint(lambda h, start: logits_piece(h, start, p).astype(jnp.float32))

  def step(carry, start):
    m, s, picked = carry
    z = piece_logits(h, start)  # [B, c, p]
    m_new = jnp.maximum(m, z.max(axis=-1))
    s = s * jnp.exp(m - m_new) + jnp.exp(z - m_new[..., None]).sum(axis=-1)
    inside = (labels >= start) & (labels < start + p)
    at = jnp.take_along_axis(z, jnp.clip(labels - start, 0, p - 1)[..., None], axis=-1)[..., 0]
    return (m_new, s, picked + jnp.where(inside, at, 0.0)), None

  init = (jnp.full(labels.shape, -1e30), jnp.zeros(labels.shape), jnp.zeros(labels.shape))
  (m, s, picked), _ = jax.lax.scan(step, init, jnp.arange(0, v, p, dtype=jnp.int32))
  return m + jnp.log(s) - picked

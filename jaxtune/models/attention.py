"""Attention: causal, grouped-query, packed segments.

Which implementation runs is decided once, by ``run.resolve`` (its docstring lists them);
this module runs the one it is given:
  "xla":       plain einsums with the full [T, T] mask; handles packed segments. The reference.
  "cudnn":     jax.nn.dot_product_attention's cuDNN kernel (asked for by name: left to
               choose, JAX picks its XLA version, which materialises float32 scores); causal
               only, exact when each row holds one document followed by padding.
  "ring":      a ``context`` mesh axis: ring attention over the sequence's pieces (context.py).
  "mosaic", "interpret", "flash_xla": pallas_kernels.flash_attention (the Hopper kernel, the
               same kernel interpreted on CPU, or its jnp reference). Under a mesh it runs
               per (data, tensor) shard in a ``shard_map``: a custom call has no partitioning
               rule of its own; inside pipeline stages that are manual over every axis, on
               the stage's rows directly; inside stages manual over pipe only (a tensor
               axis, --shard-frozen), where a nested shard_map is rejected, through
               ``custom_partitioning``, which tells the partitioner the same split.
"""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.custom_partitioning import custom_partitioning

from jaxtune.parallel import ring_attention as context
from jaxtune.parallel.runtime import DEFAULT, FLASH, Runtime
from pallas_kernels.flash_attention import flash_attention


def make_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T] segment ids -> [B, 1, 1, T, T] boolean: causal and within one document.

  Segment id 0 marks padding, which attends only to itself so its row stays finite.
  """
  t = segment_ids.shape[-1]
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same)[:, None, None]


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  segment_ids: jax.Array,
  scale: float,
  window: int | jax.Array = 0,
  softcap: float | None = None,
  runtime: Runtime = DEFAULT,
  positions: jax.Array | None = None,
  sinks: jax.Array | None = None,
) -> jax.Array:
  """Causal self-attention within documents. q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H].

  N is a multiple of K (GQA/MQA). ``segment_ids`` [B, T] int: tokens attend only within their
  segment (0 = padding). ``window`` (int or traced scalar, 0 = none): keys fewer than that many
  positions back. ``softcap``: cap * tanh(scores / cap) (Gemma 2). "cudnn" reads neither
  segments, window nor softcap (``run.resolve`` uses it only where they do not matter).
  "ring" (a ``context`` mesh axis): tokens in zigzag order, masked by ``positions`` [B, T]
  (jaxtune.parallel.ring_attention). ``sinks`` [N]: a logit per head in the softmax's
  denominator (gpt-oss; "xla" only, as ``run.resolve`` chooses for such models).
  """
  with jax.named_scope("attention"):
    impl = runtime.attention
    if sinks is not None and impl != "xla":
      raise ValueError(f"attention sinks are applied by the xla attention only, not {impl!r}")
    if impl == "ring":
      if positions is None:  # the ring masks by them: natural-order ones would be wrong
        raise ValueError("ring attention needs the positions of the zigzag-ordered tokens")
      heads = runtime.spec("batch", "length", "heads", "head_dim")
      out = context.ring_attention(
        q, k, v, positions, segment_ids, scale=scale, window=window, softcap=softcap,
        mesh=runtime.mesh, specs=(heads, runtime.spec("batch", "length")),
        kernel=_FLASH_KERNEL.get(runtime.ring_blocks),
      )  # fmt: skip
      return kept(out)
    if impl in FLASH:
      return _flash_sharded(q, k, v, segment_ids, window, scale, softcap, runtime)
    if impl == "cudnn":  # remat "activations" keeps its primitive's outputs (decoder.py)
      return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, implementation="cudnn"
      )
    mask = window_mask(make_mask(segment_ids), window)
    return kept(masked_attention(q, k, v, mask, scale, softcap, sinks=sinks))


def kept(out: jax.Array) -> jax.Array:
  """The attention output, named for remat "activations" ("attention_out"): where the op does
  not keep it itself. The flash kernel's VJP names its own output, and cuDNN's primitive
  outputs are kept by the policy; naming those again would make a second value the layer scan
  saves a second time (8B: 1 GiB)."""
  return checkpoint_name(out, "attention_out")


# Runtime FLASH names -> the flash op's implementation.
_FLASH_KERNEL = {"mosaic": "mosaic", "interpret": "interpret", "flash_xla": "xla"}


def _flash_sharded(q, k, v, segment_ids, window, scale, softcap, runtime: Runtime):
  """The flash op, per (data, tensor) shard of a mesh with more than one device."""
  kernel = _FLASH_KERNEL[runtime.attention]

  def flash(q, k, v, segment_ids, window):
    out = flash_attention(
      q, k, v, segment_ids=segment_ids, causal=True, window=window, softcap=softcap,
      scale=scale, implementation=kernel,
    )  # fmt: skip
    return kept(out) if kernel == "xla" else out  # the jnp reference has no VJP to name it

  here = jax.sharding.get_abstract_mesh()
  if runtime.mesh is None or (not here.empty and here.are_all_axes_manual):
    return flash(q, k, v, segment_ids, window)  # one device, or a pipeline stage's own rows
  if not here.empty and here.manual_axes:  # a stage manual over pipe only: no nested shard_map
    op = _partitioned_flash(kernel, scale, softcap)
    # The partitioner's op runs the kernel outside its VJP, which names nothing.
    return kept(op(q, k, v, segment_ids, jnp.asarray(window, jnp.int32).reshape(1)))
  heads = runtime.spec("batch", "length", "heads", "head_dim")
  return jax.shard_map(
    flash,
    mesh=runtime.mesh,
    in_specs=(heads, heads, heads, runtime.spec("batch", "length"), runtime.spec()),
    out_specs=heads,
    check_vma=False,
  )(q, k, v, segment_ids, jnp.asarray(window, jnp.int32))


def window_mask(mask: jax.Array, window: jax.Array) -> jax.Array:
  """Restrict [B, 1, 1, T, T] to keys fewer than ``window`` tokens back (0: no limit)."""
  t, s = mask.shape[-2:]
  distance = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]
  return mask & ((window == 0) | (distance < window))


def masked_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  scale: float,
  softcap: float | None = None,
  heads_first: bool = False,
  sinks: jax.Array | None = None,
) -> jax.Array:
  """Attention under an explicit boolean ``mask`` [B, 1, 1, T, S] (the KV-cache path).

  k, v [B, S, K, H], or [B, K, S, H] with ``heads_first`` (the KV cache's layout: the two
  products then read the keys and values as they lie, with no transposed copy of them).
  ``sinks`` [N]: a logit per head in the softmax's denominator only (gpt-oss)."""
  b, t, n, h = q.shape
  kv = k.shape[1 if heads_first else 2]
  keys = "bksh" if heads_first else "bskh"
  q = q.reshape(b, t, kv, n // kv, h)  # [B, T, K, G, H]
  scores = jnp.einsum(f"btkgh,{keys}->bkgts", q, k).astype(jnp.float32) * scale
  if softcap is not None:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  if sinks is None:
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  else:
    sink = jnp.broadcast_to(
      sinks.astype(jnp.float32).reshape(1, kv, n // kv, 1, 1), (*scores.shape[:-1], 1)
    )
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], -1), axis=-1)[..., :-1]
    probs = probs.astype(v.dtype)
  out = jnp.einsum(f"bkgts,{keys}->btkgh", probs, v)
  return out.reshape(b, t, n, h)


def _whole(sharding, dims):
  """``sharding`` with ``dims`` unsplit where it names its mesh axes (a NamedSharding); other
  kinds (the GSPMDShardings of a partly manual region, which come with those dims whole) as
  given."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = [*sharding.spec, *[None] * (max(dims) + 1 - len(sharding.spec))]
  for d in dims:
    spec[d] = None
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


@functools.cache
def _partitioned_flash(kernel, scale, softcap):
  """The flash op (q, k, v, segment ids, window [1]) -> out, split by the partitioner itself:
  ``custom_partitioning`` takes the split the model's constraints give q (rows over data,
  heads over tensor; every token and head_dim whole) for q, k, v and out alike, and runs the
  op on each shard's part, as ``_flash_sharded``'s shard_map would. Differentiable by a
  custom VJP whose backward is split the same way; it recomputes its shard's forward
  (jax.vjp of the op): one more forward kernel than the op's own backward."""

  def forward(q, k, v, seg, win):
    return flash_attention(
      q, k, v, segment_ids=seg, causal=True, window=win[0], softcap=softcap, scale=scale,
      implementation=kernel,
    )  # fmt: skip

  def backward(q, k, v, seg, win, do):
    _, pull = jax.vjp(lambda q, k, v: forward(q, k, v, seg, win), q, k, v)
    return pull(do)

  def split(args):
    """The shardings the op runs with: q's for q, k, v (and out, its cotangent and the
    gradients) with tokens and head_dim whole (the partitioner gathers them first where they
    come split), the segment ids' with tokens whole, the window's; after checking that q
    splits rows and heads only and the segment ids split rows alike."""
    q, seg = args[0], args[3]
    h, r = _whole(q.sharding, (1, 3)), _whole(seg.sharding, (1,))
    qs, ss = h.shard_shape(q.shape), r.shard_shape(seg.shape)
    if qs[1] != q.shape[1] or qs[3] != q.shape[3] or ss != (qs[0], seg.shape[1]):
      raise ValueError(f"flash attention split as q {qs} of {q.shape}, segment ids {ss}")
    return h, r, args[4].sharding

  def forward_partition(mesh, args, result):
    h, r, w = split(args)
    return mesh, forward, h, (h, h, h, r, w)

  def backward_partition(mesh, args, result):
    h, r, w = split(args)
    return mesh, backward, (h, h, h), (h, h, h, r, w, h)

  fwd = custom_partitioning(forward)
  fwd.def_partition(
    partition=forward_partition,
    infer_sharding_from_operands=lambda mesh, args, result: split(args)[0],
    sharding_rule="b t n h, b t k h, b t k h, b t, w -> b t n h",
  )
  bwd = custom_partitioning(backward)
  bwd.def_partition(
    partition=backward_partition,
    infer_sharding_from_operands=lambda mesh, args, result: (split(args)[0],) * 3,
    sharding_rule="b t n h, b t k h, b t k h, b t, w, b t n h -> b t n h, b t k h, b t k h",
  )

  @jax.custom_vjp
  def op(q, k, v, seg, win):
    return fwd(q, k, v, seg, win)

  def op_fwd(q, k, v, seg, win):
    return fwd(q, k, v, seg, win), (q, k, v, seg, win)

  def op_bwd(res, do):
    return (*bwd(*res, do), None, None)

  op.defvjp(op_fwd, op_bwd)
  return op

"""Context parallelism: each sequence's tokens split over the mesh's ``context`` axis.

Layout (zigzag): a row of T tokens is cut into 2C chunks; device i of the C-device context
group holds chunks i and 2C-1-i, one early and one late, so that under the causal mask every
device has the same number of (query, key) pairs to compute. The reordering is done once, on
the host, to every [.., T] leaf of a batch (``zigzag_batch``); from then on the step sees
rows whose tokens are in zigzag order, split contiguously over ``context`` by the sharding
rule "length" -> "context". Everything token-local (embeddings, norms, projections, MLP,
loss) is indifferent to the order; attention masks by the tokens' positions and segment ids,
never by their index (``ring_attention``), which is what makes the reordering exact.

Ring attention: inside a ``shard_map`` every device holds its queries and one block of keys
and values; C times it attends its queries to the block it holds (online softmax: running
max, running sum, rescaled output) and passes the block, with its positions and segment
ids, to the next device with ``ppermute``. Of every block but its own, half is hidden from
all of the device's queries by the causal order of the zigzag chunks, and is skipped: each
device computes 4 + 2(C - 1) pairs of chunks, the same on every device. Its gradient is
JAX's: the transpose of each ``ppermute`` sends the keys' and values' cotangents back
around the ring.

Each pair of chunks is computed either by XLA in tiles (any mask: positions, segments,
sliding windows) or, for models without a sliding window, by the flash attention op
(``kernel``: the Pallas kernel on Hopper), which returns every query's log-sum-exp; blocks
are then merged by it. Own block: one causal call (a device's two chunks are in causal order);
every other block: two non-causal calls of one chunk each, the keys' segment ids the block's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.errors import MeshError
from pallas_kernels.flash_attention import flash_attention

AXIS = "context"
TILE = 512  # tokens of a query or key tile in ring attention's blocks


def _tile(length: int, tile: int) -> int:
  """The tile for ``length`` tokens: the largest divisor of ``length`` up to ``tile``."""
  return next(d for d in range(min(length, tile), 0, -1) if length % d == 0)


def zigzag_order(seq_len: int, size: int) -> np.ndarray:
  """The token indices of a row in zigzag order for a context group of ``size``: device i's
  tokens (chunks i and 2*size-1-i of 2*size) at [i*T/size, (i+1)*T/size)."""
  if seq_len % (2 * size):
    raise MeshError(
      f"rows of {seq_len} tokens do not cut into the {2 * size} zigzag chunks of context={size}; "
      f"set --seq-len to a multiple of {2 * size}."
    )
  chunks = np.arange(seq_len).reshape(2 * size, seq_len // (2 * size))
  return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(size)])


def zigzag_batch(host: dict, size: int, length_axis: int) -> dict:
  """A host batch with every leaf that has the length axis (at ``length_axis``: tokens of a
  row; ``inputs_embeds`` too) put in zigzag order; leaves without it (per-row values such as
  GRPO's advantages) unchanged. Positions and segment ids are made explicit first (a row
  without them is one document whose positions count from 0), since attention reads them."""
  if size == 1:
    return host
  ids = host["input_ids"]
  seq_len = ids.shape[length_axis]
  host = dict(host)
  if "positions" not in host:
    shape = [1] * ids.ndim
    shape[length_axis] = seq_len
    host["positions"] = np.broadcast_to(np.arange(seq_len).reshape(shape), ids.shape)
  if "segment_ids" not in host:
    host["segment_ids"] = np.ones(ids.shape, np.int32)
  order = zigzag_order(seq_len, size)
  return {
    k: np.take(v, order, axis=length_axis) if v.ndim > length_axis else v for k, v in host.items()
  }


def causal_pairs(order: np.ndarray, size: int) -> np.ndarray:
  """[size]: the (query, key) pairs the causal mask leaves to each device of the group when a
  row's tokens are laid out in ``order`` (device i: its T/size contiguous slots)."""
  local = order.reshape(size, -1)
  return np.array([int(np.sum(q[:, None] >= order[None, :])) for q in local])


def ring_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array,
  *,
  scale: float,
  window: int | jax.Array,
  softcap: float | None,
  mesh: jax.sharding.Mesh,
  specs: tuple,
  tile: int = TILE,
  kernel: str | None = None,
) -> jax.Array:
  """Causal attention within documents over a sequence split on ``context``.

  q [B, T, N, H], k/v [B, T, K, H], positions/segment_ids [B, T] (T in zigzag order);
  ``specs`` = (PartitionSpec of q/k/v/out, of positions/segment_ids) on ``mesh``. A key is
  seen where it has the query's segment id, a position no later, and (``window`` > 0) fewer
  than ``window`` positions back: the mask of jaxtune.models.attention, read from positions (for
  real tokens; padding, segment 0 at position 0, attends among itself differently, unread).
  ``tile``: the most query (and key) tokens whose scores exist at once (XLA's tiles).
  ``kernel``: each pair of chunks by the flash op with this implementation instead (no
  window: it masks by index, exact within a chunk pair only where no window reaches across)."""
  heads, tokens = specs
  size = mesh.shape[AXIS]
  ring = [(i, (i + 1) % size) for i in range(size)]
  if kernel is not None:
    if isinstance(window, int) and window:  # traced (the layer scan's): 0, by the runtime
      raise ValueError(f"ring attention by the flash op takes no window, got {window}")
    blocks = functools.partial(_flash_blocks, scale=scale, softcap=softcap, kernel=kernel)
    return jax.shard_map(
      functools.partial(blocks, ring=ring),
      mesh=mesh,
      in_specs=(heads, heads, heads, tokens),
      out_specs=heads,
      check_vma=False,
    )(q, k, v, segment_ids)

  def local(q, k, v, pos, seg, window):
    b, t, n, h = q.shape
    kv, c = k.shape[2], t // 2  # c: one zigzag chunk; the device holds chunks i and 2C-1-i
    q = q.reshape(b, t, kv, n // kv, h)  # [B, Tq, K, G, H]
    o = jnp.zeros((b, kv, n // kv, t, h), jnp.float32)
    m = jnp.full((b, kv, n // kv, t), -jnp.inf, jnp.float32)
    s = jnp.zeros((b, kv, n // kv, t), jnp.float32)

    def update(carry, qr, qpos, qseg, k, v, kpos, kseg):
      """The running (output, max, sum) of queries qr after one tile of keys."""
      o_r, m_r, s_r = carry
      scores = jnp.einsum("btkgh,bskh->bkgts", qr, k).astype(jnp.float32) * scale
      if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
      seen = (qseg[:, :, None] == kseg[:, None, :]) & (kpos[:, None, :] <= qpos[:, :, None])
      seen &= (window == 0) | (qpos[:, :, None] - kpos[:, None, :] < window)
      seen = seen[:, None, None]  # [B, 1, 1, Tq, Tk]
      scores = jnp.where(seen, scores, jnp.finfo(jnp.float32).min)
      m_new = jnp.maximum(m_r, scores.max(-1))
      p = jnp.where(seen, jnp.exp(scores - m_new[..., None]), 0.0)
      rescale = jnp.exp(m_r - m_new)
      s_r = s_r * rescale + p.sum(-1)
      o_r = o_r * rescale[..., None] + jnp.einsum("bkgts,bskh->bkgth", p.astype(v.dtype), v)
      return o_r, m_new, s_r

    def tiles(a, size, axis):
      """[..., n * size, ...] -> [n, ..., size, ...] along ``axis``."""
      a = a.reshape(*a.shape[:axis], a.shape[axis] // size, size, *a.shape[axis + 1 :])
      return jnp.moveaxis(a, axis, 0)

    def untile(a, axis):
      a = jnp.moveaxis(a, 0, axis)
      return a.reshape(*a.shape[:axis], -1, *a.shape[axis + 2 :])

    def attend(o, m, s, start, length, k, v, kpos, kseg):
      """The running (output, max, sum) of the local query tokens [start, start + length)
      (``start`` may be traced) after the keys k/v with positions/segments kpos/kseg, a tile
      of queries against a tile of keys at a time (each recomputed in the backward pass):
      the scores never exist for more than one pair of tiles."""
      rows = lambda a, axis: jax.lax.dynamic_slice_in_dim(a, start, length, axis)  # noqa: E731
      tq, tk = _tile(length, tile), _tile(k.shape[1], tile)
      keys = tuple(tiles(a, tk, 1) for a in (k, v, kpos, kseg))

      @jax.checkpoint  # the backward keeps each query tile's inputs, not its key steps
      def one_query_tile(_, xs):
        *carry, qr, qpos, qseg = xs

        @jax.checkpoint
        def one_key_tile(carry, key_tile):
          return update(carry, qr, qpos, qseg, *key_tile), None

        carry, _ = jax.lax.scan(one_key_tile, tuple(carry), keys)
        return None, carry

      xs = (*(tiles(rows(a, 3), tq, 3) for a in (o, m, s)), tiles(rows(q, 1), tq, 1))
      xs = (*xs, tiles(rows(pos, 1), tq, 1), tiles(rows(seg, 1), tq, 1))
      _, (o_r, m_r, s_r) = jax.lax.scan(one_query_tile, None, xs)
      put = lambda a, x: jax.lax.dynamic_update_slice_in_dim(a, untile(x, 3), start, 3)  # noqa: E731
      return put(o, o_r), put(m, m_r), put(s, s_r)

    # The device's own block: both chunks against both, under the causal mask.
    o, m, s = attend(o, m, s, 0, t, k, v, pos, seg)
    me = jax.lax.axis_index(AXIS)

    def step(carry, r):
      """Block r (1..C-1) from device i - r: its two visible chunk pairs (``_visible_pairs``),
      with the same shapes on every device."""
      o, m, s, block = carry
      block = tuple(jax.lax.ppermute(a, AXIS, ring) for a in block)
      for rows, keys in _visible_pairs(me, r, c):
        o, m, s = attend(o, m, s, rows, c, *(_chunk(a, keys, c) for a in block))
      return (o, m, s, block), None

    carry = (o, m, s, (k, v, pos, seg))
    (o, _, s, _), _ = jax.lax.scan(step, carry, jnp.arange(1, size))
    out = (o / s[..., None]).astype(v.dtype)  # every query sees at least itself: s > 0
    return jnp.moveaxis(out, 3, 1).reshape(b, t, n, h)

  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(heads, heads, heads, tokens, tokens, jax.sharding.PartitionSpec()),
    out_specs=heads,
    check_vma=False,
  )(q, k, v, positions, segment_ids, jnp.asarray(window, jnp.int32))


def _visible_pairs(me: jax.Array, r: jax.Array, c: int) -> tuple:
  """((query chunk start, key chunk start), ...) of the two chunk pairs of block r (1..C-1),
  which comes from device j = i - r (i = ``me``), that this device's queries can see. Of the
  block's chunks j and 2C-1-j, an earlier device's (j < i) first chunk precedes both of this
  device's and its second follows both; a later device's (j > i) chunks both fall between this
  device's two. So half of each block is never seen; the visible half is (this device's second
  chunk, the block's first) always, and (first, first) from an earlier device or (second,
  second) from a later one. Offsets are into the device's [first chunk, second chunk] of c."""
  at = jnp.where(me >= r, 0, c)  # j < i: the first chunks; j > i: the second ones
  return ((c, 0), (at, at))


def _chunk(a: jax.Array, start, c: int) -> jax.Array:
  """Tokens [start, start + c) of ``a`` [B, T, ...] (``start`` may be traced)."""
  return jax.lax.dynamic_slice_in_dim(a, start, c, 1)


def _flash_blocks(q, k, v, seg, *, scale, softcap, kernel, ring):
  """One device's part of ring attention with the flash op per chunk pair (its blocks merged
  by their log-sum-exp). q [B, 2c, N, H], k/v [B, 2c, K, H], seg [B, 2c]: chunks i and
  2C-1-i of the zigzag layout."""
  c = q.shape[1] // 2

  def flash(q, k, v, qseg, kseg, causal):
    """(out float32, lse [B, T, N]) of one block; ``kseg`` None: the queries' ids (the own
    block: one id array is the kernel's faster path). Out is rounded to q's dtype by the op
    before the float32 merge (the tiles round once, at the end)."""
    out, lse = flash_attention(
      q, k, v, segment_ids=qseg, kv_segment_ids=kseg, causal=causal, softcap=softcap,
      scale=scale, implementation=kernel, return_lse=True,
    )  # fmt: skip
    return out.astype(jnp.float32), jnp.swapaxes(lse, 1, 2)  # lse [B, T, N]

  def merge(o, lse, start, o_new, lse_new):
    """Rows [start, start + c) of (o, lse) merged with a block's (o_new, lse_new)."""
    rows = lambda a: jax.lax.dynamic_slice_in_dim(a, start, c, 1)  # noqa: E731
    o_r, lse_r = rows(o), rows(lse)
    total = jnp.logaddexp(lse_r, lse_new)  # finite: every query sees itself in its own block
    o_r = o_r * jnp.exp(lse_r - total)[..., None] + o_new * jnp.exp(lse_new - total)[..., None]
    put = jax.lax.dynamic_update_slice_in_dim
    return put(o, o_r, start, 1), put(lse, total, start, 1)

  o, lse = flash(q, k, v, seg, None, True)  # the own block: chunk i precedes chunk 2C-1-i
  me = jax.lax.axis_index(AXIS)

  def step(carry, r):
    """Block r from device i - r: its two visible chunk pairs (``_visible_pairs``), each one
    non-causal call (every key of the pair precedes every query)."""
    o, lse, block = carry
    block = tuple(jax.lax.ppermute(a, AXIS, ring) for a in block)
    for rows, keys in _visible_pairs(me, r, c):
      kb, vb, segb = (_chunk(a, keys, c) for a in block)
      qr, segr = _chunk(q, rows, c), _chunk(seg, rows, c)
      o_new, lse_new = flash(qr, kb, vb, segr, segb, False)
      o, lse = merge(o, lse, rows, o_new, lse_new)
    return (o, lse, block), None

  size = len(ring)
  (o, _, _), _ = jax.lax.scan(step, (o, lse, (k, v, seg)), jnp.arange(1, size))
  return o.astype(q.dtype)

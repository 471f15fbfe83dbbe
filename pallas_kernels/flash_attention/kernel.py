"""Flash attention on Hopper through Mosaic GPU (``plgpu.kernel``): the forward kernel and the
pieces the backward kernels (kernel_backward.py) share (the pipeline's own: kernel_pipeline.py).

Layouts: q/out/dq [B, T, N, H]; k/v/dk/dv [B, T, K, H] with N a multiple of K (GQA: the
kernels index the shared K/V head, nothing is repeated); lse/delta [B, N, T] float32;
segment ids [B, T] int32 with their per-64-row summary ``uniform`` [B, T / 64], the queries'
and the keys' (the same unless ring attention gives keys their own); window int32[1] read at
run time (0 = no window). T must be a multiple of ``Blocks.multiple`` (ops.py pads); keys at
or past ``seq_len`` are masked. Nothing [T, T] is ever formed.

Each CTA runs compute warpgroups (two; one in dQ at head_dim 256) and one warpgroup that only
issues TMA copies into a ring of ``num_stages`` shared-memory slots. Produced barriers say a
slot is full, consumed barriers (one arrival per compute warpgroup) say it may be refilled.
The compute warpgroups walk the same range of blocks, so the barrier counts always match;
each masks with its own rows. Each kernel walks its blocks in up to three loops: blocks cut
by the window's edge, blocks wholly visible (no mask), blocks cut by the diagonal or the
padded tail. Segment masks apply only where a block pair is not all one document.

Scores live in log2 units (s * scale * log2(e)), so the softmax is exp2 and FMA; the saved
log-sum-exp is log2-based too. Masked scores are a large finite negative, not -inf: a row
with no visible key in a block stays NaN-free and is wiped by the rescale once a visible
key arrives. A row with no visible key at all ends with its maximum still at MASKED: it is
written as 0 with lse +inf, so that the backward's P = exp2(s - lse) is 0 on it.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention.kernel_pipeline import (
  _compiler_params,
  _mma,
  _row_ids,
  _smem,
  _stream,
)
from pallas_kernels.flash_attention.options import (
  COMPUTE_WGS,
  MIXED,
  SEGMENT_BLOCK,
  Blocks,
  Options,
)

LOG2E = math.log2(math.e)
MASKED = -1e30


def _cdiv(a, b):
  return lax.div(a + (b - 1), jnp.int32(b))


def _clamp(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def _kv_blocks(o: Options, q0, q1, window, block):
  """Key blocks seen by query rows [q0, q1): (lo, a, b, hi).

  [lo, hi) is every block with a visible key; only [a, b) needs no mask.
  """
  n = _cdiv(jnp.int32(o.seq_len), block)
  hi = jnp.minimum(_cdiv(q1, block), n) if o.causal else n
  full_hi = lax.div(q0 + 1, jnp.int32(block)) if o.causal else hi
  if o.seq_len % block:
    full_hi = jnp.minimum(full_hi, o.seq_len // block)
  lo = jnp.int32(0)
  full_lo = jnp.int32(0)
  if o.windowed:
    on = window > 0
    lo = jnp.where(on, lax.div(jnp.maximum(q0 - window + 1, 0), jnp.int32(block)), 0)
    full_lo = jnp.where(on, _cdiv(jnp.maximum(q1 - window, 0), block), 0)
  a = _clamp(full_lo, lo, hi)
  b = _clamp(full_hi, a, hi)
  return lo, a, b, hi


def _q_blocks(o: Options, k0, k1, window, block):
  """Query blocks that see keys [k0, k1): (lo, a, b, hi), as in ``_kv_blocks``.

  Padded query rows (past seq_len) are skipped where a whole block is padding; in a partial
  block they carry zero dO, so they add nothing.
  """
  hi = _cdiv(jnp.int32(o.seq_len), block)
  lo = lax.div(k0, jnp.int32(block)) if o.causal else jnp.int32(0)
  full_lo = _cdiv(k1 - 1, block) if o.causal else lo
  full_hi = hi
  if o.windowed:
    on = window > 0
    hi = jnp.where(on, jnp.minimum(hi, _cdiv(k1 - 1 + window, block)), hi)
    full_hi = jnp.where(on, lax.div(k0 + window, jnp.int32(block)), hi)
  a = _clamp(full_lo, lo, hi)
  b = _clamp(full_hi, a, hi)
  return lo, a, b, hi


def _visible(o: Options, padded: bool, q_ids, k_ids, reach):
  """Boolean mask from broadcast query/key positions, or None when all are visible.

  ``reach``: the window as a scalar, a huge number when there is none.
  """
  ok = None
  conds = []
  if padded:
    conds.append(k_ids < o.seq_len)
  if o.causal or o.windowed:
    back = q_ids - k_ids
    if o.causal:
      conds.append(back >= 0)
    if o.windowed:
      conds.append(back < reach)
  for c in conds:
    ok = c if ok is None else ok & c
  return ok


def _mask_invisible(o: Options, s, padded: bool, q_ids, k_ids, reach):
  """Scores of keys a query may not see (padding, the future, beyond the window) -> MASKED."""
  ok = _visible(o, padded, q_ids, k_ids, reach)
  return s if ok is None else jnp.where(ok, s, MASKED)


def _uniform_id(uniform_ref, b, start, rows):
  """The segment id shared by rows [start, start + rows), or MIXED (``uniform`` of ops.py)."""
  first = lax.div(start, jnp.int32(SEGMENT_BLOCK))
  u = uniform_ref[b, first]
  for j in range(1, rows // SEGMENT_BLOCK):
    other = uniform_ref[b, first + j]
    u = jnp.where(other == u, u, jnp.int32(MIXED))
  return u


def _mask_segments(s, u_rows, u_cols, same_segment):
  """Mask s where ``same_segment()`` is False, unless rows and columns are one segment.

  Packed rows mostly pair blocks of a single document, and then skip the compares.
  """
  need = (u_rows == MIXED) | (u_rows != u_cols)
  return lax.cond(need, lambda s: jnp.where(same_segment(), s, MASKED), lambda s: s, s)


def _span(spans_ref, b, side: int, start, rows, combine):
  """``combine`` over the ``spans`` entries (side 0: first positions, 1: ends) of rows
  [start, start + rows), a multiple of SEGMENT_BLOCK."""
  first = lax.div(start, jnp.int32(SEGMENT_BLOCK))
  x = spans_ref[b, side, first]
  for j in range(1, rows // SEGMENT_BLOCK):
    x = combine(x, spans_ref[b, side, first + j])
  return x


def _narrow_kv(o: Options, spans_ref, b, q0, rows, block, ranges):
  """``_kv_blocks``' (lo, a, b, hi) for query rows [q0, q0 + rows) without the key blocks
  before the first position any of their segments holds: packed rows skip the documents
  before theirs instead of masking them."""
  lo, a, c, hi = ranges
  if not o.segmented or o.kv_segmented:
    return ranges
  first = lax.div(_span(spans_ref, b, 0, q0, rows, jnp.minimum), jnp.int32(block))
  lo = _clamp(first, lo, hi)
  a = jnp.maximum(a, lo)
  return lo, a, jnp.maximum(c, a), hi


def _narrow_q(o: Options, spans_ref, b, k0, rows, block, ranges):
  """``_q_blocks``' (lo, a, b, hi) for key rows [k0, k0 + rows) without the query blocks past
  the end of every segment they hold (the documents after theirs)."""
  lo, a, c, hi = ranges
  if not o.segmented or o.kv_segmented:
    return ranges
  end = _cdiv(_span(spans_ref, b, 1, k0, rows, jnp.maximum), block)
  hi = _clamp(end, lo, hi)
  c = jnp.minimum(c, hi)
  return lo, jnp.minimum(a, c), c, hi


def _log2_scores(o: Options, raw):
  """Raw q.k products -> (scores in log2 units, tanh of the softcap or None)."""
  if o.softcap is None:
    return raw * (o.scale * LOG2E), None
  t = jnp.tanh(raw * (o.scale / o.softcap))
  return t * (o.softcap * LOG2E), t


def _read_window(o: Options, window_ref):
  """-> (window, reach): the run-time window (0: none) and the same as a distance bound."""
  if not o.windowed:
    return jnp.int32(0), None
  window = window_ref[0]
  return window, jnp.where(window > 0, window, jnp.int32(2**30))


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def forward(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  q_segment_ids: jax.Array,
  q_uniform: jax.Array,
  kv_segment_ids: jax.Array,
  kv_uniform: jax.Array,
  spans: jax.Array,
  window: jax.Array,
  o: Options,
  blocks: Blocks,
  interpret: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """-> out [B, T, N, H] (q's dtype), lse [B, N, T] float32 (log2 units, +inf for a query that
  sees no key, whose out is 0)."""
  batch, t, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  bq, bk, stages = blocks.q, blocks.kv, blocks.num_stages
  dtype = q.dtype
  interpreted = interpret is not None
  padded = o.seq_len < t
  tile = COMPUTE_WGS * bq
  num_tiles = t // tile

  def body(*refs):
    (q_ref, k_ref, v_ref, q_seg_ref, q_uni_ref, kv_seg_ref, kv_uni_ref) = refs[:7]
    spans_ref, win_ref, out_ref, lse_ref, scratch = *refs[7:11], refs[11:]
    if not o.kv_segmented:  # the keys' ids are the queries' (see ``Options.kv_segmented``)
      kv_seg_ref, kv_uni_ref = q_seg_ref, q_uni_ref
    (qo_smem, k_smem, v_smem, lse_smem, qseg_smem, kseg_smem, stage_smem, barriers) = scratch
    q_bar, k_bar, v_bar, k_free, v_free, sched = barriers
    b = lax.axis_index("batch")
    head = lax.axis_index("heads")
    kv_head = lax.div(head, jnp.int32(group))
    tile_idx = num_tiles - 1 - lax.axis_index("q_tiles")  # the longest causal tiles first
    q0 = tile_idx * tile
    wg = lax.axis_index("wg")
    window, reach = _read_window(o, win_ref)
    lo, a, c, hi = _kv_blocks(o, q0, q0 + tile, window, bk)
    lo, a, c, hi = _narrow_kv(o, spans_ref, b, q0, tile, bk, (lo, a, c, hi))
    n = hi - lo

    def schedule():
      plgpu.barrier_arrive(sched)
      plgpu.barrier_wait(sched)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      stage = None if stage_smem is None else stage_smem.at[wg]
      q_smem = qo_smem.at[wg]
      base = q0 + wg * bq
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(base, bq), head], q_smem, q_bar.at[wg])
      if o.segmented:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[b, pl.ds(base, bq)], qseg_smem.at[wg], q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      if o.segmented:
        q_seg = plgpu.load(qseg_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        q_uni = _uniform_id(q_uni_ref, b, base, bq)

      m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.full((bq, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      @pl.when(n > 0)
      def _():
        plgpu.barrier_wait(k_bar.at[0])

      pl.when(wg == 1)(schedule)

      def step(i, carry, masked):
        acc, m_i, l_i = carry
        slot = lax.rem(i, jnp.int32(stages))

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          schedule()
          return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
        s, _ = _log2_scores(o, s)
        k0 = (lo + i) * bk
        if masked:
          q_ids, k_ids = _row_ids((bq, bk), base, 0), _row_ids((bq, bk), k0, 1)
          s = _mask_invisible(o, s, padded, q_ids, k_ids, reach)
        if o.segmented:

          def same_segment():
            k_seg = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            return lax.broadcast_in_dim(q_seg, (bq, bk), [0]) == lax.broadcast_in_dim(
              k_seg, (bq, bk), [1]
            )

          s = _mask_segments(s, q_uni, _uniform_id(kv_uni_ref, b, k0, bk), same_segment)
        plgpu.barrier_arrive(k_free.at[slot])

        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha + p.sum(axis=1)
        p16 = p.astype(dtype)
        acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
        plgpu.barrier_arrive(sched)  # softmax done: the other warpgroup may use the MMA units
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_wait(sched)

        def wait_next_k():  # while P @ V runs
          nxt = i + 1

          @pl.when(nxt < n)
          def _():
            plgpu.barrier_wait(k_bar.at[lax.rem(nxt, jnp.int32(stages))])

        (acc,) = _mma([(acc, p16, v_smem.at[slot])], stage, wait_next_k)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_i

      carry = (acc, m_i, l_i)
      carry = lax.fori_loop(0, a - lo, lambda i, c_: step(i, c_, True), carry)
      carry = lax.fori_loop(a - lo, c - lo, lambda i, c_: step(i, c_, False), carry)
      carry = lax.fori_loop(c - lo, n, lambda i, c_: step(i, c_, True), carry)
      acc, m_i, l_i = carry
      pl.when(wg == 0)(schedule)

      l_i = jnp.where(m_i <= MASKED, jnp.inf, l_i)  # saw no key: out 0, lse +inf
      acc /= lax.broadcast_in_dim(l_i, acc.shape, [0])
      q_smem[...] = acc.astype(dtype)
      lse_smem.at[wg][...] = m_i + jnp.log2(l_i)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, pl.ds(base, bq), head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, head, pl.ds(base, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def issue_k(i, slot):
        rows = pl.ds((lo + i) * bk, bk)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kv_head], k_smem.at[slot], k_bar.at[slot])
        if o.segmented:
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, rows], kseg_smem.at[slot], k_bar.at[slot])

      def issue_v(i, slot):
        rows = pl.ds((lo + i) * bk, bk)
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kv_head], v_smem.at[slot], v_bar.at[slot])

      _stream(n, stages, [(k_free, issue_k), (v_free, issue_v)])

  k_copies = 2 if o.segmented else 1
  scratch = (
    _smem((COMPUTE_WGS, bq, head_dim), dtype),
    _smem((stages, bk, head_dim), dtype),
    _smem((stages, bk, head_dim), dtype),
    plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32),
    plgpu.SMEM((COMPUTE_WGS, bq), jnp.int32),
    plgpu.SMEM((stages, bk), jnp.int32),
    plgpu.SMEM((COMPUTE_WGS, bq, bk), dtype) if interpreted else None,
    (
      plgpu.Barrier(num_arrivals=k_copies, num_barriers=COMPUTE_WGS),
      plgpu.Barrier(num_arrivals=k_copies, num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    ),
  )
  out_type = (
    jax.ShapeDtypeStruct(q.shape, dtype),
    jax.ShapeDtypeStruct((batch, num_heads, t), jnp.float32),
  )
  return plgpu.kernel(
    body,
    out_type=out_type,
    scratch_types=scratch,
    grid=(num_heads, num_tiles, batch),
    grid_names=("heads", "q_tiles", "batch"),
    num_threads=COMPUTE_WGS + 1,
    thread_name="wg",
    compiler_params=_compiler_params(),
    interpret=interpret,
  )(q, k, v, q_segment_ids, q_uniform, kv_segment_ids, kv_uniform, spans, window)

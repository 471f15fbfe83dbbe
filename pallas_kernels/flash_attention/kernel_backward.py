"""Flash attention backward on Hopper through Mosaic GPU: the dQ and the dK/dV kernels.

Both recompute the probabilities block by block from the forward's log-sum-exp (log2 units)
and take delta = rowsum(dO * O) from ops.py, less the lse's cotangent where the op returns
the lse (d lse_i / d s_ij = P_ij, so dS = P * (dP - delta + dlse)). Layouts, pipelining and
masking as in kernel.py.

Two variants measured slower on an H100 and were removed (experiments/RESULTS.md, flash
attention sweeps): dQ's product deferred to the next step as dK/dV's is (dQ 1.18 -> 1.59 ms
at seq 8192), and FlashAttention-3's dQ accumulated inside the dK/dV kernel, with no dQ kernel
(fwd+bwd 4.36 -> 5.88 ms).
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention.kernel import (
  COMPUTE_WGS,
  Blocks,
  Options,
  _kv_blocks,
  _log2_scores,
  _mask_invisible,
  _mask_segments,
  _narrow_kv,
  _narrow_q,
  _q_blocks,
  _read_window,
  _uniform_id,
)
from pallas_kernels.flash_attention.kernel_pipeline import (
  _compiler_params,
  _mma,
  _row_ids,
  _smem,
  _stream,
)

# ---------------------------------------------------------------------------------------------
# dQ (one CTA per query tile, streaming key blocks)
# ---------------------------------------------------------------------------------------------


def backward_dq(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  do: jax.Array,
  lse: jax.Array,
  delta: jax.Array,
  q_segment_ids: jax.Array,
  q_uniform: jax.Array,
  kv_segment_ids: jax.Array,
  kv_uniform: jax.Array,
  spans: jax.Array,
  window: jax.Array,
  o: Options,
  blocks: Blocks,
  interpret: Any = None,
) -> jax.Array:
  """-> dq [B, T, N, H] in q's dtype."""
  batch, t, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  bq, bk, stages, wgs = blocks.dq_q, blocks.dq_kv, blocks.num_stages, blocks.dq_wgs
  dtype = q.dtype
  interpreted = interpret is not None
  padded = o.seq_len < t
  tile = wgs * bq
  num_tiles = t // tile

  def body(*refs):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, q_uni_ref) = refs[:8]
    kv_seg_ref, kv_uni_ref, spans_ref, win_ref, dq_ref, scratch = *refs[8:13], refs[13:]
    if not o.kv_segmented:  # the keys' ids are the queries' (see ``Options.kv_segmented``)
      kv_seg_ref, kv_uni_ref = q_seg_ref, q_uni_ref
    (q_smem2, do_smem2, lse_smem, delta_smem, qseg_smem, k_smem, v_smem, kseg_smem) = scratch[:8]
    stage_smem, barriers = scratch[8:]
    q_bar, kv_bar, kv_free = barriers
    b = lax.axis_index("batch")
    head = lax.axis_index("heads")
    kv_head = lax.div(head, jnp.int32(group))
    q0 = (num_tiles - 1 - lax.axis_index("q_tiles")) * tile
    wg = lax.axis_index("wg")
    window, reach = _read_window(o, win_ref)
    lo, a, c, hi = _kv_blocks(o, q0, q0 + tile, window, bk)
    lo, a, c, hi = _narrow_kv(o, spans_ref, b, q0, tile, bk, (lo, a, c, hi))
    n = hi - lo

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      stage = None if stage_smem is None else stage_smem.at[wg]
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      base = q0 + wg * bq
      rows = pl.ds(base, bq)
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, head], q_smem, q_bar.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, head], do_smem, q_bar.at[wg])
      plgpu.copy_gmem_to_smem(lse_ref.at[b, head, rows], lse_smem.at[wg], q_bar.at[wg])
      plgpu.copy_gmem_to_smem(delta_ref.at[b, head, rows], delta_smem.at[wg], q_bar.at[wg])
      if o.segmented:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], qseg_smem.at[wg], q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      row = plgpu.Layout.WGMMA.reduce(1)
      lse = plgpu.load(lse_smem.at[wg], layout=row)
      delta = plgpu.load(delta_smem.at[wg], layout=row)
      if o.segmented:
        q_seg = plgpu.load(qseg_smem.at[wg], layout=row)
        q_uni = _uniform_id(q_uni_ref, b, base, bq)
      by_row = lambda x: lax.broadcast_in_dim(x, (bq, bk), [0])
      dq = plgpu.layout_cast(jnp.full((bq, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      def step(i, dq, masked):
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(kv_bar.at[slot])
        s_dp = [
          ((bq, bk), q_smem, k_smem.at[slot].transpose((1, 0))),
          ((bq, bk), do_smem, v_smem.at[slot].transpose((1, 0))),
        ]
        s, dp = _mma(s_dp, stage)
        s, t_cap = _log2_scores(o, s)
        k0 = (lo + i) * bk
        if masked:
          q_ids, k_ids = _row_ids((bq, bk), base, 0), _row_ids((bq, bk), k0, 1)
          s = _mask_invisible(o, s, padded, q_ids, k_ids, reach)
        if o.segmented:

          def same_segment():
            k_seg = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            return by_row(q_seg) == lax.broadcast_in_dim(k_seg, (bq, bk), [1])

          s = _mask_segments(s, q_uni, _uniform_id(kv_uni_ref, b, k0, bk), same_segment)
        p = jnp.exp2(s - by_row(lse))
        ds = p * (dp - by_row(delta))
        if t_cap is not None:
          ds = ds * (1.0 - t_cap * t_cap)

        (dq,) = _mma([(dq, ds.astype(dtype), k_smem.at[slot])], stage)
        plgpu.barrier_arrive(kv_free.at[slot])
        return dq

      dq = lax.fori_loop(0, a - lo, lambda i, x: step(i, x, True), dq)
      dq = lax.fori_loop(a - lo, c - lo, lambda i, x: step(i, x, False), dq)
      dq = lax.fori_loop(c - lo, n, lambda i, x: step(i, x, True), dq)
      q_smem[...] = (dq * o.scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, head])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == wgs)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def issue(i, slot):
        rows = pl.ds((lo + i) * bk, bk)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kv_head], k_smem.at[slot], kv_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kv_head], v_smem.at[slot], kv_bar.at[slot])
        if o.segmented:
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, rows], kseg_smem.at[slot], kv_bar.at[slot])

      _stream(n, stages, [(kv_free, issue)])

  seg = 1 if o.segmented else 0
  scratch = (
    _smem((wgs, bq, head_dim), dtype),
    _smem((wgs, bq, head_dim), dtype),
    plgpu.SMEM((wgs, bq), jnp.float32),
    plgpu.SMEM((wgs, bq), jnp.float32),
    plgpu.SMEM((wgs, bq), jnp.int32),
    _smem((stages, bk, head_dim), dtype),
    _smem((stages, bk, head_dim), dtype),
    plgpu.SMEM((stages, bk), jnp.int32),
    plgpu.SMEM((wgs, bq, bk), dtype) if interpreted else None,
    (
      plgpu.Barrier(num_arrivals=4 + seg, num_barriers=wgs),
      plgpu.Barrier(num_arrivals=2 + seg, num_barriers=stages),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
    ),
  )
  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct(q.shape, dtype),
    scratch_types=scratch,
    grid=(num_heads, num_tiles, batch),
    grid_names=("heads", "q_tiles", "batch"),
    num_threads=wgs + 1,
    thread_name="wg",
    compiler_params=_compiler_params(),
    interpret=interpret,
  )(q, k, v, do, lse, delta, q_segment_ids, q_uniform, kv_segment_ids, kv_uniform, spans, window)


# ---------------------------------------------------------------------------------------------
# dK, dV (one CTA per key tile and K/V head, streaming the query blocks of every
# query head in the group, so GQA needs no per-query-head dK/dV)
# ---------------------------------------------------------------------------------------------


def backward_dkv(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  do: jax.Array,
  lse: jax.Array,
  delta: jax.Array,
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
  """-> dk, dv [B, T, K, H] in k's dtype.

  Head dim <= 128: each compute warpgroup owns its own ``dkv_kv`` keys and accumulates both
  dK and dV. Larger: two f32 accumulators do not fit the registers, so both warpgroups take
  the same keys, one accumulating dV (2 matmuls a step), the other dK (3 matmuls).
  """
  batch, t, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  bk, bq = blocks.dkv_kv, blocks.dkv_q
  dtype = q.dtype
  interpreted = interpret is not None
  padded = o.seq_len < t
  split = head_dim > 128
  defer = blocks.defer_dk
  stages = blocks.dkv_stages if defer else blocks.num_stages
  kv_bufs = 1 if split else COMPUTE_WGS
  tile = bk if split else COMPUTE_WGS * bk
  num_tiles = t // tile

  def body(*refs):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, q_uni_ref) = refs[:8]
    kv_seg_ref, kv_uni_ref, spans_ref, win_ref, dk_ref, dv_ref = refs[8:14]
    scratch = refs[14:]
    if not o.kv_segmented:  # the keys' ids are the queries' (see ``Options.kv_segmented``)
      kv_seg_ref, kv_uni_ref = q_seg_ref, q_uni_ref
    (k_smem2, v_smem2, kseg_smem, q_smem, do_smem, lse_smem, delta_smem, qseg_smem) = scratch[:8]
    stage_smem, barriers = scratch[8:]
    kv_bar, q_bar, q_free, done = barriers
    b = lax.axis_index("batch")
    kv_head = lax.axis_index("heads")
    k_tile0 = lax.axis_index("kv_tiles") * tile  # causal: the first keys have the most work
    wg = lax.axis_index("wg")
    window, reach = _read_window(o, win_ref)
    lo, a, c, hi = _q_blocks(o, k_tile0, k_tile0 + tile, window, bq)
    lo, a, c, hi = _narrow_q(o, spans_ref, b, k_tile0, tile, bq, (lo, a, c, hi))
    per_head = hi - lo
    n = group * per_head

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      stage = None if stage_smem is None else stage_smem.at[wg]
      buf = 0 if split else wg
      # Split: one unindexed K/V tile (a constant index would be closed over by the
      # accumulator scopes, which Mosaic GPU cannot lower).
      k_smem, v_smem = (k_smem2, v_smem2) if split else (k_smem2.at[buf], v_smem2.at[buf])
      base = k_tile0 + (0 if split else wg * bk)
      rows = pl.ds(base, bk)

      def load_kv():
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kv_head], k_smem, kv_bar.at[buf])
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kv_head], v_smem, kv_bar.at[buf])
        if o.segmented:
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, rows], kseg_smem.at[buf], kv_bar.at[buf])

      if split:
        pl.when(wg == 0)(load_kv)
      else:
        load_kv()
      plgpu.barrier_wait(kv_bar.at[buf])
      if o.segmented:
        k_seg = plgpu.load(kseg_smem.at[buf], layout=plgpu.Layout.WGMMA.reduce(1))
        k_uni = _uniform_id(kv_uni_ref, b, base, bk)
      zeros = plgpu.layout_cast(jnp.full((bk, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      def step(i, carry, masked, want_dk, want_dv):
        """carry: (dk, dv), (dk,) or (dv,) as wanted; deferring, dk's are followed by the
        last step's dS and Q slot, whose product is added here (see ``Blocks.defer_dk``)."""
        slot = lax.rem(i, jnp.int32(stages))
        qb = lo + lax.rem(i, jnp.maximum(per_head, 1))
        plgpu.barrier_wait(q_bar.at[slot])
        q_s, do_s = q_smem.at[slot], do_smem.at[slot]
        col = plgpu.Layout.WGMMA.reduce(0)
        s_mma = ((bk, bq), k_smem, q_s.transpose((1, 0)))  # S^T: [keys, queries]
        if want_dk and defer:
          dk, *carry, ds_last, last = carry
          dk, s = _mma([(dk, ds_last, q_smem.at[last]), s_mma], stage)
          carry = (dk, *carry)

          @pl.when(i > 0)  # at step 0 the "last" product was of zeros on this very slot
          def _release_last():
            plgpu.barrier_arrive(q_free.at[last])

        else:
          (s,) = _mma([s_mma], stage)
        s, t_cap = _log2_scores(o, s)
        if masked:
          q_ids, k_ids = _row_ids((bk, bq), qb * bq, 1), _row_ids((bk, bq), base, 0)
          s = _mask_invisible(o, s, padded, q_ids, k_ids, reach)
        if o.segmented:

          def same_segment():
            q_seg = plgpu.load(qseg_smem.at[slot], layout=col)
            return lax.broadcast_in_dim(k_seg, (bk, bq), [0]) == lax.broadcast_in_dim(
              q_seg, (bk, bq), [1]
            )

          s = _mask_segments(s, k_uni, _uniform_id(q_uni_ref, b, qb * bq, bq), same_segment)
        lse = lax.broadcast_in_dim(plgpu.load(lse_smem.at[slot], layout=col), (bk, bq), [1])
        p = jnp.exp2(s - lse)
        out = []
        if want_dk:
          dp_mma = ((bk, bq), v_smem, do_s.transpose((1, 0)))
          if want_dv:
            dv, dp = _mma([(carry[1], p.astype(dtype), do_s), dp_mma], stage)
          else:
            (dp,) = _mma([dp_mma], stage)
          delta = plgpu.load(delta_smem.at[slot], layout=col)
          ds = p * (dp - lax.broadcast_in_dim(delta, (bk, bq), [1]))
          if t_cap is not None:
            ds = ds * (1.0 - t_cap * t_cap)

          ds16 = ds.astype(dtype)
          if defer:
            out.append(carry[0])
          else:
            out += _mma([(carry[0], ds16, q_s)], stage)
          if want_dv:
            out.append(dv)
          if defer:
            return (*out, ds16, slot)  # the slot stays held until the product is issued
        else:
          out += _mma([(carry[0], p.astype(dtype), do_s)], stage)
        plgpu.barrier_arrive(q_free.at[slot])
        return tuple(out)

      def run(want_dk, want_dv):
        def head_loop(g, carry):
          s0 = g * per_head
          for start, stop, masked in ((lo, a, True), (a, c, False), (c, hi, True)):
            carry = lax.fori_loop(
              s0 + start - lo,
              s0 + stop - lo,
              lambda i, x, m=masked: step(i, x, m, want_dk, want_dv),
              carry,
            )
          return carry

        init = (zeros,) * (want_dk + want_dv)
        if not (want_dk and defer):
          return lax.fori_loop(0, group, head_loop, init)
        no_ds = plgpu.layout_cast(jnp.zeros((bk, bq), dtype), plgpu.Layout.WGMMA)
        dk, *rest, ds_last, last = lax.fori_loop(0, group, head_loop, (*init, no_ds, jnp.int32(0)))
        # The last step's dK product. n >= 1: every key tile holds a real key (the padding is
        # shorter than a tile), which at least its own query block sees.
        (dk,) = _mma([(dk, ds_last, q_smem.at[last])], stage)
        plgpu.barrier_arrive(q_free.at[last])
        return (dk, *rest)

      def store(acc, smem, out_ref, scale):
        smem[...] = (acc * scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, out_ref.at[b, rows, kv_head])
        plgpu.wait_smem_to_gmem(0)

      if split:

        @pl.when(wg == 0)
        def _dv():
          (dv,) = run(False, True)
          plgpu.barrier_arrive(done)
          plgpu.barrier_wait(done)  # the other warpgroup has stopped reading K and V
          store(dv, v_smem, dv_ref, 1.0)

        @pl.when(wg == 1)
        def _dk():
          (dk,) = run(True, False)
          plgpu.barrier_arrive(done)
          plgpu.barrier_wait(done)
          store(dk, k_smem, dk_ref, o.scale)

      else:
        dk, dv = run(True, True)
        store(dk, k_smem, dk_ref, o.scale)
        store(dv, v_smem, dv_ref, 1.0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def issue(i, slot):
        g = lax.div(i, jnp.maximum(per_head, 1))
        qb = lo + lax.rem(i, jnp.maximum(per_head, 1))
        head = kv_head * group + g
        rows = pl.ds(qb * bq, bq)
        bar = q_bar.at[slot]
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, head], q_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, head], do_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(lse_ref.at[b, head, rows], lse_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(delta_ref.at[b, head, rows], delta_smem.at[slot], bar)
        if o.segmented:
          plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], qseg_smem.at[slot], bar)

      _stream(n, stages, [(q_free, issue)])

  seg = 1 if o.segmented else 0
  scratch = (
    _smem((bk, head_dim) if split else (kv_bufs, bk, head_dim), dtype),
    _smem((bk, head_dim) if split else (kv_bufs, bk, head_dim), dtype),
    plgpu.SMEM((kv_bufs, bk), jnp.int32),
    _smem((stages, bq, head_dim), dtype),
    _smem((stages, bq, head_dim), dtype),
    plgpu.SMEM((stages, bq), jnp.float32),
    plgpu.SMEM((stages, bq), jnp.float32),
    plgpu.SMEM((stages, bq), jnp.int32),
    plgpu.SMEM((COMPUTE_WGS, bk, bq), dtype) if interpreted else None,
    (
      plgpu.Barrier(num_arrivals=2 + seg, num_barriers=kv_bufs),
      plgpu.Barrier(num_arrivals=4 + seg, num_barriers=stages),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    ),
  )
  out = jax.ShapeDtypeStruct(k.shape, dtype)
  return plgpu.kernel(
    body,
    out_type=(out, out),
    scratch_types=scratch,
    grid=(num_kv_heads, num_tiles, batch),
    grid_names=("heads", "kv_tiles", "batch"),
    num_threads=COMPUTE_WGS + 1,
    thread_name="wg",
    compiler_params=_compiler_params(),
    interpret=interpret,
  )(q, k, v, do, lse, delta, q_segment_ids, q_uniform, kv_segment_ids, kv_uniform, spans, window)

"""Flash attention on Hopper through Mosaic GPU (``plgpu.kernel``): forward, dK/dV and dQ.

Layouts: q/out/dq [B, T, N, H]; k/v/dk/dv [B, T, K, H] with N a multiple of K (GQA: the
kernels index the shared K/V head, nothing is repeated); lse/delta [B, N, T] float32;
segment ids [B, T] int32; window int32[1] read at run time (0 = no window).
T must be a multiple of the tile sizes (ops.py pads); keys at or past ``seq_len`` are masked.

Each CTA runs three warpgroups: two compute warpgroups and one that only issues TMA copies
into a ring of ``num_stages`` shared-memory slots. Produced barriers say a slot is full,
consumed barriers (one arrival per compute warpgroup) say it may be refilled. Both compute
warpgroups walk the same range of blocks, so the barrier counts always match; each masks
with its own rows.

Scores live in log2 units (s * scale * log2(e)), so the softmax is exp2 and FMA; the saved
log-sum-exp is log2-based too. Masked scores are a large finite negative, not -inf: a row
with no visible key in a block stays NaN-free and is wiped by the rescale once a visible
key arrives.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
MASKED = -1e30
SEGMENT_BLOCK = 64  # rows summarised by one entry of the ``uniform`` segment array
MIXED = -(2**31)  # its value for a block holding several segment ids
_COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class Options:
  """What the kernels compute. Static: each combination compiles its own kernel."""

  seq_len: int  # valid tokens; the arrays may be padded past it
  scale: float
  causal: bool = True
  softcap: float | None = None
  windowed: bool = False  # read the window (a run-time value) and mask with it
  segmented: bool = False


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes (rows per compute warpgroup). ``for_head_dim`` picks ones that fit."""

  q: int = 64  # forward: query rows per warpgroup
  kv: int = 128  # forward: keys per pipeline step
  dq_q: int = 64  # dQ: query rows per warpgroup
  dq_kv: int = 64  # dQ: keys per step
  dkv_kv: int = 64  # dK/dV: keys per warpgroup
  dkv_q: int = 64  # dK/dV: queries per step
  dq_wgs: int = 2  # dQ: compute warpgroups (query tiles of dq_wgs * dq_q rows)
  num_stages: int = 2

  @classmethod
  def for_head_dim(cls, head_dim: int) -> "Blocks":
    if head_dim <= 128:
      return cls()
    # 256: the f32 accumulators take half the registers, and K/V tiles the shared memory:
    # 64-key steps (the least a bf16 wgmma contracts over), one dQ warpgroup (its Q and dO
    # tiles and a two-stage K/V ring fill 192 KiB).
    return cls(kv=64, dq_wgs=1)

  @property
  def multiple(self) -> int:
    """T must be a multiple of this."""
    sizes = (
      _COMPUTE_WGS * self.q,
      self.kv,
      self.dq_wgs * self.dq_q,
      self.dq_kv,
      _COMPUTE_WGS * self.dkv_kv,
      self.dkv_q,
    )
    return math.lcm(*sizes)


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


def _log2_scores(o: Options, raw):
  """Raw q.k products -> (scores in log2 units, tanh of the softcap or None)."""
  if o.softcap is None:
    return raw * (o.scale * LOG2E), None
  t = jnp.tanh(raw * (o.scale / o.softcap))
  return t * (o.softcap * LOG2E), t


def _row_ids(shape, base, dim):
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA) + base


def _stream(n, num_stages, groups):
  """Memory warpgroup: fill slots for steps 0..n-1. ``groups``: [(consumed, issue(step, slot))].

  Each group waits for its own consumed barrier before refilling, so K can be refilled while V
  is still being read.
  """
  for i in range(num_stages):

    @pl.when(i < n)
    def _prologue(i=i):
      for _, issue in groups:
        issue(jnp.int32(i), i)

  @pl.loop(0, jnp.maximum(n - num_stages, 0))
  def _steady(i):
    slot = lax.rem(i, jnp.int32(num_stages))
    for consumed, issue in groups:
      plgpu.barrier_wait(consumed.at[slot])
      issue(i + num_stages, slot)

  # Observe the last releases too: the interpreter checks that every completed phase of a
  # barrier was seen by each thread that waits on it.
  @pl.loop(jnp.maximum(n - num_stages, 0), n)
  def _drain(i):
    for consumed, _ in groups:
      plgpu.barrier_wait(consumed.at[lax.rem(i, jnp.int32(num_stages))])


def _mma(pairs, stage, during=None):
  """[(acc or None, a, b)] -> [acc + a @ b] on the tensor cores, f32 accumulators in registers.

  Several products in one call share one wait on the tensor cores. An acc given as a shape
  (m, n) starts from zeros. ``during()`` runs while the products are in flight.

  ``stage`` is None on the GPU. Mosaic GPU's interpreter runs accumulators allocated by
  ``pl.run_scoped`` but neither ``pl.run_state`` nor a left operand held in registers, so an
  interpreted kernel passes a shared-memory ref to stage that operand in, and adds in registers.
  """
  inits = [
    plgpu.layout_cast(jnp.zeros(acc, jnp.float32), plgpu.Layout.WGMMA)
    if isinstance(acc, tuple)
    else acc
    for acc, _, _ in pairs
  ]
  if stage is not None:

    def scoped(*refs):
      for ref, (_, a, b) in zip(refs, pairs, strict=True):
        if isinstance(a, jax.Array):
          stage[...] = a
          a = stage
        plgpu.wgmma(ref, a, b)
      if during is not None:
        during()
      return [ref[...] for ref in refs]

    products = pl.run_scoped(scoped, *[plgpu.ACC(x.shape, jnp.float32) for x in inits])
    return [
      p if isinstance(acc, tuple) else x + p
      for (acc, _, _), x, p in zip(pairs, inits, products, strict=True)
    ]

  def body(refs):
    for ref, (_, a, b) in zip(refs, pairs, strict=True):
      plgpu.wgmma(ref, a, b)
    if during is not None:
      during()

  return list(pl.run_state(body)(tuple(plgpu.ACC.init(x) for x in inits)))


def _smem(shape, dtype):
  return plgpu.SMEM(
    shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  )


def _compiler_params():
  return plgpu.CompilerParams(approx_math=True)


def _read_window(o: Options, window_ref):
  """-> (window, reach): the run-time window (0: none) and the same as a distance bound."""
  if not o.windowed:
    return jnp.int32(0), None
  window = window_ref[0]
  return window, jnp.where(window > 0, window, jnp.int32(2**30))


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def forward(q, k, v, segment_ids, uniform, window, o: Options, blocks: Blocks, interpret=None):
  """-> out [B, T, N, H] (q's dtype), lse [B, N, T] float32 (log2 units)."""
  batch, t, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  bq, bk, stages = blocks.q, blocks.kv, blocks.num_stages
  dtype = q.dtype
  interpreted = interpret is not None
  padded = o.seq_len < t
  tile = _COMPUTE_WGS * bq
  num_tiles = t // tile

  def body(q_ref, k_ref, v_ref, seg_ref, uni_ref, win_ref, out_ref, lse_ref, scratch):
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
    n = hi - lo

    def schedule():
      plgpu.barrier_arrive(sched)
      plgpu.barrier_wait(sched)

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      stage = None if stage_smem is None else stage_smem.at[wg]
      q_smem = qo_smem.at[wg]
      base = q0 + wg * bq
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(base, bq), head], q_smem, q_bar.at[wg])
      if o.segmented:
        plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(base, bq)], qseg_smem.at[wg], q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      if o.segmented:
        q_seg = plgpu.load(qseg_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        q_uni = _uniform_id(uni_ref, b, base, bq)

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
          ok = _visible(o, padded, _row_ids((bq, bk), base, 0), _row_ids((bq, bk), k0, 1), reach)
          if ok is not None:
            s = jnp.where(ok, s, MASKED)
        if o.segmented:

          def same_segment():
            k_seg = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            return lax.broadcast_in_dim(q_seg, (bq, bk), [0]) == lax.broadcast_in_dim(
              k_seg, (bq, bk), [1]
            )

          s = _mask_segments(s, q_uni, _uniform_id(uni_ref, b, k0, bk), same_segment)
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

      acc /= lax.broadcast_in_dim(l_i, acc.shape, [0])
      q_smem[...] = acc.astype(dtype)
      lse_smem.at[wg][...] = m_i + jnp.log2(l_i)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, pl.ds(base, bq), head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, head, pl.ds(base, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def issue_k(i, slot):
        rows = pl.ds((lo + i) * bk, bk)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kv_head], k_smem.at[slot], k_bar.at[slot])
        if o.segmented:
          plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], kseg_smem.at[slot], k_bar.at[slot])

      def issue_v(i, slot):
        rows = pl.ds((lo + i) * bk, bk)
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kv_head], v_smem.at[slot], v_bar.at[slot])

      _stream(n, stages, [(k_free, issue_k), (v_free, issue_v)])

  k_copies = 2 if o.segmented else 1
  scratch = (
    _smem((_COMPUTE_WGS, bq, head_dim), dtype),
    _smem((stages, bk, head_dim), dtype),
    _smem((stages, bk, head_dim), dtype),
    plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32),
    plgpu.SMEM((_COMPUTE_WGS, bq), jnp.int32),
    plgpu.SMEM((stages, bk), jnp.int32),
    plgpu.SMEM((_COMPUTE_WGS, bq, bk), dtype) if interpreted else None,
    (
      plgpu.Barrier(num_arrivals=k_copies, num_barriers=_COMPUTE_WGS),
      plgpu.Barrier(num_arrivals=k_copies, num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
    ),
  )
  out_type = (
    jax.ShapeDtypeStruct(q.shape, dtype),
    jax.ShapeDtypeStruct((batch, num_heads, t), jnp.float32),
  )
  return plgpu.kernel(
    lambda *refs: body(*refs[:8], refs[8:]),
    out_type=out_type,
    scratch_types=scratch,
    grid=(num_heads, num_tiles, batch),
    grid_names=("heads", "q_tiles", "batch"),
    num_threads=_COMPUTE_WGS + 1,
    thread_name="wg",
    compiler_params=_compiler_params(),
    interpret=interpret,
  )(q, k, v, segment_ids, uniform, window)


# ---------------------------------------------------------------------------------------------
# Backward: dQ (one CTA per query tile, streaming key blocks)
# ---------------------------------------------------------------------------------------------


def backward_dq(
  q, k, v, do, lse, delta, segment_ids, uniform, window, o: Options, blocks: Blocks, interpret=None
):
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

  def body(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, uni_ref, win_ref, dq_ref, scratch
  ):
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
        plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], qseg_smem.at[wg], q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      row = plgpu.Layout.WGMMA.reduce(1)
      lse = plgpu.load(lse_smem.at[wg], layout=row)
      delta = plgpu.load(delta_smem.at[wg], layout=row)
      if o.segmented:
        q_seg = plgpu.load(qseg_smem.at[wg], layout=row)
        q_uni = _uniform_id(uni_ref, b, base, bq)
      by_row = lambda x: lax.broadcast_in_dim(x, (bq, bk), [0])
      dq = plgpu.layout_cast(jnp.full((bq, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      def step(i, dq, masked):
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(kv_bar.at[slot])

        s, dp = _mma(
          [
            ((bq, bk), q_smem, k_smem.at[slot].transpose((1, 0))),
            ((bq, bk), do_smem, v_smem.at[slot].transpose((1, 0))),
          ],
          stage,
        )
        s, t_cap = _log2_scores(o, s)
        k0 = (lo + i) * bk
        if masked:
          ok = _visible(o, padded, _row_ids((bq, bk), base, 0), _row_ids((bq, bk), k0, 1), reach)
          if ok is not None:
            s = jnp.where(ok, s, MASKED)
        if o.segmented:

          def same_segment():
            k_seg = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            return by_row(q_seg) == lax.broadcast_in_dim(k_seg, (bq, bk), [1])

          s = _mask_segments(s, q_uni, _uniform_id(uni_ref, b, k0, bk), same_segment)
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
          plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], kseg_smem.at[slot], kv_bar.at[slot])

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
    lambda *refs: body(*refs[:10], refs[10:]),
    out_type=jax.ShapeDtypeStruct(q.shape, dtype),
    scratch_types=scratch,
    grid=(num_heads, num_tiles, batch),
    grid_names=("heads", "q_tiles", "batch"),
    num_threads=wgs + 1,
    thread_name="wg",
    compiler_params=_compiler_params(),
    interpret=interpret,
  )(q, k, v, do, lse, delta, segment_ids, uniform, window)


# ---------------------------------------------------------------------------------------------
# Backward: dK, dV (one CTA per key tile and K/V head, streaming the query blocks of every
# query head in the group, so GQA needs no per-query-head dK/dV)
# ---------------------------------------------------------------------------------------------


def backward_dkv(
  q, k, v, do, lse, delta, segment_ids, uniform, window, o: Options, blocks: Blocks, interpret=None
):
  """-> dk, dv [B, T, K, H] in k's dtype.

  Head dim <= 128: each compute warpgroup owns its own ``dkv_kv`` keys and accumulates both
  dK and dV. Larger: two f32 accumulators do not fit the registers, so both warpgroups take
  the same keys, one accumulating dV (2 matmuls a step), the other dK (3 matmuls).
  """
  batch, t, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  bk, bq, stages = blocks.dkv_kv, blocks.dkv_q, blocks.num_stages
  dtype = q.dtype
  interpreted = interpret is not None
  padded = o.seq_len < t
  split = head_dim > 128
  kv_bufs = 1 if split else _COMPUTE_WGS
  tile = bk if split else _COMPUTE_WGS * bk
  num_tiles = t // tile

  def body(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, uni_ref, win_ref, dk_ref, dv_ref,
    scratch,
  ):  # fmt: skip
    (k_smem2, v_smem2, kseg_smem, q_smem, do_smem, lse_smem, delta_smem, qseg_smem) = scratch[:8]
    stage_smem, barriers = scratch[8:]
    kv_bar, q_bar, q_free, done = barriers
    b = lax.axis_index("batch")
    kv_head = lax.axis_index("heads")
    k_tile0 = lax.axis_index("kv_tiles") * tile  # causal: the first keys have the most work
    wg = lax.axis_index("wg")
    window, reach = _read_window(o, win_ref)
    lo, a, c, hi = _q_blocks(o, k_tile0, k_tile0 + tile, window, bq)
    per_head = hi - lo
    n = group * per_head

    @pl.when(wg < _COMPUTE_WGS)
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
          plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], kseg_smem.at[buf], kv_bar.at[buf])

      if split:
        pl.when(wg == 0)(load_kv)
      else:
        load_kv()
      plgpu.barrier_wait(kv_bar.at[buf])
      if o.segmented:
        k_seg = plgpu.load(kseg_smem.at[buf], layout=plgpu.Layout.WGMMA.reduce(1))
        k_uni = _uniform_id(uni_ref, b, base, bk)
      zeros = plgpu.layout_cast(jnp.full((bk, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      def step(i, carry, masked, want_dk, want_dv):
        """carry: (dk, dv), (dk,) or (dv,) as wanted."""
        slot = lax.rem(i, jnp.int32(stages))
        qb = lo + lax.rem(i, jnp.maximum(per_head, 1))
        plgpu.barrier_wait(q_bar.at[slot])
        q_s, do_s = q_smem.at[slot], do_smem.at[slot]
        col = plgpu.Layout.WGMMA.reduce(0)

        def s_t(acc_ref):
          plgpu.wgmma(acc_ref, k_smem, q_s.transpose((1, 0)))
          return acc_ref[...]

        s = pl.run_scoped(s_t, plgpu.ACC((bk, bq), jnp.float32))  # [keys, queries]
        s, t_cap = _log2_scores(o, s)
        if masked:
          ok = _visible(
            o, padded, _row_ids((bk, bq), qb * bq, 1), _row_ids((bk, bq), base, 0), reach
          )
          if ok is not None:
            s = jnp.where(ok, s, MASKED)
        if o.segmented:

          def same_segment():
            q_seg = plgpu.load(qseg_smem.at[slot], layout=col)
            return lax.broadcast_in_dim(k_seg, (bk, bq), [0]) == lax.broadcast_in_dim(
              q_seg, (bk, bq), [1]
            )

          s = _mask_segments(s, k_uni, _uniform_id(uni_ref, b, qb * bq, bq), same_segment)
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

          out += _mma([(carry[0], ds.astype(dtype), q_s)], stage)
          if want_dv:
            out.append(dv)
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

        return lax.fori_loop(0, group, head_loop, (zeros,) * (want_dk + want_dv))

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

    @pl.when(wg == _COMPUTE_WGS)
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
          plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], qseg_smem.at[slot], bar)

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
    plgpu.SMEM((_COMPUTE_WGS, bk, bq), dtype) if interpreted else None,
    (
      plgpu.Barrier(num_arrivals=2 + seg, num_barriers=kv_bufs),
      plgpu.Barrier(num_arrivals=4 + seg, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
    ),
  )
  out = jax.ShapeDtypeStruct(k.shape, dtype)
  return plgpu.kernel(
    lambda *refs: body(*refs[:11], refs[11:]),
    out_type=(out, out),
    scratch_types=scratch,
    grid=(num_kv_heads, num_tiles, batch),
    grid_names=("heads", "kv_tiles", "batch"),
    num_threads=_COMPUTE_WGS + 1,
    thread_name="wg",
    compiler_params=_compiler_params(),
    interpret=interpret,
  )(q, k, v, do, lse, delta, segment_ids, uniform, window)

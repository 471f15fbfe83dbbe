"""The warp-specialized pipeline's pieces that the flash attention kernels (kernel.py,
kernel_backward.py) share: row ids in the WGMMA layout, the memory warpgroup's stream of TMA
copies into the ring of slots, the tensor-core products, the shared-memory tiles' layout and
the compiler parameters. kernel.py's module docstring describes the pipeline.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


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

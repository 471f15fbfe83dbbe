"""What the flash attention kernels compute (``Options``) and with which tiles (``Blocks``).

Apart from kernel.py, which imports Mosaic GPU, so that ops.py can take and check these
without loading the kernels until one runs.
"""

import dataclasses
import math

SEGMENT_BLOCK = 64  # rows summarised by one entry of the ``uniform`` segment array
MIXED = -(2**31)  # its value for a block holding several segment ids
COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class Options:
  """What the kernels compute. Static: each combination compiles its own kernel."""

  seq_len: int  # valid tokens; the arrays may be padded past it
  scale: float
  causal: bool = True
  softcap: float | None = None
  windowed: bool = False  # read the window (a run-time value) and mask with it
  segmented: bool = False
  # The keys have segment ids of their own. Else the kernels read the queries' for both, through
  # one ref: two refs to the same ids made the segmented dK/dV kernel 3% slower (H100).
  kv_segmented: bool = False


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
  # dK/dV with ``defer_dk``: stages of the Q/dO ring (otherwise ``num_stages``). A step then
  # holds two slots, its own and the last step's; still, 2 measured faster than 3 on an H100.
  dkv_stages: int = 2
  # dK/dV: issue step i's dK product (dS_i @ Q_i) together with step i+1's S product, one
  # tensor-core wait for both instead of one each (dK/dV 1.98 -> 1.77 ms, H100, seq 8192).
  defer_dk: bool = True

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
      COMPUTE_WGS * self.q,
      self.kv,
      self.dq_wgs * self.dq_q,
      self.dq_kv,
      COMPUTE_WGS * self.dkv_kv,
      self.dkv_q,
    )
    return math.lcm(*sizes)

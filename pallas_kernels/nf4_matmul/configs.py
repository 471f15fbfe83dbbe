"""The NF4 kernels' launch configurations: the Config (kernel.Config) and the table lookup that
dispatch (ops.py) takes for a call's shape, and the tiles and constants they were measured at.

Pure Python: kernel.py, which imports Mosaic GPU, is imported on first use (``_kernel``).
"""

import functools

from pallas_kernels import _gpu

# The lookup for codes given in word order (decoding's, made once for many calls): "lut" reads
# each byte's pair of levels from a table in shared memory, 2 ALU instructions and one load per
# byte where "word"'s program takes 21 per word and ptxas adds a copy of a table constant for
# every other permute (8.4 per word, ncu on an H100). experiments/sweep_nf4_decode.py, H100,
# decoding's 8B launches at dispatch's configurations, M = 1 / 16, one run (RESULTS.md): gate/up
# 32.9 / 32.7 us against 38.1 / 38.6, down 17.3 / 17.5 against 20.2 / 20.3, q/k/v 11.3 / 11.2
# against 12.9 / 12.8, o 8.4 / 8.4 against 9.1 / 9.1. A "lut" asked for where it does not apply
# (wider tiles, or no room for its table) runs "word" instead.
# "plut" (session 28) reads the same pairs from a table of 256-byte rows, so that one byte permute
# makes a byte's address (lut: a shift and a lop3): 8 instructions per 8 values against 12, for a
# 64 KiB table. experiments/sweep_nf4_decode.py, H100, 8B launches (RESULTS.md, session 28, call
# 3): at one token (with blocks_as_columns, below, 3 stages) q/k/v 9.4 us against lut's 10.2, o
# 7.4 against 7.7, gate/up and down within 1%; at 16 tokens (4 stages) q/k/v 10.4 against 10.9,
# the others within 2%. Where its table does not fit beside the pipeline (16-token tiles of four
# warpgroups: gate/up), "lut", then "word".
PREPARED_LOOKUP = "plut"
# Token tiles up to this size take "plut" or "lut" where asked for and the table fits in shared
# memory beside the pipeline (decoding's tiles of at most 16 tokens, where they were measured),
# and so do training's 256-token tiles (``TRAIN_TILE``); tiles of 32, 64 (GRPO's rollouts) and
# 128 tokens, not measured with a table, keep "word".
LUT_MAX_TILE = 16
TRAIN_TILE = 256
# Training's calls (at least ``WORD_PER_CALL_MIN_TOKENS`` tokens, 256-token tiles) take "plut",
# their output stored in chunks of ``TRAIN_OUT_CHUNK`` tokens so that its 64 KiB table fits
# beside 4 pipeline stages (kernel.Config.out_chunk). experiments/sweep_nf4_train.py, H100, 8B
# shapes at 4096 tokens, codes made once, one run (session 29, call 2), over cuBLAS bf16:
# forward 0.851 / 1.084 / 1.056 (4096 x 4096, gate-or-up 4096 x 14336, down 14336 x 4096)
# against "word"'s 0.891 / 1.132 / 1.126 (whole-tile store, 4 stages; call 2's, call 1 gave
# 0.899 / 1.127 / 1.127); input gradient (the forward kernel on W^T's codes) 0.884 / 1.098 /
# 1.107 against 0.908 / 1.126 / 1.135; XLA's dequantize-then-dot 1.117-1.127 in the same run.
# With a LoRA pair folded in (``nf4_matmul(extra=)``, E columns) plut fits up to E = 16; gate
# and up fold both their ranks (E = 32 at rank 16) and take "lut". "lut" (4 stages, 64-token
# chunks) measured within 0-2% of "plut"; 5 stages of "word" 2-4% slower than 4; 3 or fewer
# stages slower.
TRAIN_LOOKUP = "plut"
TRAIN_OUT_CHUNK = 32
# One token (batch-1 decoding) spreads its k blocks over the accumulator's 8 columns
# (kernel.Config.blocks_as_columns): tiles go to the tensor cores unscaled, each column is scaled
# after the product. Same sweep (calls 3 and 4), with plut, against session 27's 16-token tile
# with wgmmas in flight (lut): q/k/v 0.48x cuBLAS bf16 against 0.55-0.57x, o 0.54-0.55x against
# 0.63x, gate/up 0.38x against 0.40x, down 0.39x against 0.41x; 3 pipeline stages fastest on all
# four. End to end (experiments/log/RESULTS-2026-11.md): 8B batch 1 1.12x, 70B 1.04x.
COLUMN_STAGES = 3


_TARGET_CELLS = 132  # one per streaming multiprocessor of an H100 / H200
# Calls of at least this many tokens (training) read the codes in word order (``TRAIN_LOOKUP``;
# the backward kernel "word"), permuted on every call unless made for the run. Measured with
# "word" at 4096 tokens (experiments/sweep_nf4_train.py, H100, 8B shapes, 4096 x 4096, session
# 16): forward 0.97x cuBLAS bf16 with the permutation (3-5% of the op) against "prmt"'s 1.13x;
# input gradient 1.15x against 1.47x. The permutation costs the same
# at any token count and the lookup's saving shrinks with it: even at ~1,200 tokens by those
# figures; not measured below 4096.
WORD_PER_CALL_MIN_TOKENS = 2048


@functools.cache
def _kernel():
  """kernel.py, imported on first use: importing it loads Mosaic GPU."""
  from pallas_kernels.nf4_matmul import kernel

  return kernel


def _lut_applies(cfg, lookup: str = "lut", extra_cols: int = 0) -> bool:
  """Whether a forward configuration takes the table lookup ``lookup`` ("lut" or "plut") where
  it is asked for: a tile of at most ``LUT_MAX_TILE`` tokens or of ``TRAIN_TILE`` (where they
  were measured) whose pipeline (and extra operands ``extra_cols`` wide) leaves room for the
  table."""
  kernel = _kernel()
  fits = kernel.forward_smem_bytes(cfg, lookup=lookup, extra_cols=extra_cols) <= kernel.SMEM_BYTES
  return (cfg.block_m <= LUT_MAX_TILE or cfg.block_m == TRAIN_TILE) and fits


def _table_lookup(cfg, lookup: str, extra_cols: int = 0) -> str:
  """The lookup a forward configuration runs for ``lookup``: a table lookup ("plut", "lut")
  where its table fits (``_lut_applies``), else "lut" where that one does, else "word"; any
  other lookup as it is."""
  if lookup not in _kernel().TABLE_LOOKUPS:
    return lookup
  return next((t for t in (lookup, "lut") if _lut_applies(cfg, t, extra_cols)), "word")


def _block_m(m: int) -> int:
  for bm in (16, 32, 64, 128):
    if m <= bm:
      return bm
  return 256


def _forward_config(m: int, n: int, k: int, interpret: bool):
  """The kernel's Config for x [m, k] @ W^T [k, n], or None where it does not apply.

  Decoding tiles (at most 64 tokens) follow the sweeps of experiments/sweep_nf4_decode.py
  (one H100, 8B shapes, M = 1 and 16): K is split (wider tiles: until the grid has a cell per
  streaming multiprocessor), and each pipeline step takes the most 64-wide k blocks (4, 2, 1)
  that still leave it 4 steps and fit in shared memory (64 tokens with split K: 2 blocks);
  21-24% faster than one block a step over twice the cells. Tiles of 64 tokens measured
  fastest at half those cells (M = 64: 0.77-0.82x cuBLAS bf16, against 0.85-1.02x at a cell
  per SM). Tiles of at most 16 tokens leave a step's wgmmas in flight into the next step
  (``delay_release``; the same sweep, decoding's fused shapes, M = 1 and 16: 1-5% less time
  on every shape, e.g. gate/up 0.513 against 0.531 of cuBLAS bf16; wrong at 256 tokens).
  Those tiles split K only as far as one wave of cells (at most one per SM), and take four
  compute warpgroups a cell where two would need more than a wave, four would not, and N is
  a multiple of 256
  (H100, word lookup, decoding's 8B launches at M = 1, one run: q/k/v 96 cells 13.0 us against
  15.4 at 192; o 128 cells 9.4 against 12.0 at 256; down 128 cells 20.2 against 23.1 at 256;
  gate/up 112 cells of four warpgroups 37.9 against 40.8 for 224 of two). At 64 tokens the
  same four-warpgroup rule (H100, M = 64, one run: fused gate/up 48.0 us against 51.3; the
  other launches' dispatch was the fastest swept or within 1%). One token takes the same grid
  with its k blocks as the accumulator's 8 columns (``blocks_as_columns``), ``COLUMN_STAGES``
  stages and nothing in flight across steps (session 28).
  """
  kernel = _kernel()
  columns = m == 1  # one token: its k blocks spread over the columns (COLUMN_STAGES)
  bm = kernel.COLUMNS if columns else _block_m(m)
  wgs = 2 if n % (2 * kernel.WG_ROWS) == 0 else 1
  if n % (wgs * kernel.WG_ROWS) or k % kernel.BLOCK_K:
    return None
  cells = (n // (wgs * kernel.WG_ROWS)) * (-(-m // bm))
  # Measured only where four bring the grid within a wave (8B gate/up at 16 and 64 tokens;
  # not 70B's 448 cells, not 32-token tiles).
  measured = bm <= 16 or bm == 64
  if measured and cells > _TARGET_CELLS >= cells // 2 and n % (4 * kernel.WG_ROWS) == 0:
    if _gpu.four_warpgroups_supported():
      wgs, cells = 4, cells // 2
  split = 1
  # Few output tiles (decoding): split K while the grid stays within one wave (16-token
  # tiles) or until it covers the GPU (wider ones), keeping at least 4 steps of 64 per cell.
  # Not with wide tiles: their float32 partial outputs would not fit in shared memory beside
  # the pipeline.
  target = _TARGET_CELLS if bm <= 32 else _TARGET_CELLS // 2  # 64-token tiles: one per 2 SMs
  limit = target // 2 if bm <= 16 else target - 1  # most cells before doubling the split
  while bm <= 64 and cells * split <= limit and k % (kernel.BLOCK_K * split * 2) == 0:
    if k // (split * 2) < 4 * kernel.BLOCK_K:
      break
    split *= 2
  config = functools.partial(
    kernel.Config, block_m=bm, compute_wgs=wgs, split_k=split, blocks_as_columns=columns,
    max_concurrent_steps=COLUMN_STAGES if columns else 4,
  )  # fmt: skip
  sub = 1
  for s in (4, 2) if bm <= 64 else ():  # (both divide COLUMNS)
    block = s * kernel.BLOCK_K
    # Shared memory counted as the GPU runs it (the interpreter stages tiles there besides).
    smem = kernel.forward_smem_bytes(config(k_sub=s, a_from_smem=False))
    if (k // split) % block == 0 and k // split // block >= 4 and smem <= kernel.SMEM_BYTES:
      sub = s
      break
  # 256-token tiles (training) store y itself, not y^T for XLA to transpose: 8-10% less time
  # at 4096 tokens (sweep_nf4_train.py, H100, 8B shapes), and walk the grid in groups of tile
  # rows. Wgmmas left in flight: at most 16 tokens (measured faster there; wrong at 256, where
  # the kernel refuses them).
  return config(
    k_sub=sub, a_from_smem=interpret, delay_release=int(bm <= 16 and not columns),
    out_rows=bm == TRAIN_TILE, out_chunk=TRAIN_OUT_CHUNK if bm == TRAIN_TILE else 0,
    group_m=_group_m(m, bm),
  )  # fmt: skip


def _group_m(m: int, bm: int) -> int:
  """Tile rows the grid walks as a group (``Config.group_m``) for 256-token tiles: 16 where
  they divide, else 8, else 4, else row by row. sweep_nf4_train.py, H100, 8B shapes at 4096
  tokens: 4 took 1-2% less time than 1 on every shape, forward and transposed (session 17); 8
  0.6-0.8% less than 4 on all six rows with plut (session 29, call 4); 16 (4096 tokens: the
  whole column of tiles) 0.6-1.7% less than 8 on the forward and the input gradient of q/o,
  gate/up and down, k/v within 0.5% (session 31, call 3); at 8192 tokens 16 beat 8 on seven
  of eight rows, and 32 was no better than 16 over a layer's products (+-1% by row)."""
  if bm != TRAIN_TILE:
    return 1
  return next((g for g in (16, 8, 4) if -(-m // bm) % g == 0), 1)


def _backward_config(m: int, n: int, k: int, interpret: bool = False):
  """The Config for dx [m, k] = dy [m, n] @ W [n, k], or None where no kernel applies. From
  ``WORD_PER_CALL_MIN_TOKENS`` tokens: the forward kernel on W^T's codes (``transposed``;
  transposed per call, or made once for the run: ``training_operands``; sweep_nf4_train.py,
  H100, 8B shapes at 4096 tokens, the per-call transpose and permutation included: 1.03x /
  1.26x / 1.25x cuBLAS bf16 on 4096 x 4096 / gate-up / down against the backward kernel's
  1.14x / 1.45x / 1.40x; XLA's dequantize-then-dot 1.12x). The interpreter stages the
  dequantized tiles in shared memory (``a_from_smem``), as for the forward."""
  kernel = _kernel()
  if m >= WORD_PER_CALL_MIN_TOKENS and k % (2 * kernel.WG_ROWS) == 0 and n % kernel.BLOCK_K == 0:
    return kernel.Config(
      block_m=TRAIN_TILE, compute_wgs=2, out_rows=True, out_chunk=TRAIN_OUT_CHUNK,
      transposed=True, group_m=_group_m(m, TRAIN_TILE), a_from_smem=interpret,
    )  # fmt: skip
  bn = 128 if n % 128 == 0 else 64
  wgs = 2 if k % 128 == 0 else 1
  if n % bn or k % (64 * wgs):
    return None
  if m >= 256:  # sweep_nf4_train.py, H100, 4096 x 4096: 1.08x cuBLAS bf16 against 1.51x (128 x 128)
    return kernel.Config(block_m=256, block_n=64, block_k_out=64, compute_wgs=wgs)
  bm = 64 if m <= 64 else 128
  return kernel.Config(block_m=bm, block_n=bn, block_k_out=64, compute_wgs=wgs)

"""The NF4 kernels' table lookups: int4 codes in a register layout -> bfloat16 levels in wgmma's.

Each lookup is a small program run per register of codes, inline PTX through
``plgpu.inline_mgpu`` (the tests emulate the programs' texts and tables lane by lane):
  "prmt"    seven byte permutes per pair over the table held in immediates, after a layout
            cast to wgmma's layout (codes as bitsandbytes stores them);
  "word"    8 codes of one register at once, no cast (codes in word order, ``word_codes``);
  "lut"     each byte's pair of levels loaded from a table in shared memory, a copy per lane;
  "plut"    the same with 256-byte table rows, so one byte permute makes each load's address;
  "select"  a tree of selects in jnp (what Mosaic GPU's interpreter runs).
kernel.py's module docstring compares them; ops.py says which dispatch takes where.
"""

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.nf4_maps import NF4_CODE


def _bf16_bits(values: np.ndarray) -> np.ndarray:
  return np.asarray(values, np.float32).astype(jnp.bfloat16).view(np.uint16)  # numpy, not traced


@functools.cache
def _table_words() -> tuple[list[int], list[int]]:
  """The NF4 table as bfloat16 bytes: 4 words of low bytes, 4 of high bytes (4 entries each)."""
  bits = _bf16_bits(NF4_CODE).astype(np.uint32)
  lo = [int(sum((bits[4 * w + i] & 0xFF) << (8 * i) for i in range(4))) for w in range(4)]
  hi = [int(sum((bits[4 * w + i] >> 8) << (8 * i) for i in range(4))) for w in range(4)]
  return lo, hi


def _lookup_select(w):
  """int4 codes (nibbles already in JAX order) -> bfloat16 NF4 levels, with jnp ops."""
  c = w.astype(jnp.int32) & 15
  vals = [jnp.float32(v) for v in NF4_CODE]
  for bit in range(4):
    b = (c & (1 << bit)) != 0
    vals = [jnp.where(b, vals[2 * j + 1], vals[2 * j]) for j in range(len(vals) // 2)]
  return vals[0].astype(jnp.bfloat16)


# The byte-permute program's selectors (tests emulate it with these): index bits of both codes,
# their bit 3 (which half-table), the byte positions the blend keeps, and the final layout
# [L(c_hi), H(c_hi), L(c_lo), H(c_lo)] that puts bitsandbytes' even element (high nibble) first.
SEL_MASK, BLEND_MASK, BLEND_BASE, INTERLEAVE = 0x77, 0x88, 0x3210, 0x4051


def _lookup_prmt(w):
  """int4 codes as bitsandbytes packs them -> bfloat16 NF4 levels, via byte permutes."""
  from jax._src.lib.mlir import ir  # noqa: PLC0415 (MLIR only exists where Mosaic GPU lowers)
  from jax._src.lib.mlir.dialects import arith, llvm  # noqa: PLC0415
  from jax.experimental import mosaic as _  # noqa: F401, PLC0415
  from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415

  lo, hi = _table_words()
  # Per register: one byte, two codes; c_lo = low nibble (bnb's odd element), c_hi = high.
  # sel picks entry (c & 7) of a 4-word half-table per byte; blend picks the half by bit 3;
  # the last permute lays out [L(c_hi), H(c_hi), L(c_lo), H(c_lo)]: element 2j first.
  asm = f"""{{
  .reg .b32 sel, blend, a, b, l, h;
  and.b32 sel, $1, {SEL_MASK};
  and.b32 blend, $1, {BLEND_MASK};
  shr.u32 blend, blend, 1;
  or.b32 blend, blend, {BLEND_BASE};
  prmt.b32 a, {lo[0]}, {lo[1]}, sel;
  prmt.b32 b, {lo[2]}, {lo[3]}, sel;
  prmt.b32 l, a, b, blend;
  prmt.b32 a, {hi[0]}, {hi[1]}, sel;
  prmt.b32 b, {hi[2]}, {hi[3]}, sel;
  prmt.b32 h, a, b, blend;
  prmt.b32 $0, l, h, {INTERLEAVE};
  }}"""

  @plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA,),
    return_type=plgpu.ShapeDtypeStruct(w.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )
  def lookup(ctx, codes):
    del ctx
    i8 = ir.IntegerType.get_signless(8)
    i32 = ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    regs = np.empty_like(codes.registers)
    for idx, reg in np.ndenumerate(codes.registers):
      byte = mgpu.utils.bitcast(reg, i8)
      word = llvm.inline_asm(i32, [arith.extui(i32, byte)], asm, "=r,r")
      regs[idx] = mgpu.utils.bitcast(word, pair)
    return mgpu.FragmentedArray(_registers=regs, _layout=codes.layout, _is_signed=None)

  return lookup(w)


# The word program's constants (tests emulate its text): index bits of the 8 codes; their bit 3
# moved to bit 2 over the identity selector (which half-table, per byte); and the two
# interleaves [L(n1), H(n1), L(n0), H(n0)], [L(n3), H(n3), L(n2), H(n2)] of 4 looked-up codes:
# in a byte the high nibble (n1) is bitsandbytes' even column, the bf16 pair's low half.
WORD_SEL_MASK, WORD_BLEND_MASK, WORD_BLEND_BASE = 0x77777777, 0x88888888, 0x32103210
WORD_PAIRS = (0x4051, 0x6273)


def word_asm() -> str:
  """The "word" lookup as PTX: $4 = 8 codes (a 32-bit register of ``word_codes``' bytes),
  $0..$3 = bf16 pairs of core matrices 0..3. prmt reads only a selector's low 16 bits, so
  each 16-bit half of the selectors (codes 0-3, then 4-7 shifted down) serves 4 codes:
  6 ALU + 16 prmt for 8 values (ptxas for sm_90a: 5 + 16, the blend's shift and or fused)."""
  lo, hi = _table_words()
  lines = [
    f"and.b32 s0, $4, {WORD_SEL_MASK:#x};",
    "shr.u32 s1, s0, 16;",
    f"and.b32 b0, $4, {WORD_BLEND_MASK:#x};",
    "shr.u32 b0, b0, 1;",
    f"or.b32 b0, b0, {WORD_BLEND_BASE:#x};",
    "shr.u32 b1, b0, 16;",
  ]
  for half in (0, 1):
    sel, blend = f"s{half}", f"b{half}"
    lines += [
      f"prmt.b32 a, {lo[0]}, {lo[1]}, {sel};",
      f"prmt.b32 b, {lo[2]}, {lo[3]}, {sel};",
      f"prmt.b32 l, a, b, {blend};",
      f"prmt.b32 a, {hi[0]}, {hi[1]}, {sel};",
      f"prmt.b32 b, {hi[2]}, {hi[3]}, {sel};",
      f"prmt.b32 h, a, b, {blend};",
      f"prmt.b32 ${2 * half}, l, h, {WORD_PAIRS[0]};",
      f"prmt.b32 ${2 * half + 1}, l, h, {WORD_PAIRS[1]};",
    ]
  body = "\n  ".join(lines)
  return f"{{\n  .reg .b32 s0, s1, b0, b1, a, b, l, h;\n  {body}\n}}"


def word_register(idx: tuple[int, ...], pair: int) -> tuple[int, ...]:
  """WGMMA_LAYOUT's register index of bf16 pair ``pair`` (0..3) of the WGMMA_LAYOUT_UPCAST_4X
  register ``idx``. The two tilings split rows alike ((64, .)(16, .)(8, .)) and give a thread
  the same rows, so every index but the column tile's (dim 1) carries over; a 32-column tile
  is 4 tiles of 8 columns, ``word_codes`` put core matrix b of the 32 in the register's byte b,
  and the program returns byte b's values as pair b."""
  return (idx[0], 4 * idx[1] + pair, *idx[2:])


def _lookup_word(w):
  """int4 codes of ``word_codes`` in WGMMA_LAYOUT_UPCAST_4X -> bfloat16 NF4 levels in
  WGMMA_LAYOUT, 8 a register, without the layout cast."""
  from jax._src.lib.mlir import ir  # noqa: PLC0415 (MLIR only exists where Mosaic GPU lowers)
  from jax.experimental import mosaic as _  # noqa: F401, PLC0415
  from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415

  asm = word_asm()

  @plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
    return_type=plgpu.ShapeDtypeStruct(w.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )
  def lookup(ctx, codes):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    layout = plgpu.Layout.WGMMA.to_mgpu()
    regs = np.empty(layout.registers_shape(codes.shape), dtype=object)
    for idx, reg in np.ndenumerate(codes.registers):
      outs = mgpu.utils.inline_ptx(asm, mgpu.utils.bitcast(reg, i32), result_types=[i32] * 4)
      for p, out in enumerate(outs):
        regs[word_register(idx, p)] = mgpu.utils.bitcast(out, pair)
    assert all(r is not None for r in regs.flat)
    return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return lookup(w)


LUT_COPIES = 32  # one copy of the table per lane of a warp: every load hits its own bank
LUT_SHIFTS = (-7, 1, 9, 17)  # byte b of a word, times 128 (a table row), by one shift
LUT_AND_OR = (0xF0 & 0xCC) | 0xAA  # lop3's truth table of (a & b) | c


@functools.cache
def lut_table() -> np.ndarray:
  """The "lut" lookup's table, uint32 [256, LUT_COPIES]: row e holds the bf16 pair of byte e
  (the high nibble's level in the low half: bitsandbytes' even element first), once per lane,
  so lane l reads word e * 32 + l, which is in bank l whatever e is."""
  bits = _bf16_bits(NF4_CODE).astype(np.uint32)
  e = np.arange(256)
  pairs = bits[e >> 4] | (bits[e & 15] << 16)
  table = np.repeat(pairs[:, None], LUT_COPIES, axis=1).astype(np.uint32)
  table.flags.writeable = False  # cached: shared by every call
  return table


def lut_asm() -> str:
  """The "lut" lookup as PTX: $4 = 8 codes (a register of ``word_codes``' bytes, as for the
  "word" lookup), $5 = this lane's byte offset (4 x lane), $6 = the table's shared-memory
  address; $0..$3 = the bf16 pairs of bytes 0..3, each one load from the table (row = the
  byte). Per byte a shift, one lop3 and a load (ptxas folds the add of the table's address,
  uniform, into the load): 12 instructions per 8 values against the word program's 21 and the
  copies of its table constants that ptxas adds (8.4 per word)."""
  # A table row is LUT_COPIES words = 128 bytes: the mask 0x7f80 keeps byte b times 128, and
  # lane x 4 (at most 124) fills the bits below it.
  assert LUT_COPIES * 4 == 128 and all(8 * b - s == 7 for b, s in enumerate(LUT_SHIFTS))
  lines = []
  for b, shift in enumerate(LUT_SHIFTS):
    move = f"shl.b32 t{b}, $4, {-shift};" if shift < 0 else f"shr.u32 t{b}, $4, {shift};"
    lines += [
      move,
      f"lop3.b32 t{b}, t{b}, 0x7f80, $5, {LUT_AND_OR:#x};",  # (byte x 128) | lane x 4
      f"add.u32 t{b}, t{b}, $6;",
      f"ld.shared.b32 ${b}, [t{b}];",
    ]
  body = "\n  ".join(lines)
  return f"{{\n  .reg .b32 t0, t1, t2, t3;\n  {body}\n}}"


# The "plut" lookup: the same pairs, one table row of 256 bytes per byte value (lane l's copy at
# byte 4l of the first 128, the rest unused), so that a byte's address is one byte permute of the
# code word and the lane's offset: [4 x lane, byte b, 0, 0] = byte b x 256 + 4 x lane.
PLUT_ROW_WORDS = 64
PLUT_SELECTORS = tuple(0x5504 | (b << 4) for b in range(4))  # out bytes: $5.b0, $4.b<b>, 0, 0


@functools.cache
def plut_table() -> np.ndarray:
  """The "plut" lookup's table, uint32 [256, PLUT_ROW_WORDS]: ``lut_table``'s rows, each padded
  to 256 bytes with zeros (never read)."""
  table = np.zeros((256, PLUT_ROW_WORDS), np.uint32)
  table[:, :LUT_COPIES] = lut_table()
  table.flags.writeable = False
  return table


def plut_asm() -> str:
  """The "plut" lookup as PTX, operands as ``lut_asm``'s: per byte one prmt (the byte times 256
  plus this lane's offset, both read from the operands) and a load: 8 instructions per 8 values
  against lut's 12 (its shift and lop3 per byte), for a table twice as large (64 KiB)."""
  lines = []
  for b, sel in enumerate(PLUT_SELECTORS):
    lines += [
      f"prmt.b32 t{b}, $4, $5, {sel:#x};",
      f"add.u32 t{b}, t{b}, $6;",
      f"ld.shared.b32 ${b}, [t{b}];",
    ]
  body = "\n  ".join(lines)
  return f"{{\n  .reg .b32 t0, t1, t2, t3;\n  {body}\n}}"


TABLE_LOOKUPS = ("lut", "plut")


def lookup_table(lookup: str) -> np.ndarray | None:
  """The shared-memory table a lookup reads (None: it reads none)."""
  if lookup not in TABLE_LOOKUPS:
    return None
  return lut_table() if lookup == "lut" else plut_table()


def _lookup_lut(w, table, lookup: str = "lut"):
  """int4 codes of ``word_codes`` in WGMMA_LAYOUT_UPCAST_4X -> bfloat16 NF4 levels in
  WGMMA_LAYOUT (as ``_lookup_word``), each byte's pair loaded from ``table`` (shared memory,
  ``lookup_table(lookup)``) by ``lookup``'s program ("lut" or "plut")."""
  from jax._src.lib.mlir import ir  # noqa: PLC0415 (MLIR only exists where Mosaic GPU lowers)
  from jax._src.lib.mlir.dialects import arith, llvm  # noqa: PLC0415
  from jax.experimental import mosaic as _  # noqa: F401, PLC0415
  from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415

  asm = lut_asm() if lookup == "lut" else plut_asm()

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(), plgpu.Layout.WGMMA_UPCAST_4X),
    return_type=plgpu.ShapeDtypeStruct(w.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )
  def lookup(ctx, table_ref, codes):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    base = llvm.ptrtoint(i32, mgpu.utils.memref_ptr(table_ref))
    lane4 = arith.shli(
      arith.andi(mgpu.utils.thread_idx(), mgpu.utils.c(31, i32)), mgpu.utils.c(2, i32)
    )
    layout = plgpu.Layout.WGMMA.to_mgpu()
    regs = np.empty(layout.registers_shape(codes.shape), dtype=object)
    for idx, reg in np.ndenumerate(codes.registers):
      word = mgpu.utils.bitcast(reg, i32)
      outs = mgpu.utils.inline_ptx(asm, word, lane4, base, result_types=[i32] * 4)
      for p, out in enumerate(outs):
        regs[word_register(idx, p)] = mgpu.utils.bitcast(out, pair)
    assert all(r is not None for r in regs.flat)
    return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return lookup(table, w)


def levels(codes: Any, lookup: str, table: Any = None) -> Any:
  """int4 codes as loaded (WGMMA_LAYOUT_UPCAST_4X) -> bfloat16 NF4 levels in WGMMA_LAYOUT, by
  ``lookup`` ("word", "lut", "plut": codes in word order; "prmt": bitsandbytes' order;
  "select": nibbles swapped, for the interpreter). ``table``: the lut or plut lookup's, in
  shared memory (``lookup_table``)."""
  if lookup == "word":
    return _lookup_word(codes)
  if lookup in TABLE_LOOKUPS:
    return _lookup_lut(codes, table, lookup)
  codes = plgpu.layout_cast(codes, plgpu.Layout.WGMMA)
  return _lookup_prmt(codes) if lookup == "prmt" else _lookup_select(codes)

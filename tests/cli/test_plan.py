"""--remat auto and an unset --loss-chunk: the fastest setting whose compiled memory plan fits
(plan.py), the refusal when none does, and the persistent compilation cache of the command
lines. The real step's plans are checked in test_train (a run under --memory-limit)."""

import math
import os
import re
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import background_run, family_config, run_cli

from jaxtune.errors import UserError
from jaxtune.models.config import ModelConfig
from jaxtune.parallel.runtime import Runtime
from jaxtune.run import resolve as resolver
from jaxtune.run.resolve import remat_candidates
from jaxtune.run_config import AUTO_LOSS_CHUNK, RunConfig
from jaxtune.training import compile_cache, plan, step_store

MIB = 2**20
GIB = 2**30


class FakeStep:
  """A step whose compiled programs report the planned sizes given per (remat, loss_chunk),
  recording which settings were compiled."""

  def __init__(self, sizes: dict[tuple[str, int], int]):
    self.sizes, self.compiled = sizes, []

  def build(self, rt: Runtime):
    setting = (rt.remat, rt.loss_chunk) + (() if rt.scan_layers else ("unrolled",))
    setting += ("kept", rt.kept_layers) if rt.kept_layers else ()

    def lower(*args):
      def compile():
        self.compiled.append(setting)
        size = self.sizes[setting]
        stats = SimpleNamespace(
          argument_size_in_bytes=size // 2,
          output_size_in_bytes=size // 4,
          alias_size_in_bytes=size // 4,  # the donated state: arguments and outputs share it
          temp_size_in_bytes=size // 2,
          generated_code_size_in_bytes=0,
        )
        return SimpleNamespace(memory_analysis=lambda: stats, setting=setting)

      return SimpleNamespace(compile=compile)

    return SimpleNamespace(lower=lower)


AUTO = Runtime(remat="activations", candidates=remat_candidates(RunConfig(remat="auto")))
SIZES = {
  ("activations", 0): 100 * MIB,
  ("activations", AUTO_LOSS_CHUNK): 90 * MIB,
  ("dots_no_batch", 0): 80 * MIB,
  ("dots_no_batch", AUTO_LOSS_CHUNK): 70 * MIB,
  ("full", 0): 50 * MIB,
  ("full", AUTO_LOSS_CHUNK): 40 * MIB,
  ("lean", AUTO_LOSS_CHUNK): 36 * MIB,
  ("offload", AUTO_LOSS_CHUNK): 30 * MIB,
}


def test_candidates_are_fastest_first_and_follow_what_is_set():
  assert remat_candidates(RunConfig(remat="auto")) == (
    ("activations", 0),
    ("activations", AUTO_LOSS_CHUNK),
    ("dots_no_batch", 0),
    ("dots_no_batch", AUTO_LOSS_CHUNK),
    ("full", 0),
    ("full", AUTO_LOSS_CHUNK),
    ("lean", AUTO_LOSS_CHUNK),
    ("offload", AUTO_LOSS_CHUNK),
  )
  assert remat_candidates(RunConfig(remat="full")) == (("full", 0), ("full", AUTO_LOSS_CHUNK))
  assert remat_candidates(RunConfig(remat="auto", loss_chunk=0))[-1] == ("offload", 0)
  assert remat_candidates(RunConfig(remat="dots", loss_chunk=256)) == (("dots", 256),)


def test_the_fused_loss_replaces_the_whole_logits_where_it_applies():
  """--loss-chunk unset, SFT on a GPU with a frozen output layer: pieces of ~4096 tokens a
  device (the fused loss) come first in place of the whole logits, then 1024 where larger;
  the leanest settings take the smaller."""
  from jaxtune.parallel.runtime import FUSED_PIECE_TOKENS
  from jaxtune.run.resolve import fused_loss_chunk

  gpu, cpu = SimpleNamespace(platform="gpu"), SimpleNamespace(platform="cpu")
  cfg = SimpleNamespace(vocab_size=128256)
  run = RunConfig(seq_len=2048)
  bf16 = "bfloat16"
  assert FUSED_PIECE_TOKENS == 4096
  assert fused_loss_chunk(run, cfg, 2, 1, gpu, bf16) == 2048
  assert fused_loss_chunk(run, cfg, 4, 1, gpu, bf16) == 1024
  assert fused_loss_chunk(run, cfg, 1, 1, gpu, bf16) == 2048  # at most the row
  assert fused_loss_chunk(RunConfig(), cfg, 1, 1, gpu, bf16) == 4096  # the row's length unset
  for other, devices, device, dtype in (
    (RunConfig(seq_len=2048, lora_targets=("q_proj", "lm_head")), 1, gpu, bf16),  # head trains
    (RunConfig(seq_len=2048, method="dpo"), 1, gpu, bf16),
    (RunConfig(seq_len=2048, loss_chunk=0), 1, gpu, bf16),  # the user's choice
    (run, 2, gpu, bf16),  # measured on one GPU only
    (run, 1, cpu, bf16),
    (run, 1, gpu, "float16"),  # loss scaling: the pieces' gradients would underflow
  ):
    assert fused_loss_chunk(other, cfg, 2, devices, device, dtype) == 0
  assert fused_loss_chunk(run, SimpleNamespace(vocab_size=262144), 2, 1, gpu, bf16) == 0

  auto = RunConfig(remat="auto")
  assert remat_candidates(auto, fused_chunk=2048) == (
    ("activations", 2048),
    ("activations", AUTO_LOSS_CHUNK),
    ("dots_no_batch", 2048),
    ("dots_no_batch", AUTO_LOSS_CHUNK),
    ("full", 2048),
    ("full", AUTO_LOSS_CHUNK),
    ("lean", AUTO_LOSS_CHUNK),
    ("offload", AUTO_LOSS_CHUNK),
  )
  assert remat_candidates(auto, fused_chunk=512)[-2:] == (("lean", 512), ("offload", 512))
  whole = remat_candidates(RunConfig(remat="auto", loss_chunk=0), fused_chunk=2048)
  assert whole[0] == ("activations", 0)  # the user's --loss-chunk wins


A, C = "activations", AUTO_LOSS_CHUNK


def test_training_takes_the_nf4_kernels_where_they_measured_faster(monkeypatch):
  """--nf4-matmul unset: the Pallas kernels train an 8B NF4 model at 2 x 2,048 tokens a call on
  one Hopper GPU in bfloat16 (measured faster than XLA's step there), not a 1B-wide one, more
  or fewer tokens a call, another method (DPO measured slower), an unquantized model, several
  devices, another GPU or dtype, a length not known yet, or where the operands made for the
  run would not fit (70B on one 80 GB GPU, or 8B under 16 GiB); the user's choice stands;
  resolve() passes the micro-batch's tokens, the method and the free memory."""
  from jaxtune.parallel import runtime
  from jaxtune.run.resolve import resolve, resolve_nf4_matmul

  h100 = SimpleNamespace(platform="gpu", compute_capability="9.0")
  a100 = SimpleNamespace(platform="gpu", compute_capability="8.0")
  hf = dict(max_position_embeddings=2048, vocab_size=128256, num_attention_heads=32)
  llama = dict(hf, num_key_value_heads=8, head_dim=128, num_hidden_layers=32)
  wide = ModelConfig.from_hf(
    family_config("llama", hidden_size=4096, intermediate_size=14336, **llama).to_dict()
  )
  narrow = ModelConfig.from_hf(
    family_config("llama", hidden_size=2048, intermediate_size=8192, **llama).to_dict()
  )
  huge = ModelConfig.from_hf(
    family_config(
      "llama",
      hidden_size=8192,
      intermediate_size=28672,
      **{**llama, "num_hidden_layers": 80, "num_attention_heads": 64},
    ).to_dict()
  )
  gib = 2**30
  fast = dict(method="sft", quantized=True, tokens=2 * 2048, devices=1, device=h100,
              dtype="bfloat16", free=79 * gib)  # fmt: skip
  # The operands: twice the codes of 7.0e9 weights (and scales) beside a model of ~5.7 GB.
  assert 7.1e9 < resolver.kernel_operand_bytes(wide) < 7.3e9
  assert 5.5e9 < resolver.loaded_bytes(wide) < 6e9
  assert resolve_nf4_matmul(None, wide, **fast) == "kernel"
  assert resolve_nf4_matmul("xla", wide, **fast) == "xla"
  assert resolve_nf4_matmul("kernel", huge, **fast) == "kernel"
  for cfg, changed in (
    (narrow, {}),
    (huge, {}),
    (wide, {"free": 16 * gib}),
    (wide, {"free": None}),
    (wide, {"quantized": False}),
    (wide, {"tokens": 1024}),
    (wide, {"tokens": 8 * 2048}),
    (wide, {"tokens": None}),
    (wide, {"method": "dpo"}),
    (wide, {"method": "grpo"}),
    (wide, {"devices": 2}),
    (wide, {"device": a100}),
    (wide, {"dtype": "float32"}),
  ):
    # Off the kernels for the run: on one Hopper GPU decoding's few tokens still take them.
    hopper = {**fast, **changed}["devices"] == 1 and "device" not in changed
    want = "few-tokens" if hopper else "xla"
    assert resolve_nf4_matmul(None, cfg, **{**fast, **changed}) == want, (cfg, changed)
  # resolve() on one device taken for a Hopper GPU: a call's tokens are the micro-batch's.
  monkeypatch.setattr(runtime, "on_hopper", lambda device: True)
  monkeypatch.setattr(
    runtime, "free_device_bytes", lambda limit=None: int(min(79, limit or 79) * gib)
  )
  cfg = wide
  one = jax.devices()[:1]
  run = RunConfig(dtype="bfloat16", seq_len=2048, batch_size=8)
  assert resolve(run, cfg, devices=one).runtime.nf4_matmul == "few-tokens"
  assert resolve(run.replace(grad_accum=4), cfg, devices=one).runtime.nf4_matmul == "kernel"
  assert (
    resolve(run.replace(grad_accum=4), cfg, devices=jax.devices()[:2]).runtime.nf4_matmul == "xla"
  )
  for other in (
    run.replace(grad_accum=4, method="dpo"),
    run.replace(grad_accum=4, memory_limit=16.0),
    run.replace(grad_accum=4, quantization=None),
  ):
    assert resolve(other, cfg, devices=one).runtime.nf4_matmul == "few-tokens", other


def test_the_margin_is_a_fraction_of_the_budget_and_at_most_a_few_gib():
  """8% of the budget, at most MARGIN_MOST (4 GiB, from 50 GiB up): a 16 GiB card keeps
  1.28 GiB free, an 80 GB H100's 75.2 GiB pool 4 GiB (not 6), a 141 GB H200's 4 GiB."""
  assert (plan.MARGIN_FRACTION, plan.MARGIN_MOST) == (0.08, 4 * GIB)
  for budget_gib, free_gib in ((16, 1.28), (50, 4), (75.2, 4), (132, 4)):
    budget = int(budget_gib * GIB)
    assert budget - plan.usable(budget) == pytest.approx(free_gib * GIB, abs=1), budget_gib
    assert plan.fits(budget - math.ceil(free_gib * GIB), budget)
    assert not plan.fits(budget - math.ceil(free_gib * GIB) + MIB, budget)
  # With a 75.2 GiB budget, a setting planning 70 GiB is taken (8% would have refused it).
  sizes = {**SIZES, (A, 0): 70 * GIB}
  fake = FakeStep(sizes)
  program, _ = plan.choose(fake.build, (), AUTO, (int(75.2 * GIB), "H100"))
  assert program.setting == (A, 0) and fake.compiled == [(A, 0)]
  assert 70 * GIB > 75.2 * GIB * (1 - plan.MARGIN_FRACTION)


@pytest.mark.parametrize(
  "budget_mib, chosen, compiled",
  [
    (1000, (A, 0), [(A, 0)]),
    (100, (A, C), [(A, 0), (A, C)]),  # 100 MiB leave no margin, 90 do
    # dots_no_batch is not tried once activations (leaner wherever measured) did not fit,
    # even where (as in these made-up sizes) it would have.
    (80, ("full", 0), [(A, 0), (A, C), ("full", 0)]),
    # lean and offload only with the logits in pieces (lean saves less than the pieces do)
    (42, ("lean", C), [(A, 0), (A, C), ("full", 0), ("full", C), ("lean", C)]),
    (35, ("offload", C), [(A, 0), (A, C), ("full", 0), ("full", C), ("lean", C), ("offload", C)]),
  ],
)
def test_the_first_setting_that_fits_is_compiled_once_and_kept(budget_mib, chosen, compiled):
  fake = FakeStep(SIZES)
  budget = budget_mib * MIB
  program, chosen_plan = plan.choose(fake.build, (), AUTO, (budget, "--memory-limit"))
  assert program.setting == chosen == (chosen_plan.runtime.remat, chosen_plan.runtime.loss_chunk)
  assert chosen_plan.runtime.candidates == ()
  assert fake.compiled == compiled  # nothing after the chosen one
  assert SIZES[chosen] <= plan.usable(budget)
  assert all(SIZES[s] > plan.usable(budget) for s in fake.compiled[:-1])
  assert chosen_plan.planned == SIZES[chosen]
  note = chosen_plan.note()
  assert note.startswith(f"auto: planned {SIZES[chosen] // MIB} MiB of {budget_mib} MiB"), note


def test_dots_no_batch_is_tried_when_activations_fits_no_better():
  """Only after activations (same chunk) was refused is dots_no_batch skipped: forced to
  start from dots_no_batch, it is compiled."""
  fake = FakeStep(SIZES)
  start = Runtime(remat="dots_no_batch", candidates=AUTO.candidates[2:])
  program, _ = plan.choose(fake.build, (), start, (80 * MIB, "test"))
  assert program.setting == ("dots_no_batch", C)


def test_a_chunked_twin_is_not_compiled_when_chunking_cannot_save_enough():
  fake = FakeStep(SIZES)
  # Logits of 2 MiB: chunking saves at most 8 MiB, so no chunked twin of a setting that misses
  # a 55 MiB budget (50.6 usable) by more is compiled.
  compiled, _ = plan.choose(fake.build, (), AUTO, (55 * MIB, "test"), logits_bytes=2 * MIB)
  assert compiled.setting == ("full", 0)
  assert fake.compiled == [("activations", 0), ("full", 0)]


def test_a_setting_whose_floor_misses_the_budget_is_not_compiled():
  """A floor found by tracing (plan.floor_bytes) refuses a setting without compiling it; the
  start line and the refusal say "at least" of a floor."""
  fake = FakeStep(SIZES)
  floors = {s: size // 2 for s, size in SIZES.items()}
  floors[("activations", 0)] = floors[("activations", C)] = 95 * MIB
  traced = []

  def floor(rt):
    traced.append((rt.remat, rt.loss_chunk))
    return floors[traced[-1]]

  program, chosen = plan.choose(fake.build, (), AUTO, (80 * MIB, "test"), floor=floor)
  assert program.setting == ("full", 0)
  assert fake.compiled == [("full", 0)]  # activations' floors of 95 MiB miss 73.6 MiB
  assert traced == [(A, 0), (A, C), ("full", 0)]  # dots_no_batch: dominated
  assert chosen.rejected == (("remat activations", 95 * MIB, False),
                             ("remat activations, loss chunk 1024", 95 * MIB, False))  # fmt: skip
  assert chosen.note() == (
    "auto: planned 50 MiB of 80 MiB (test), remat activations, loss chunk 1024 would need 95 MiB+"
  )
  with pytest.raises(UserError, match=r"the leanest setting tried, remat offload, loss chunk "
                     r"1024, needs at least 20 MiB per device; use --remat-group 2"):  # fmt: skip
    plan.choose(fake.build, (), AUTO, (12 * MIB, "test"), floor=lambda rt: 20 * MIB)


def test_nothing_fits_is_one_sentence_naming_the_leanest_and_the_levers():
  fake = FakeStep(SIZES)
  with pytest.raises(UserError) as e:
    plan.choose(fake.build, (), AUTO, (20 * MIB, "H100"))
  message = str(e.value)
  assert re.fullmatch(
    r"the training step does not fit the 20 MiB of device memory \(H100\): the leanest "
    r"setting tried, remat offload, loss chunk 1024, plans 30 MiB per device; use "
    r"--remat-group 2 \(with full, lean or offload\), lower --batch-size .* or --seq-len, or "
    r"split the model over more devices with --mesh\.",
    message,
  ), message
  forced = Runtime(remat="full", candidates=(("full", 0), ("full", AUTO_LOSS_CHUNK)))
  with pytest.raises(UserError, match=r"remat full, loss chunk 1024, plans 40 MiB per device; "
                     r"use --remat offload or --remat-group 2 \(with full, lean or offload\), "
                     r"lower --batch-size"):  # fmt: skip
    plan.choose(FakeStep(SIZES).build, (), forced, (20 * MIB, "H100"))
  grouped = forced.replace(remat_group=2)  # already in groups: not suggested again
  with pytest.raises(UserError, match=r"plans 40 MiB per device; use --remat offload, lower"):
    plan.choose(FakeStep(SIZES).build, (), grouped, (20 * MIB, "H100"))


@pytest.mark.parametrize(
  "budget_mib, chosen, compiled",
  [
    (220, (A, 0, "unrolled"), [(A, 0, "unrolled")]),
    (120, (A, 0), [(A, 0, "unrolled"), (A, 0)]),
    # for activations only, and not again in pieces once the scan with the logits whole missed
    (60, ("full", 0), [(A, 0, "unrolled"), (A, 0), (A, C), ("full", 0)]),
  ],
)
def test_activations_is_tried_with_its_layers_unrolled_first(budget_mib, chosen, compiled):
  sizes = {**SIZES, (A, 0, "unrolled"): 190 * MIB, (A, C, "unrolled"): 170 * MIB}
  fake = FakeStep(sizes)
  start = AUTO.replace(try_unrolled=True)
  program, chosen_plan = plan.choose(fake.build, (), start, (budget_mib * MIB, "H100"))
  assert program.setting == chosen and fake.compiled == compiled
  rt = chosen_plan.runtime
  assert rt.scan_layers == ("unrolled" not in chosen) and not rt.try_unrolled
  if len(compiled) > 1:  # the start line names what did not fit
    name, size, _ = chosen_plan.rejected[-1]
    assert size == sizes[compiled[-2]] and name.startswith("remat activations")
    assert name.endswith("layers unrolled") == ("unrolled" in compiled[-2])


def test_layers_are_not_unrolled_where_the_scans_floor_says_they_cannot_fit():
  """The unrolled loop planned 1.4-1.9x the scan's memory where measured: where
  UNROLLED_GROWTH times the scan's floor misses the budget, only the scan is compiled, also
  for a forced setting (one candidate: nothing else is checked against the budget)."""
  sizes = {**SIZES, (A, 0): 200 * MIB, (A, 0, "unrolled"): 260 * MIB}
  assert plan.UNROLLED_GROWTH == 1.3
  # 300 MiB: 276 usable. A floor of 215 MiB (x 1.3 = 279.5) skips the unrolled compile; one
  # of 190 (247) does not, and the unrolled loop (260) is taken.
  forced = Runtime(remat="activations", try_unrolled=True)
  for start in (AUTO.replace(try_unrolled=True), forced):
    for least, compiled in ((215, [(A, 0)]), (190, [(A, 0, "unrolled")])):
      fake = FakeStep(sizes)
      program, chosen = plan.choose(
        fake.build, (), start, (300 * MIB, "H100"), floor=lambda rt, least=least: least * MIB
      )
      assert fake.compiled == compiled and program.setting == compiled[-1], (start, least)
      # the start line says the unrolled loop was left out, and the size that left it out
      grown = math.ceil(plan.UNROLLED_GROWTH * 215 * MIB)
      skipped = ("remat activations, layers unrolled", grown, False)
      assert chosen.rejected == ((skipped,) if least == 215 else ()), (start, least)
      said = "layers unrolled would need 280 MiB+" in chosen.note()
      assert said == (least == 215), chosen.note()


def test_the_refusal_names_a_setting_that_was_tried_not_the_unrolled_loop_left_out():
  """Every plan misses; the unrolled loop's estimate (1.3 x the floor, 130 MiB) is the smallest
  figure, but it was never tried: the refusal names the leanest setting compiled."""
  sizes = {key: 150 * MIB + size for key, size in SIZES.items()}  # offload: 180 MiB
  start = AUTO.replace(try_unrolled=True)
  with pytest.raises(UserError) as refused:
    plan.choose(FakeStep(sizes).build, (), start, (120 * MIB, "H100"), floor=lambda rt: 100 * MIB)
  assert "remat offload, loss chunk 1024, plans 180 MiB per device" in str(refused.value)


def test_a_forced_activations_setting_takes_its_layers_unrolled_only_where_they_fit():
  """The budget picks the loop; the forced setting itself is not checked against it (as any
  single setting), so a scan that misses still runs."""
  sizes = {(A, 0): 100 * MIB, (A, 0, "unrolled"): 190 * MIB}
  forced = Runtime(remat="activations", try_unrolled=True)
  for budget, chosen in ((220, (A, 0, "unrolled")), (150, (A, 0)), (50, (A, 0))):
    fake = FakeStep(sizes)
    program, chosen_plan = plan.choose(fake.build, (), forced, (budget * MIB, "H100"))
    assert program.setting == chosen and chosen_plan.budget is None, budget
    missed = chosen != (A, 0, "unrolled")  # the start line says the unrolled loop's plan
    assert chosen_plan.note().endswith("layers unrolled would plan 190 MiB") == missed


@pytest.mark.parametrize(
  "budget_mib, kept, compiled",
  [
    # 73.6 MiB usable: 23.6 over full; the line from full (50) to activations (100 over 10
    # layers: 5 a layer) says 4 layers, which plan 74 (6 a layer): the line through that
    # plan says 3, which fit.
    (80, 3, [4, 3]),
    (120, None, []),  # activations fits: nothing kept
    (62, 1, [1]),  # 57.04 usable: the line says 1 layer (7.04 / 5), which plans 56
    (56, None, []),  # 51.5 usable: fewer than one layer in ten fits; full as it was
  ],
)
def test_full_keeps_the_activations_of_as_many_layers_as_fit(budget_mib, kept, compiled):
  """Where activations misses and full fits, full is tried again keeping the activations of
  its first k layers, k read off the straight line between the two plans (then once more
  off the line through the first try), and kept where it fits."""
  sizes = {**SIZES, **{("full", 0, "kept", k): 50 * MIB + 6 * k * MIB for k in range(1, 10)}}
  fake = FakeStep(sizes)
  start = AUTO.replace(keep_up_to=10)
  program, chosen = plan.choose(fake.build, (), start, (budget_mib * MIB, "H100"))
  assert [s[3] for s in fake.compiled if "kept" in s] == compiled
  rt = chosen.runtime
  if kept is None:
    assert rt.kept_layers == 0 and program.setting[:2] in ((A, 0), ("full", 0))
  else:
    assert rt.remat == "full" and rt.kept_layers == kept and program.setting[-1] == kept
    assert chosen.planned == sizes[("full", 0, "kept", kept)]
    assert rt.keep_up_to == 0 and rt.setting == f"full, activations kept in the first {kept} layers"
  forced = Runtime(remat="full", candidates=(("full", 0), ("full", C)), keep_up_to=10)
  fake = FakeStep(sizes)
  plan.choose(fake.build, (), forced, (80 * MIB, "H100"))
  assert fake.compiled == [("full", 0)]  # no activations plan to draw the line from


def test_kept_layers_from_a_refused_twin_at_the_fraction_floor_and_when_both_tries_miss():
  start = AUTO.replace(keep_up_to=10)
  # Activations in pieces refused without compiling (the whole plan less 4 logits of 2 MiB:
  # 92 MiB, a floor): that floor draws the line. 46 MiB usable: full whole (50) misses, full
  # in pieces (40) fits; (92 - 40) / 10 = 5.2 a layer, 6 MiB of room: 1 layer, planning 45.
  sizes = {**SIZES, ("full", C, "kept", 1): 45 * MIB}
  fake = FakeStep(sizes)
  program, chosen = plan.choose(fake.build, (), start, (50 * MIB, "H100"), logits_bytes=2 * MIB)
  assert fake.compiled == [(A, 0), ("full", 0), ("full", C), ("full", C, "kept", 1)]
  assert chosen.runtime.kept_layers == 1 and chosen.runtime.loss_chunk == C
  # 20 layers, 2.5 MiB a layer by the line, 2.99 MiB of room: one layer would fit, fewer than
  # MIN_KEPT_FRACTION (2 of 20): none is tried.
  fake = FakeStep(SIZES)
  program, chosen = plan.choose(fake.build, (), AUTO.replace(keep_up_to=20), (57.6 * MIB, "H100"))
  assert program.setting == ("full", 0) and not any("kept" in s for s in fake.compiled)
  # Every kept layer costs 20 MiB more than the line says: 4 layers plan 94, then (44 / 4 =
  # 11 a layer) 2 plan 82; both miss, full runs as it was, and the note names the last try.
  sizes = {**SIZES, **{("full", 0, "kept", k): (70 + 6 * k) * MIB for k in range(1, 10)}}
  fake = FakeStep(sizes)
  program, chosen = plan.choose(fake.build, (), start, (80 * MIB, "H100"))
  assert [s[3] for s in fake.compiled if "kept" in s] == [4, 2]
  assert program.setting == ("full", 0) and chosen.runtime.kept_layers == 0
  assert chosen.planned == 50 * MIB
  assert chosen.note().endswith(
    "remat full, activations kept in the first 2 layers would plan 82 MiB"
  )


def test_a_single_setting_is_compiled_without_a_budget_check():
  fake = FakeStep({("full", 0): 500 * MIB})
  compiled, chosen = plan.choose(fake.build, (), Runtime(remat="full"), (MIB, "test"))
  assert compiled.setting == ("full", 0) and chosen.budget is None
  assert chosen.note() == "planned 500 MiB"


def _scan_gradient():
  """A fresh jitted gradient of a 3-step scan that saves each step's input for its backward
  pass (fresh: JAX caches a function's lowering)."""

  def loss(w, x):
    def body(h, wi):
      return jax.numpy.tanh(h @ wi), None

    saving = jax.checkpoint(body, policy=jax.checkpoint_policies.everything_saveable)
    return jax.numpy.sum(jax.lax.scan(saving, x, w)[0])

  return jax.jit(jax.grad(loss))


def test_scan_outputs_start_unwritten_on_gpus_with_the_same_values():
  """The scan's stacked residuals come from AllocateBuffer in a GPU lowering (zeros without
  the context, and again after it), and the gradient is unchanged where it runs (CPU)."""
  w = jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4
  x = jax.random.normal(jax.random.key(1), (16, 16))

  def gpu_text(enabled):
    with plan.scan_outputs_unwritten(enabled):
      return _scan_gradient().trace(w, x).lower(lowering_platforms=("cuda",)).as_text()

  assert gpu_text(False).count("AllocateBuffer") == 0
  assert gpu_text(True).count("AllocateBuffer") >= 1  # the stack of saved inputs
  assert gpu_text(False).count("AllocateBuffer") == 0  # restored on exit
  with plan.scan_outputs_unwritten():
    unwritten = _scan_gradient()(w, x)
  np.testing.assert_array_equal(unwritten, _scan_gradient()(w, x))


def test_the_chosen_step_is_lowered_with_unwritten_scan_outputs(monkeypatch):
  made = []
  empty = jax.lax.empty
  monkeypatch.setattr(jax.lax, "empty", lambda *a, **k: made.append(a) or empty(*a, **k))
  w, x = jax.random.normal(jax.random.key(1), (3, 16, 16)) / 4, jax.numpy.ones((16, 16))
  compiled, _ = plan.choose(lambda rt: _scan_gradient(), (w, x), Runtime(remat="full"), (GIB, "t"))
  assert made and made[0][0][0] == 3  # a stack over the 3 steps
  np.testing.assert_array_equal(compiled(w, x), _scan_gradient()(w, x))


def test_the_plan_of_a_real_program_counts_what_it_holds():
  """planned_bytes of a real compiled program: its argument, output and temporaries."""
  x = jax.numpy.ones((256, 256))

  def compiled(stack: bool):
    def f(x):
      ys = [jax.numpy.tanh(x @ x + i) for i in range(8)]
      return jax.numpy.stack(ys) if stack else ys[-1]

    return jax.jit(f).lower(x).compile()

  one, eight = plan.planned_bytes(compiled(False)), plan.planned_bytes(compiled(True))
  assert one >= 2 * 256 * 256 * 4  # its argument and output
  assert eight >= one + 7 * 256 * 256 * 4  # seven more outputs


def test_the_command_lines_compile_cache_follows_its_settings(tmp_path, monkeypatch):
  names = ("dir", "max_size")
  saved = [getattr(jax.config, f"jax_compilation_cache_{n}") for n in names]
  saved.append(jax.config.jax_persistent_cache_min_compile_time_secs)
  try:
    monkeypatch.setenv(compile_cache.CACHE_VAR, str(tmp_path / "cache"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_MAX_SIZE", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    monkeypatch.delenv(step_store.STORE_VAR, raising=False)
    assert compile_cache.use_compile_cache(True) == tmp_path / "cache"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
    assert (
      step_store._store_dir == tmp_path / "cache" / step_store.STORE_NAME
    )  # whole steps beside it
    monkeypatch.setenv(step_store.STORE_VAR, "0")
    assert (
      compile_cache.use_compile_cache(True) == tmp_path / "cache" and step_store._store_dir is None
    )
    monkeypatch.delenv(step_store.STORE_VAR)
    # A size limit: jax then takes a file lock around every read and write of the cache.
    assert jax.config.jax_compilation_cache_max_size == compile_cache.CACHE_GIB * 2**30
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # small programs too
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.use_compile_cache(False) is None  # --no-compile-cache
    assert step_store._store_dir is None
    monkeypatch.setenv(compile_cache.CACHE_VAR, "")
    assert compile_cache.use_compile_cache(True) is None
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.delenv(compile_cache.CACHE_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.use_compile_cache(True) == tmp_path / "xdg" / "jaxtune" / "xla"
  finally:
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_compilation_cache_max_size", saved[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[2])


def test_a_damaged_cache_entry_is_removed_with_one_line(capsys):
  """A cache entry cut short (a run killed while writing it) warns and is compiled anew by
  jax, which never rewrites it: plan.choose removes it so the next run writes it whole."""
  directory = jax.config.jax_compilation_cache_dir
  if not directory:
    pytest.skip("the persistent compilation cache is off (JAXTUNE_TEST_COMPILE_CACHE=0)")
  x = jax.numpy.arange(7.0)

  def damaged_cache_probe(x):
    return jax.numpy.cumsum(x * 3.0) - 1.0

  expected = jax.jit(damaged_cache_probe)(x)
  entries = sorted(Path(directory).glob("jit_damaged_cache_probe-*-cache"))
  assert len(entries) == 1, entries
  entries[0].write_bytes(entries[0].read_bytes()[:40])
  jax.clear_caches()
  fake = FakeStep({("full", 0): MIB})
  with compile_cache.DamagedCacheEntries():
    got = jax.jit(damaged_cache_probe)(x)  # read from the damaged entry: jax warns
    plan.choose(fake.build, (), Runtime(remat="full"), (GIB, "test"))
  assert (got == expected).all()
  assert not list(Path(directory).glob("jit_damaged_cache_probe-*"))
  err = capsys.readouterr().err
  assert re.fullmatch(
    rf"jaxtune: the compilation cache {re.escape(directory)} held a damaged entry for "
    r"jit_damaged_cache_probe \(a run stopped while writing it\); compiled anew and removed "
    r"it\.\n",
    err,
  ), err


def _train(path, tmp_path, name, evaluate=False, **run_kw):
  """2 steps of the tiny model on one device; (losses, the plan the trainer announced, the
  trained model, its held-out loss when ``evaluate``)."""
  import jaxtune
  from jaxtune.data import rows as data
  from jaxtune.training import loop as trainer

  rng = np.random.default_rng(0)
  ids = rng.integers(0, 256, (8, 64)).astype(np.int32)
  rows = data.to_rows(list(ids), list(np.roll(ids, -1, axis=1)), 64, pack=False)
  run = RunConfig(
    out=str(tmp_path / name), steps=2, batch_size=8, learning_rate=1e-2, warmup_steps=0,
    dtype="float32", lora_rank=4, mesh="1", **run_kw,
  )  # fmt: skip
  (tmp_path / name).mkdir()
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4, seed=0)
  rt = resolver.resolve(run, model.config, devices=jax.devices()[:1])
  plans = []
  held_out = rows if evaluate else None
  model, history = trainer.train(model, rows, run, rt, eval_dataset=held_out, announce=plans.append)
  losses = np.array([h["loss"] for h in history])
  return losses, plans[0], model, history[-1].get("eval_loss")


@pytest.mark.slow
@pytest.mark.beside
def test_a_real_run_under_a_memory_limit_takes_a_leaner_setting_and_learns_the_same(
  tmp_path, monkeypatch
):
  from conftest import build_hf_llama

  from jaxtune.training import loop as trainer

  path = tmp_path / "llama"
  hf = build_hf_llama(3, num_hidden_layers=2)
  hf.save_pretrained(path)
  from flax import nnx

  import jaxtune

  lora = nnx.state(jaxtune.apply_lora(jaxtune.from_pretrained(path), rank=4), nnx.LoRAParam)
  lora_params = sum(x.size for x in jax.tree.leaves(lora))
  frozen_params = sum(p.numel() for p in hf.parameters())
  floors = {}
  floor = trainer._floor

  def recorded(*args):
    rt = args[6]  # _floor(graphdef, lora, opt_state, frozen, batch, key, runtime, objective)
    floors[rt.remat, rt.loss_chunk] = floor(*args)
    return floors[rt.remat, rt.loss_chunk]

  monkeypatch.setattr(trainer, "_floor", recorded)
  fast, fast_plan, fast_model, fast_eval = _train(path, tmp_path, "fast", True, remat="auto")
  assert (fast_plan.runtime.remat, fast_plan.runtime.loss_chunk) == ("activations", 0)
  assert fast_plan.budget_source == "host memory" and fast_plan.rejected == ()
  assert floors == {}  # against host memory no floor is traced: the first candidate compiles
  # Just less than the fastest setting needs with its margin.
  limit = fast_plan.planned / (1 - plan.MARGIN_FRACTION) * 0.98 / GIB
  assert limit < 50  # the margin is the fraction here, not MARGIN_MOST
  lean, lean_plan, _, _ = _train(path, tmp_path, "lean", remat="auto", memory_limit=limit)
  # The floor of the plan: above the arguments (the LoRA, its Adam moments, the frozen
  # weights, the batch) by the residuals, below the compiled plan.
  # (float32 weights, LoRA and its two Adam moments; the batch's ids and labels.)
  arguments = 4 * frozen_params + 3 * 4 * lora_params + 2 * 8 * 64 * 4
  assert arguments < floors["activations", 0] <= fast_plan.planned
  chosen = (lean_plan.runtime.remat, lean_plan.runtime.loss_chunk)
  assert chosen != ("activations", 0)
  assert lean_plan.rejected[0] == ("remat activations", fast_plan.planned, True)
  assert lean_plan.planned <= plan.usable(limit * GIB) < fast_plan.planned
  assert floors[chosen] <= lean_plan.planned
  assert floors["activations", 0] > floors["full", 0]  # it keeps more than layer inputs
  assert lean_plan.budget_source == "--memory-limit"
  # Remat and loss chunks change what is kept, not what is computed.
  assert fast[-1] < fast[0]
  np.testing.assert_allclose(lean, fast, rtol=2e-5)

  # --embeddings host: the step holds the rows of its batch in place of the embedding table,
  # and trains, evaluates and returns the same model.
  host, host_plan, host_model, host_eval = _train(
    path, tmp_path, "host", True, remat="activations", embeddings="host"
  )
  assert host_plan.runtime.host_embeddings
  hidden = hf.config.hidden_size
  table, batch_rows = hf.config.vocab_size * hidden * 4, 8 * 64 * hidden * 4
  assert fast_plan.planned - host_plan.planned >= table - batch_rows
  np.testing.assert_allclose(host, fast, rtol=1e-6)
  assert host_eval == pytest.approx(fast_eval, rel=1e-6)
  np.testing.assert_array_equal(
    np.asarray(host_model.embed_tokens.embedding[...]),
    hf.model.embed_tokens.weight.detach().numpy(),
  )
  for a, b in zip(jax.tree.leaves(nnx.state(host_model, nnx.LoRAParam)),
                  jax.tree.leaves(nnx.state(fast_model, nnx.LoRAParam)), strict=True):  # fmt: skip
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cli", ["train", "export", "generate"])
def test_the_command_lines_keep_xla_warnings_off_unless_asked(cli, monkeypatch):
  """Run as `python -m jaxtune.X`, each CLI sets TF_CPP_MIN_LOG_LEVEL=3 before jax loads (XLA
  warns while --remat auto compiles settings that do not fit, and prints banners such as
  "Very slow compile?" as errors), and keeps a user's value."""
  import runpy

  for value, expected in ((None, "3"), ("0", "0")):
    if value is None:
      monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    else:
      monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", value)
    monkeypatch.setattr("sys.argv", [cli, "--help"])
    with pytest.raises(SystemExit) as e, warnings.catch_warnings():
      # runpy's note that the module was imported before (by other tests) is expected here.
      warnings.simplefilter("ignore", RuntimeWarning)
      runpy.run_module(f"jaxtune.{cli}", run_name="__main__")
    assert e.value.code == 0
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == expected


@background_run("cli_import_child")
def _cli_import_child(directory, runs):
  """The child process of the test below, run beside the other tests."""
  root = Path(__file__).resolve().parents[2]
  return run_cli([sys.executable, "-c", _CLI_IMPORTS], cwd=root, timeout=300)


def test_the_command_line_imports_its_libraries_without_pytorch(cli_import_child):
  """The train CLI imports transformers (its tokenizer classes) and datasets with torch hidden,
  and leaves no trace of the hiding: datasets imports torch when it finds "torch" in
  sys.modules at all (its hashing of the tokenizer), so a run would fail."""
  proc = cli_import_child
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines()[-1] == "'absent' True True", proc.stdout[-500:]


_CLI_IMPORTS = (
  "import sys\n"
  "import importlib\n"
  "importlib.import_module('jaxtune.train')._start_devices_while_importing()\n"
  "import transformers\n"
  "print(repr(sys.modules.get('torch', 'absent')), 'datasets' in sys.modules,\n"
  "      'transformers.tokenization_utils_fast' in sys.modules\n"
  "      or 'transformers.tokenization_utils_tokenizers' in sys.modules)\n"
)


def _store_step(rt: Runtime, built: list, unique: bool = False):
  """A real jitted step whose program depends on the setting (its loss chunk enters it);
  ``unique``: and on how many were built before (never read from the compilation cache,
  whose programs the store does not keep on CPUs)."""
  built.append((rt.remat, rt.loss_chunk))
  count = len(built) * 1e-6 if unique else 0.0

  def step(w, x):
    return w + 0.5, {"loss": ((x @ w) ** 2).sum() + rt.loss_chunk + count}

  return jax.jit(step, donate_argnums=0)


def _store_args(devices, n=8):
  from jax.sharding import NamedSharding, PartitionSpec

  mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
  w = np.arange(16.0, dtype=np.float32).reshape(4, 4)
  w = jax.device_put(w, NamedSharding(mesh, PartitionSpec()))
  x = np.linspace(-1, 1, n * 4, dtype=np.float32).reshape(n, 4)
  return w, jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))


def test_a_step_read_back_from_the_compilation_cache_is_kept_in_the_store_off_cpus_only(
  tmp_path, monkeypatch
):
  """On the CPU, a program that JAX read back from its persistent compilation cache loses
  functions when it is serialized again (jax 0.11.2: "Function ... not found" when the copy
  runs; shown below): there the store keeps only the steps compiled in the process, and a
  run that read its step from the cache trains on that step as it was read. Elsewhere (on
  an H100 such programs loaded and ran right: experiments/log/RESULTS-2026-11.md) it keeps
  them."""
  if jax.config.jax_compilation_cache_dir is None:
    pytest.skip("the persistent compilation cache is off (JAXTUNE_TEST_COMPILE_CACHE=0)")
  from jax.experimental import serialize_executable

  devices = jax.devices()[:1]
  unique = AUTO.replace(remat="full", loss_chunk=9173, candidates=())  # a program of its own
  choose = lambda: plan.choose(lambda rt: _store_step(rt, []), _store_args(devices), unique,  # noqa: E731
                               (GIB, "test"), identity="step")  # fmt: skip
  monkeypatch.setattr(step_store, "_store_dir", None)
  fresh, _ = choose()  # compiled here, and written to the compilation cache
  monkeypatch.setattr(step_store, "_store_dir", tmp_path / "steps")
  cached, chosen = choose()  # read back from the cache
  assert (
    chosen.cache_hits > 0 and cached in step_store.FROM_CACHE and fresh not in step_store.FROM_CACHE
  )
  assert not list((tmp_path / "steps").glob("*.step"))
  want = np.asarray(fresh(*_store_args(devices))[1]["loss"])
  np.testing.assert_array_equal(np.asarray(cached(*_store_args(devices))[1]["loss"]), want)
  # What the store would have read back (where a jax release mends this, the test fails here:
  # step_store.FROM_CACHE can then go):
  copy = serialize_executable.deserialize_and_load(
    *serialize_executable.serialize(cached), execution_devices=devices
  )
  with pytest.raises(jax.errors.JaxRuntimeError, match="not found"):
    np.asarray(copy(*_store_args(devices))[1]["loss"])
  # Off a CPU the same read-back program is kept.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  again, chosen = choose()
  assert chosen.cache_hits > 0 and again in step_store.FROM_CACHE
  assert len(list((tmp_path / "steps").glob("*.step"))) == 1


def test_the_step_store_reads_a_chosen_step_back_without_tracing_or_choosing(
  tmp_path, monkeypatch, capsys
):
  """A command line's chosen step is kept whole (step_store.StepStore): the next process with the
  same key gets the same program and plan without building, tracing or choosing; any part
  of the key that differs compiles anew; a damaged entry is removed with one line."""
  store = tmp_path / "steps"
  monkeypatch.setattr(step_store, "_store_dir", store)
  devices = [jax.devices()[5], jax.devices()[3]]  # a device order of its own: kept exactly
  budget = (GIB, "test")
  # The fastest setting refused by its floor: the plan keeps what was refused and why.
  floor = lambda rt: 2 * GIB if rt.remat == "activations" else 0  # noqa: E731
  built: list = []

  def choose(identity="step", args=None, runtime=AUTO, budget=budget, floor=floor):
    args = _store_args(devices) if args is None else args
    return plan.choose(lambda rt: _store_step(rt, built, True), args, runtime, budget, 0, floor,
                       identity)  # fmt: skip

  first, first_plan = choose()
  assert built == [("full", 0)] and not first_plan.stored
  assert len(list(store.glob("*.step"))) == 1

  def refuse(rt):
    raise AssertionError("the stored step was built again")

  second, second_plan = choose(floor=refuse)
  assert built == [("full", 0)] and second_plan.stored and second_plan.from_cache
  assert second_plan.runtime == first_plan.runtime and second_plan.runtime.candidates == ()
  assert (second_plan.planned, second_plan.budget) == (first_plan.planned, GIB)
  assert second_plan.rejected == first_plan.rejected
  assert first_plan.rejected[0] == ("remat activations", 2 * GIB, False)
  assert second_plan.note() == first_plan.note()
  args = _store_args(devices)
  want_w, want = first(*_store_args(devices))
  got_w, got = second(*args)
  assert args[0].is_deleted()  # the donation is part of the program
  np.testing.assert_array_equal(np.asarray(got_w), np.asarray(want_w))
  assert float(got["loss"]) == float(want["loss"])
  assert got_w.sharding == want_w.sharding

  # Anything of the key that differs: a step built, and kept beside the first.
  choose(identity="another step")
  choose(budget=(2 * GIB, "test"))
  choose(args=_store_args(devices, n=16))
  choose(args=_store_args(devices[::-1]))
  choose(runtime=Runtime(remat="full"))
  assert len(built) == 6 and len(list(store.glob("*.step"))) == 6
  choose(identity=None)  # no identity: not kept
  assert len(built) == 7 and len(list(store.glob("*.step"))) == 6

  # A damaged entry: never unpickled (its HMAC fails), kept aside with one line, compiled
  # anew and kept again.
  entry = max(store.glob("*.step"), key=lambda p: p.stat().st_mtime_ns)  # remat full's
  data = bytearray(entry.read_bytes())
  data[len(data) // 2] ^= 0xFF
  entry.write_bytes(bytes(data))
  capsys.readouterr()
  choose(runtime=Runtime(remat="full"))
  assert len(built) == 8 and entry.exists()  # kept again, whole
  refused = entry.with_name(entry.name + ".refused")
  assert refused.read_bytes() == bytes(data)
  err = capsys.readouterr().err
  assert re.fullmatch(
    rf"jaxtune: the step store entry {re.escape(str(entry))} was not read \(it is not signed "
    r"by this user's key: written by someone else, or damaged\); kept as [^\n]+\.refused, and "
    r"the step compiled anew\.\n",
    err,
  ), err
  choose(runtime=Runtime(remat="full"))
  assert len(built) == 8

  # At most STORE_ENTRIES, the least recently used removed first.
  monkeypatch.setattr(step_store, "STORE_ENTRIES", 2)
  os.utime(entry, (1, 1))
  choose(identity="a third step")
  kept = list(store.glob("*.step"))
  assert len(kept) == 2 and entry not in kept


class _Planted:
  """A pickle that, when loaded, creates ``marker``: what an adversary plants in a cache."""

  def __init__(self, marker: Path):
    self.marker = marker

  def __reduce__(self):
    return (open, (str(self.marker), "w"))


def test_a_planted_pickle_in_the_step_store_is_never_loaded(tmp_path, monkeypatch, capsys):
  """Whatever another user could have written is never unpickled: not a bare pickle, not an
  entry in the store's format signed without this user's key, not a real entry in a store (or
  a cache) that others can write, not an entry file others can write; each is refused with
  one line, kept aside, and the step compiled anew."""
  import pickle

  cache = tmp_path / "cache"
  store = cache / step_store.STORE_NAME
  monkeypatch.setattr(step_store, "_store_dir", store)
  devices = [jax.devices()[0]]
  built: list = []

  def choose():
    return plan.choose(lambda rt: _store_step(rt, built, True), _store_args(devices),
                       Runtime(remat="full"), (GIB, "test"), identity="planted")  # fmt: skip

  choose()
  (entry,) = store.glob("*.step")
  real = entry.read_bytes()
  assert (store / step_store.KEY_NAME).stat().st_mode & 0o777 == 0o600
  marker = tmp_path / "pwned"
  bare = pickle.dumps(_Planted(marker))
  # The store's own format around the payload, signed with a key the planter guessed.
  forged = step_store._entry_bytes({"plan": [], "devices": [0]}, bare, b"\0" * 32)
  for planted in (bare, forged):
    entry.write_bytes(planted)
    capsys.readouterr()
    choose()
    assert not marker.exists()
    assert entry.with_name(entry.name + ".refused").read_bytes() == planted
    assert "was not read" in capsys.readouterr().err
  assert len(built) == 3

  # A real entry of this user's, in places others can write: not read either.
  for place, mode in ((store, 0o777), (entry, 0o666), (store / step_store.KEY_NAME, 0o644)):
    entry.write_bytes(real)
    entry.chmod(0o600)
    place.chmod(mode)
    choose()
    place.chmod(0o700 if place == store else 0o600)
    assert entry.with_name(entry.name + ".refused").read_bytes() == real
  assert len(built) == 6  # each compiled anew
  choose()  # (with the key refused the last one was not kept)
  choose()
  assert len(built) == 7  # kept in a private store again, and read back

  # The compilation cache itself in a shared directory: off, with one line.
  shared = tmp_path / "shared"
  shared.mkdir(mode=0o777)
  shared.chmod(0o777)
  saved = jax.config.jax_compilation_cache_dir
  try:
    monkeypatch.setenv(compile_cache.CACHE_VAR, str(shared))
    capsys.readouterr()
    assert compile_cache.use_compile_cache(True) is None and step_store._store_dir is None
    assert jax.config.jax_compilation_cache_dir is None
    err = capsys.readouterr().err
    assert re.fullmatch(
      rf"jaxtune: the compilation cache is off for this run: {re.escape(str(shared))} is "
      r"writable by others \(mode 777\)[^\n]+\.\n",
      err,
    ), err
  finally:
    jax.config.update("jax_compilation_cache_dir", saved)


def test_the_step_store_keeps_no_program_with_host_callbacks(tmp_path, monkeypatch):
  """A program calling back into this process (an interpreted Pallas kernel does) cannot be
  read back by another: it is not kept."""
  monkeypatch.setattr(step_store, "_store_dir", tmp_path)

  def build(rt):
    return jax.jit(lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct((3,), np.float32), x))

  x = jax.numpy.ones(3)
  plan.choose(build, (x,), Runtime(remat="full"), (GIB, "test"), identity="callback")
  assert list(tmp_path.iterdir()) == []


def test_the_step_store_key_follows_the_source_of_every_package_a_step_runs(tmp_path, monkeypatch):
  """A change to the code a step runs (jaxtune, its kernels in pallas_kernels, converters)
  changes the store's key: a stale program is never read back."""
  assert set(step_store.SOURCE_PACKAGES) >= {"jaxtune", "pallas_kernels"}
  package = tmp_path / "storekeyprobe"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "kernel.py").write_text("BLOCK = 64\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(step_store, "SOURCE_PACKAGES", (*step_store.SOURCE_PACKAGES, "storekeyprobe"))
  keys = []
  for text in ("BLOCK = 64\n", "BLOCK = 128\n", "BLOCK = 64\n"):
    (package / "kernel.py").write_text(text)
    step_store._environment.cache_clear()
    keys.append(step_store._environment())
  step_store._environment.cache_clear()
  assert keys[0] != keys[1] and keys[0] == keys[2]


def test_the_step_identity_names_every_setting_that_reaches_the_step():
  """trainer._step_identity (the store's key besides arguments and runtime): the schedule's
  kind, the adapters' settings, the objective's fields and the loss scale change it; where
  the run writes, how often it saves and the optimizer's numbers (the step's argument) do
  not; a function from outside jaxtune gives no identity at all."""
  from jaxtune.models.config import ModelConfig
  from jaxtune.training import loop as trainer
  from jaxtune.training import preference, step

  config = ModelConfig("llama", 64, 16, 32, 2, 2, 1, 8)
  model = SimpleNamespace(config=config)
  run = RunConfig(out="a")

  def identity(run=run, objective=step.sft_objective, scale=None):
    return trainer._step_identity("graphdef", model, run, objective, scale, None)

  base = identity()
  assert base is not None
  assert identity(run.replace(out="b", save_every=7, report_to="none")) == base
  numbers = dict(learning_rate=1e-3, steps=99, epochs=2.0, warmup_steps=9, weight_decay=0.1)
  assert identity(run.replace(**numbers, max_grad_norm=0.5)) == base
  for changed in (dict(schedule="linear"), dict(lora_alpha=32.0), dict(grad_accum=2)):
    assert identity(run.replace(**changed)) != base, changed
  dpo = preference.Preference("dpo", beta=0.1)
  assert identity(objective=dpo) != base
  assert identity(objective=dpo) != identity(objective=preference.Preference("dpo", beta=0.2))
  assert identity(scale=step.LossScale()) != identity(scale=step.LossScale(period=10))
  assert identity(objective=lambda *a: None) is None

"""The NF4 kernel's operands made once for a loop of calls (a decode loop): its scales, its
codes in the order its faster lookups read (a copy where it fits, else the model's own codes
permuted in place and put back), and the layers of one input (q/k/v, gate/up) fused into one
launch (``layers.Fused``). The run's plan decides which (``Decode``, run.choices.resolve_decode);
decoding makes them (``loop_codes``, ``prepare_kernel_operands``); the training step makes its
own (``step.kernel_operands``).
"""

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.models.blocks import MLP, Attention
from jaxtune.models.layers import Fused, call_impl
from jaxtune.models.lora import iter_linears
from jaxtune.parallel.runtime import Decode
from pallas_kernels.nf4_matmul import kernel_scales, word_codes

# Linear layers of one input whose frozen products a decode loop computes in one kernel
# launch (layers.Fused): (module class, its attribute for the Fused, the layers' names).
FUSED = (
  (Attention, "qkv_fused", ("q_proj", "k_proj", "v_proj")),
  (MLP, "gate_up_fused", ("gate_proj", "up_proj")),
)


def _kernel_plan(
  model: nnx.Module,
  tokens: int,
  word: bool,
  every: bool = False,
  fuse: bool = True,
  nf4_matmul: str = "xla",
):
  """What ``prepare_kernel_operands`` makes: ([(module, attribute, linears)] to fuse, [linear]
  that go through the kernel alone): the layers whose calls of ``tokens`` rows the kernel
  computes under ``nf4_matmul`` (``Decode.nf4_matmul``: "few-tokens" those of the shapes it
  pays on, ``layers.call_impl``). Groups fuse only with ``word`` (their codes are copied
  anyway) and ``fuse``, where the fused weight goes through the kernel. ``every``: as if every
  NF4 layer did (tests, on a machine without the GPU kernel)."""

  def uses(t: int, w: int) -> bool:
    return every or call_impl(nf4_matmul, t, w) != "xla"

  groups, fused = [], set()
  if word is True and fuse:  # a copy of the codes is made anyway (not "inplace")
    for _, node in nnx.iter_graph(model):
      for cls, attr, names in FUSED:
        if not isinstance(node, cls):
          continue
        linears = [getattr(node, name) for name in names]
        k = linears[0].in_features
        if all(lin.quantized and lin.in_features == k for lin in linears) and uses(
          tokens, k * sum(lin.out_features for lin in linears)
        ):
          groups.append((node, attr, linears))
          fused.update(id(lin) for lin in linears)
  alone = [
    lin
    for _, lin in iter_linears(model)
    if lin.quantized and id(lin) not in fused and uses(tokens, lin.in_features * lin.out_features)
  ]
  return groups, alone


def prepare_kernel_operands(
  model: nnx.Module,
  tokens: int,
  word: bool | str = False,
  every: bool = False,
  fuse: bool = True,
  nf4_matmul: str = "xla",
) -> int:
  """Give every NF4 linear layer whose calls of ``tokens`` rows go through the Pallas kernel
  its kernel scales (2 bytes per 64 weights) and, with ``word`` True, its codes in the "word"
  lookup's order (as many bytes as the codes), made now (in a jitted loop: once, outside
  it); ``word`` "inplace": the layers' own codes are in that order already
  (``codes_in_word_order``), no copy. With ``word`` True, layers of one input (q/k/v,
  gate/up) get one ``layers.Fused`` instead, one launch for all of them (``fuse`` False: each
  alone, for comparison). ``every``, ``nf4_matmul``: see ``_kernel_plan``. Returns how many
  kernel launches a layer stack's token step has (fused groups count once)."""
  groups, alone = _kernel_plan(model, tokens, word, every, fuse, nf4_matmul)
  for module, attr, linears in groups:
    codes = jnp.concatenate([lin.codes[...] for lin in linears], axis=-2)
    scales = jnp.concatenate([_scales(lin) for lin in linears], axis=-1)
    sizes = tuple(lin.out_features for lin in linears)
    setattr(module, attr, Fused(word_codes(codes), scales, sizes))
  for linear in alone:
    linear.kernel_scales = nnx.data(_scales(linear))
    if word == "inplace":
      linear.kernel_codes = nnx.data(linear.codes[...])
    elif word:
      linear.kernel_codes = nnx.data(word_codes(linear.codes[...]))
  return len(groups) + len(alone)


@functools.partial(jax.jit, donate_argnums=0)
def _swap_word_order(codes: jax.Array) -> jax.Array:
  """``word_codes``'s permutation (a transpose within every 16 bytes: its own inverse) of
  ``codes``, in its own buffer: a layer stack one layer at a time, so the only temporary is
  one layer's codes."""
  if codes.ndim == 2:
    return word_codes(codes)

  def one_layer(i, c):
    layer = jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(c, word_codes(layer), i, 0)

  return jax.lax.fori_loop(0, codes.shape[0], one_layer, codes)


@contextlib.contextmanager
def codes_in_word_order(
  model: nnx.Module, tokens: int, every: bool = False, nf4_matmul: str = "xla"
) -> Iterator[int]:
  """Within the block, the codes of every NF4 layer whose calls of ``tokens`` rows go through
  the Pallas kernel are in its "word" order, permuted in their own buffers (no copy: for
  models with no room for ``word_codes``' copy, 70B on one GPU) and put back on the way out.
  The old arrays are donated: whatever else holds them (a trainer's frozen state) loses
  them, so only a caller that owns the model may use this. Calls that do not reach the
  kernel (XLA's path) read the codes back in their order (``nf4_matmul(word_codes=)``).
  Yields how many layers were permuted. ``every``, ``nf4_matmul``: see ``_kernel_plan``."""
  _, alone = _kernel_plan(model, tokens, word="inplace", every=every, nf4_matmul=nf4_matmul)
  done = []  # put back on the way out, also when a later layer fails to permute
  try:
    for linear in alone:
      linear.codes.set_value(_swap_word_order(linear.codes.get_value()))
      done.append(linear)
    yield len(alone)
  finally:
    for linear in done:
      linear.codes.set_value(_swap_word_order(linear.codes.get_value()))


def _scales(linear) -> jax.Array:
  return kernel_scales(linear.absmax[...], linear.nested_absmax[...], linear.offset[...])


def loop_codes(
  model: nnx.Module, tokens: int, stack: contextlib.ExitStack, decode: Decode
) -> bool | str:
  """The codes a decode loop of ``tokens`` rows gives the NF4 kernel (``prepare_kernel_operands``'
  ``word``), as the run's plan says (``decode.word_codes``, run.choices.resolve_decode): True
  a word-order copy; "inplace" the model's own codes permuted (``codes_in_word_order``,
  entered on ``stack``: put back when it closes; False where no layer's calls reach the
  kernel); False neither."""
  word = decode.word_codes
  if word == "inplace":
    permuted = codes_in_word_order(model, tokens, nf4_matmul=decode.nf4_matmul)
    word = "inplace" if stack.enter_context(permuted) else False
  return word

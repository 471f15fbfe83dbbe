"""Putting a checkpoint's tensors onto the devices: one buffer per model variable, filled one
tensor (one layer slice) at a time, NF4-quantized on the way in where the model is NF4.

Every distinct weight shape compiles once; the stacked buffers are updated in place (donated),
with the layer index a traced argument. The one host round trip of NF4 (the mean of absmax,
computed in float64 on the host so the bytes match bitsandbytes') is started asynchronously
and finished a few tensors later. Under a mesh a tensor crosses from the host split over the
devices (``sharding.incoming``) and is gathered into its variable's own layout on them.
"""

import collections
import functools
import itertools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from converters import bnb
from converters.safetensors_read import CheckpointError
from jaxtune.parallel import sharding
from pallas_kernels import nf4

if TYPE_CHECKING:
  from flax import nnx

# A tensor over twice this size goes to the device in row pieces of about this size, two at a
# time: the runtime stages each host-to-device copy in pinned host memory that it keeps, so a
# 1 GiB embedding sent whole would hold 1 GiB of host memory beyond the file's own buffer
# (Llama-3.1-8B on an H100: peak host RSS +3.4 GiB over idle whole, +1.7 GiB in pieces).
PUT_PIECE_BYTES = 128 << 20


def put_in_pieces(
  tensor: np.ndarray, device: jax.Device, piece_bytes: int = PUT_PIECE_BYTES
) -> jax.Array:
  """``jax.device_put(tensor, device)``; a tensor over two pieces goes a few rows at a time,
  at most two pieces in flight, joined on the device."""
  if tensor.nbytes <= 2 * piece_bytes or tensor.ndim == 0 or tensor.shape[0] < 2:
    return jax.device_put(tensor, device)
  rows = max(1, piece_bytes // (tensor.nbytes // tensor.shape[0]))
  pieces = []
  for start in range(0, tensor.shape[0], rows):
    if len(pieces) >= 2:
      pieces[-2].block_until_ready()
    pieces.append(jax.device_put(tensor[start : start + rows], device))
  return jnp.concatenate(pieces)


# Quantized weights whose host mean may still be outstanding: the device keeps this many
# tensors of work queued while the host waits for the oldest one's absmax.
_MEAN_LAG = 4
_NF4_FIELDS = ("codes", "absmax", "nested_absmax", "offset")


class DeviceBuffers:
  """Device buffers for every variable, filled one tensor (one layer slice) at a time."""

  def __init__(self, variables: dict, mesh: Mesh | None):
    self.variables = variables
    self.mesh = mesh
    self.filled: dict[tuple, set] = {path: set() for path in variables}
    # (target, layer, float32 absmax on its way to the host) awaiting the second NF4 stage.
    self.pending: collections.deque = collections.deque()
    # All layer-stacked buffers at once, zero-filled by one compiled program.
    stacked = [path for path, var in variables.items() if _stacked(var)]
    specs = tuple(
      (variables[p].get_value().shape, variables[p].get_value().dtype, self._sharding(p))
      for p in stacked
    )
    self.buffers: dict[tuple, jax.Array] = dict(zip(stacked, _zeros(specs), strict=True))

  def _sharding(self, path, drop=0, shape=None):
    return sharding.sharding_for(*self._axes_shape(path, drop, shape), self.mesh)

  def _axes_shape(self, path, drop=0, shape=None):
    """(axes, shape) of a variable, or of its part past the ``drop`` leading (stacked) dims."""
    var = self.variables[path]
    value = var.get_value()
    axes = tuple(var.get_metadata().get("axes") or (None,) * value.ndim)[drop:]
    if shape is None:
      shape = value.shape[drop:]
    return axes, tuple(shape)

  def _incoming(self, path, drop=0, shape=None):
    """Where a tensor from the file goes first (sharding.incoming)."""
    _, shape = self._axes_shape(path, drop, shape)
    return sharding.incoming(self._sharding(path, drop, shape), shape)

  def _write(self, path, layer, value, hf_name: str):
    """Place one tensor (numpy from the file, or a jax array) into its variable's buffer:
    ``layer`` a layer index, or (layer, expert) for one expert's part of a stacked variable,
    or None for an unstacked one."""
    var = self.variables[path]
    abstract = var.get_value()
    index = _index(layer)
    stacked = bool(index)
    expected = abstract.shape[len(index) :]
    if tuple(value.shape) != tuple(expected):
      raise CheckpointError(
        f"tensor {hf_name} has shape {tuple(value.shape)}, but config.json implies "
        f"{tuple(expected)}; the checkpoint and config do not belong together."
      )
    if isinstance(value, np.ndarray) and value.dtype.itemsize > 4:
      value = value.astype(abstract.dtype)  # float64: round once, here, not via float32
    # Copied as stored and cast on the device: no host-side conversion of a whole tensor.
    value = jax.device_put(value, self._incoming(path, drop=len(index)))
    if stacked:
      buffer = self.buffers[path]
      self.buffers[path] = _set_layer(buffer, value, _traced(index), buffer.sharding)
    else:  # gathered over the devices' links into the variable's own layout
      self.buffers[path] = jax.device_put(value.astype(abstract.dtype), self._sharding(path))
    self._fill(path, index)

  def _fill(self, path, index: tuple) -> None:
    """Mark ``index`` (and every cell of the stacked dims it leaves open) as written."""
    lead = _lead(self.variables[path])
    shape = self.variables[path].get_value().shape[len(index) : lead]
    if not lead:
      self.filled[path].add(None)
      return
    for rest in itertools.product(*map(range, shape)):
      self.filled[path].add((*index, *rest))

  def put(
    self,
    hf_name: str,
    target: tuple[str, ...],
    layer: int | None,
    tensor: np.ndarray | jax.Array,
  ) -> None:
    path = tuple(target)
    if path not in self.variables:
      raise CheckpointError(f"tensor {hf_name} has no place in this model's configuration.")
    self._write(path, layer, tensor, hf_name)

  def put_linear(
    self,
    hf_name: str,
    target: tuple[str, ...],
    layer: int | None,
    tensor: np.ndarray | jax.Array | None,
    quantized: bool,
    prequantized: tuple[nf4.NF4Quantized, tuple[int, int]] | None = None,
  ) -> None:
    """A Linear's weight: dense ``tensor``, or ``prequantized`` = (flat NF4, [out, in]) from a
    bnb-4bit file, whose bytes are kept as they are when the model is NF4 too."""
    if not quantized or target == ("lm_head",):
      if prequantized is not None:
        q, shape = prequantized
        tensor = nf4.dequantize(q, shape, jnp.float32)
      self.put(hf_name, (*target, "weight"), layer, tensor)
      return
    codes_path = (*target, "codes")
    if codes_path not in self.variables:
      raise CheckpointError(f"tensor {hf_name} has no place in this model's configuration.")
    out_features, half = self.variables[codes_path].get_value().shape[-2:]
    expected = (out_features, half * 2)
    index = _index(layer)
    shape = prequantized[1] if prequantized is not None else tuple(tensor.shape)
    if tuple(shape) != expected:
      raise CheckpointError(
        f"tensor {hf_name} has shape {tuple(shape)}, but config.json implies "
        f"{expected}; the checkpoint and config do not belong together."
      )
    if prequantized is not None:
      q = bnb.linear_layout(prequantized[0], out_features)
      for field, value in zip(_NF4_FIELDS, q, strict=True):
        self._write((*target, field), layer, value, hf_name)
      return
    nf4.check_linear_shape(expected)
    if not index:
      w = jax.device_put(tensor, self._sharding(codes_path, shape=expected))
      for field, value in zip(_NF4_FIELDS, nf4.quantize_linear(w), strict=True):
        self._write((*target, field), layer, value, hf_name)
      return
    drop = len(index)
    w = jax.device_put(tensor, self._incoming(codes_path, drop=drop, shape=expected))
    buffer = self.buffers[codes_path]
    # absmax in the weight's own layout (whole over data), for the host mean to read.
    blocks = (expected[0], expected[1] // nf4.BLOCKSIZE)
    absmax_at = self._sharding(codes_path, drop=drop, shape=blocks)
    codes, absmax = _quantize_into(buffer, w, _traced(index), buffer.sharding, absmax_at)
    self.buffers[codes_path] = codes
    self._fill(codes_path, index)
    absmax.copy_to_host_async()
    self.pending.append((target, index, absmax))
    while len(self.pending) > _MEAN_LAG:
      self._double_quantize(*self.pending.popleft())

  def _double_quantize(self, target, index, absmax):
    """Second NF4 stage of one layer's (one expert's) weight, once its absmax has reached the
    host."""
    offset = nf4.host_mean(absmax)
    paths = [(*target, field) for field in _NF4_FIELDS[1:]]
    buffers = tuple(self.buffers[path] for path in paths)
    shardings = tuple(buffer.sharding for buffer in buffers)
    updated = _double_quantize_into(buffers, absmax, offset, _traced(index), shardings)
    for path, buffer in zip(paths, updated, strict=True):
      self.buffers[path] = buffer
      self._fill(path, index)

  def finish(self) -> None:
    """Complete every quantization still waiting for its host mean."""
    while self.pending:
      self._double_quantize(*self.pending.popleft())

  def missing(self) -> list[str]:
    out = []
    for path, var in self.variables.items():
      lead = var.get_value().shape[: _lead(var)]
      want = set(itertools.product(*map(range, lead))) if lead else {None}
      if not want <= self.filled[path]:
        out.append(".".join(path))
    return out

  def state(self) -> list[tuple[tuple, "nnx.Variable"]]:
    return [(path, var.replace(self.buffers[path])) for path, var in self.variables.items()]


def _stacked(var) -> bool:
  return _lead(var) > 0


# The leading dims a stacked variable is filled by: its layers, then its experts.
_STACKED_AXES = ("layers", "experts")


def _lead(var) -> int:
  axes = tuple(var.get_metadata().get("axes") or ())
  n = 0
  while n < len(axes) and n < len(_STACKED_AXES) and axes[n] == _STACKED_AXES[n]:
    n += 1
  return n


def _index(layer) -> tuple:
  """() for an unstacked variable, (layer,) or (layer, expert)."""
  if layer is None:
    return ()
  return tuple(layer) if isinstance(layer, tuple) else (layer,)


def _traced(index: tuple) -> tuple:
  return tuple(np.int32(i) for i in index)


def _zeros(specs: tuple) -> tuple[jax.Array, ...]:
  """Zero arrays for ((shape, dtype, sharding), ...), created where they live."""
  return _zeros_program(specs)() if specs else ()


@functools.cache
def _zeros_program(specs: tuple):
  return jax.jit(
    lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype, _ in specs),
    out_shardings=tuple(out_sharding for *_, out_sharding in specs),
  )


def _update(buffer: jax.Array, value: jax.Array, index: tuple, out_sharding) -> jax.Array:
  """``buffer`` with ``value`` written at the leading ``index`` (a layer, or layer and
  expert). The buffer keeps the layout its variable declares, whatever layout the value has."""
  value = value.astype(buffer.dtype).reshape((1,) * len(index) + value.shape)
  start = (*index, *(np.int32(0),) * (buffer.ndim - len(index)))
  updated = jax.lax.dynamic_update_slice(buffer, value, start)
  return jax.lax.with_sharding_constraint(updated, out_sharding)


# Buffers are donated, so each update writes in place; the layer index is traced, so one
# compiled program serves every layer of a shape. ``out_sharding``: the buffer's own.
@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _set_layer(buffer: jax.Array, value: jax.Array, layer, out_sharding) -> jax.Array:
  return _update(buffer, value, layer, out_sharding)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=(3, 4))
def _quantize_into(codes_buffer: jax.Array, w: jax.Array, layer, out_sharding, absmax_sharding):
  """First NF4 stage of one layer's weight [out, in], codes written into the stacked buffer;
  returns the buffer and the float32 absmax [out, in / 64] laid out as ``absmax_sharding``."""
  codes, absmax = nf4.quantize_linear_4bit(w)
  absmax = jax.lax.with_sharding_constraint(absmax, absmax_sharding)
  return _update(codes_buffer, codes, layer, out_sharding), absmax


@functools.partial(jax.jit, donate_argnums=0, static_argnums=4)
def _double_quantize_into(buffers: tuple, absmax: jax.Array, offset, layer, out_shardings):
  """Second NF4 stage, its (absmax, nested_absmax, offset) written into the stacked buffers."""
  values = nf4.double_quantize_linear(absmax, offset)
  return tuple(map(_update, buffers, values, (layer,) * 3, out_shardings))

"""``--mesh`` strings -> a ``jax.sharding.Mesh`` with axes (data, tensor, pipe, context).

"8"                          data=8
"2x4"                        data=2, tensor=4
"2x2x2"                      data=2, tensor=2, pipe=2 (pipeline stages: see pipeline.py)
"2x1x1x4"                    data=2, context=4 (each sequence's tokens split 4 ways:
                             ring attention, see context.py)
"data=2,tensor=4"            explicit (``pipeline`` is accepted for ``pipe``)
"""

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxtune.errors import MeshError
from jaxtune.parallel import pipeline

AXES = ("data", "tensor", "pipe", "context")


def parse_mesh(spec: str | None, num_devices: int) -> dict[str, int]:
  """Axis sizes from a mesh string; None means all devices data-parallel."""
  sizes = dict.fromkeys(AXES, 1)
  if spec is None or str(spec).strip() == "":
    return {**sizes, "data": num_devices}
  text = str(spec).strip().lower()
  try:
    if "=" in text:
      for part in text.split(","):
        name, value = (x.strip() for x in part.split("="))
        name = "pipe" if name == "pipeline" else name
        if name not in sizes:
          raise MeshError(
            f"unknown mesh axis {name!r} in --mesh {spec}; use data, tensor, pipe, context."
          )
        sizes[name] = int(value)
    else:
      values = [int(v) for v in text.split("x")]
      if len(values) > len(AXES):
        raise MeshError(
          f"--mesh {spec} has {len(values)} axes; at most data x tensor x pipe x context."
        )
      sizes.update(zip(AXES, values, strict=False))
  except ValueError as e:  # int() of something that is not a number
    raise MeshError(
      f"cannot read --mesh {spec}; write e.g. 8, 2x4, 2x2x2, data=2,tensor=4 or data=2,context=4."
    ) from e
  if any(v < 1 for v in sizes.values()):
    raise MeshError(f"--mesh {spec}: every axis needs at least 1 device.")
  return sizes


def make_mesh(spec: str | None, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  sizes = parse_mesh(spec, len(devices))
  product = math.prod(sizes.values())
  if product > len(devices):
    raise MeshError(
      f"--mesh {spec} asks for {product} devices but JAX sees {len(devices)} "
      f"({devices[0].platform}); use a mesh whose sizes multiply to {len(devices)}."
    )
  if product != len(devices):
    raise MeshError(
      f"--mesh {spec} multiplies to {product} devices but JAX sees {len(devices)}; "
      f"the product must equal {len(devices)} (or limit the devices, e.g. CUDA_VISIBLE_DEVICES)."
    )
  grid = np.array(devices).reshape(*(sizes[a] for a in AXES))
  return Mesh(grid, AXES)


def check_model_fits(
  mesh: Mesh, num_heads: int, num_kv_heads: int, global_batch: int, num_layers: int | None = None
) -> None:
  """Divisibility the tensor, data and pipe axes need, checked before any compute."""
  tp, dp = mesh.shape["tensor"], mesh.shape["data"]
  if num_layers is not None:
    pipeline.check_stages(num_layers, mesh.shape["pipe"])
  if num_heads % tp or num_kv_heads % tp:
    raise MeshError(
      f"tensor={tp} does not divide the model's {num_heads} attention heads and "
      f"{num_kv_heads} key/value heads; pick a tensor size that divides both."
    )
  if global_batch % dp:
    raise MeshError(
      f"the batch of {global_batch} sequences does not split over data={dp}; "
      f"make --batch-size a multiple of {dp}."
    )

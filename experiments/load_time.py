"""Wall time and host memory of loading a HF checkpoint into NF4, with a breakdown by stage.

Writes a random-weight checkpoint of the shape, reads it once so it sits in the page cache
(as on a machine that has just downloaded it), then times ``jaxtune.from_pretrained``: the
first load pays for compilation as a user's does, later ones (the fastest of --repeats) show
the steady state. Peak host RSS is measured over the process's idle size (VmHWM reset through
clear_refs).

The breakdown times each stage on its own, after the loads, so it disturbs nothing:
  read_s       every tensor through the loader's file reader (page cache -> host memory)
  read_put_s   the same plus copying each tensor, as stored (bf16), to the device
  quantize_s   NF4 of every frozen linear already on the device (compiled, steady state)
  host_mean_s  the float64 mean of absmax on the host, for every frozen linear
  compile_s    tracing, lowering and compiling during the first load (jax.monitoring);
               compiles counts the programs compiled
Stages overlap inside the loader, so load_warm_s may be less than their sum.

  python experiments/load_time.py --shape small-500mb
  python experiments/load_time.py --shape llama-3.1-8b --results-dir $OUT
"""

import argparse
import collections
import gc
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flax import nnx  # noqa: E402

import jaxtune  # noqa: E402
from converters import safetensors_read  # noqa: E402
from experiments.measure import host_peak, reset_host_peak  # noqa: E402
from experiments.record import record  # noqa: E402
from experiments.write_checkpoint import write  # noqa: E402
from pallas_kernels import nf4  # noqa: E402

COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)
MIB = 1 << 20


def warm_page_cache(ckpt: Path) -> float:
  """Read every file once; returns GiB read."""
  total = 0
  buf = bytearray(64 * MIB)
  for f in sorted(ckpt.glob("*.safetensors")):
    with open(f, "rb", buffering=0) as fh:
      while n := fh.readinto(buf):
        total += n
  return total / 2**30


def timed_load(ckpt: Path) -> tuple[float, int]:
  """Seconds until every loaded array is ready, and the model's bytes."""
  t = time.perf_counter()
  model = jaxtune.from_pretrained(ckpt, quantization="nf4", dtype="bfloat16")
  leaves = jax.tree.leaves(nnx.state(model))
  jax.block_until_ready(leaves)
  dt = time.perf_counter() - t
  nbytes = sum(x.nbytes for x in leaves)
  del model, leaves
  gc.collect()
  return dt, nbytes


def time_read(files: list[Path], put: bool) -> float:
  t = time.perf_counter()
  for _, _, tensor in safetensors_read.iter_tensors(files):
    if put:
      jax.device_put(tensor).block_until_ready()
  return time.perf_counter() - t


def time_quantize(ckpt: Path, repeats: int = 5) -> tuple[float, float]:
  """(device, host) seconds of NF4 for every frozen linear (all layers), from bf16 on the
  device, compiled beforehand: the two device stages back to back as the loader queues them,
  and the host's float64 mean of absmax between them."""
  cfg = jaxtune.ModelConfig.from_hf(ckpt)
  counts = collections.Counter(cfg.linear_shapes().values())
  device_s = host_s = 0.0
  for shape, n in counts.items():
    w = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    _, absmax = nf4.quantize_linear_4bit(w)
    offset = nf4.host_mean(absmax)
    jax.block_until_ready(nf4.double_quantize_linear(absmax, offset))
    t = time.perf_counter()
    for _ in range(repeats):
      out = nf4.double_quantize_linear(nf4.quantize_linear_4bit(w)[1], offset)
    jax.block_until_ready(out)
    device_s += (time.perf_counter() - t) / repeats * n * cfg.num_layers
    host = jax.device_get(absmax)
    t = time.perf_counter()
    for _ in range(repeats):
      nf4.host_mean(host)
    host_s += (time.perf_counter() - t) / repeats * n * cfg.num_layers
  return device_s, host_s


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", default="small-500mb")
  ap.add_argument("--results-dir", default=None, help="default: experiments/")
  ap.add_argument("--tmp", default=None, help="where to write the checkpoint (default: $TMPDIR)")
  ap.add_argument("--repeats", type=int, default=3, help="warm loads; the fastest is reported")
  ap.add_argument(
    "--checkpoint-dir", default=None, help="keep the random checkpoint here, reusing one found"
  )
  ap.add_argument(
    "--compile-cache",
    default=None,
    help="JAX's persistent compilation cache directory (as the CLI)",
  )
  args = ap.parse_args()
  if args.compile_cache:
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

  compile_s, compiles = [0.0], [0]

  def on_duration(event, duration, **_):
    if event in COMPILE_EVENTS:
      compile_s[0] += duration
      compiles[0] += event == COMPILE_EVENTS[-1]

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jnp.zeros(1).block_until_ready()  # runtime up before anything is measured
  platform = jax.devices()[0].platform

  with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
    t = time.perf_counter()
    ckpt = Path(args.checkpoint_dir or tmp) / args.shape
    if not (ckpt / "config.json").is_file():  # a finished checkpoint there is reused
      ckpt = write(ckpt, args.shape)
    print(f"wrote checkpoint in {time.perf_counter() - t:.1f}s", flush=True)
    t = time.perf_counter()
    gib = warm_page_cache(ckpt)
    print(f"warmed page cache: {gib:.2f} GiB in {time.perf_counter() - t:.1f}s", flush=True)
    files = safetensors_read.safetensors_files(ckpt)

    gc.collect()
    idle = reset_host_peak()
    compile_s[0], compiles[0] = 0.0, 0
    load_s, model_bytes = timed_load(ckpt)
    peak = host_peak() - idle
    first_compile_s, first_compiles = compile_s[0], compiles[0]
    print(
      f"first load {load_s:.2f}s ({first_compiles} compiles, {first_compile_s:.2f}s)", flush=True
    )

    load_warm_s, peak_warm = float("inf"), 0
    for _ in range(args.repeats):
      idle = reset_host_peak()
      compile_s[0], compiles[0] = 0.0, 0
      dt, _ = timed_load(ckpt)
      load_warm_s, peak_warm = min(load_warm_s, dt), max(peak_warm, host_peak() - idle)
      print(f"warm load {dt:.2f}s ({compiles[0]} compiles, {compile_s[0]:.2f}s)", flush=True)

    read_s = time_read(files, put=False)
    read_put_s = time_read(files, put=True)
    quantize_s, mean_s = time_quantize(ckpt)

  # On a CPU the loaded model itself lives in host memory; the loader's own share excludes it.
  model_host = model_bytes if platform == "cpu" else 0
  row = {
    "model": args.shape,
    "checkpoint_gib": gib,
    "load_s": load_s,
    "load_warm_s": load_warm_s,
    "compile_s": first_compile_s,
    "compiles": first_compiles,
    "read_s": read_s,
    "read_put_s": read_put_s,
    "quantize_s": quantize_s,
    "host_mean_s": mean_s,
    "nf4_model_mib": model_bytes / MIB,
    "peak_rss_over_idle_mib": peak / MIB,
    "loader_rss_over_idle_mib": (peak - model_host) / MIB,
    "warm_loader_rss_over_idle_mib": (peak_warm - model_host) / MIB,
    "compile_cache": bool(args.compile_cache),
  }
  for k, v in row.items():
    print(f"  {k:32s} {v:.3f}" if isinstance(v, float) else f"  {k:32s} {v}")
  record(
    "load_time",
    [row],
    "Loading a bf16 checkpoint into NF4 (from_pretrained), page cache warm",
    note="load_s: first load in the process (compiles included); load_warm_s: the fastest "
    "later load. "
    "read/read_put/quantize are each timed alone; inside the loader they overlap. "
    "loader_rss_over_idle: peak host RSS above idle, minus the model's own bytes on a CPU "
    "(where the model lives in host memory).",
    out_dir=args.results_dir,
  )


if __name__ == "__main__":
  main()

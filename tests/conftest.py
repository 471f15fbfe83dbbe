"""Shared helpers: tiny, seeded transformers checkpoints written to disk as users have them."""

import functools
import gc
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Tests fake 8 CPU devices for the mesh tests; must be set before jax initialises. Their
# programs are tiny: LLVM's optimisations cost them more compile time than they save in
# running (level 0). Not for the jaxtune command lines they start (command_line_env): those
# run tens of steps and mostly load their programs from the compilation cache, so level 0's
# slower code costs more than its compile saves (the default run, 40 steps: 89 s of CPU at
# level 0, 46 s at the default level; 4 steps: 26 s and 23 s), nor for a run made from Python
# in a child (test_results_out's `trained`, given command_line_env). The tests' own code in a
# child (interpreted kernels) keeps level 0: flash_cases took 126 s of CPU at level 0, 161 s
# at the default.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# bitsandbytes' CPU backend wraps its dequantization in torch.compile (a compile per shape;
# the first one, inductor's start, took 31 s in the suite): tests run torch eagerly, the same
# operations (test_nf4 + test_bnb: 62 s -> 32 s).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# The tiers' folders on the import path: a test may take a helper from a test module of another
# tier (test_faults uses test_train's dataset), also when its own file runs alone.
sys.path[1:1] = [
  str(Path(__file__).parent / tier) for tier in ("unit", "models", "cli", "parallel", "kernels")
]

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# JAX's persistent compilation cache, one per test session (removed at its end), so that a
# program compiled once is loaded, not compiled again: by the command lines tests start
# (`python -m jaxtune.train ...` of the same settings; every run's loading and export) and by
# this process. jax 0.11.2 writes a cache entry in place (not atomically), so processes that
# run at the same time get cache directories of their own ("lanes"): this process one, the
# command lines it waits for another (inherited through the environment), and each process
# of a group started together its own (compile_cache_env). Set up by pytest_configure, not on
# import: a script that imports a test module (test_faults) is no session.
# JAXTUNE_TEST_COMPILE_CACHE=0 turns it off.
COMPILE_CACHE: Path | None = None
# The datasets cache (tokenized data) of this session, for it and the command lines it starts:
# tests see a cache miss on first use and a hit after, and nothing is left in ~/.cache.
DATASETS_CACHE: Path | None = None


def pytest_configure(config):
  global COMPILE_CACHE, DATASETS_CACHE
  DATASETS_CACHE = Path(tempfile.mkdtemp(prefix="jaxtune-tests-datasets-"))
  os.environ["HF_DATASETS_CACHE"] = str(DATASETS_CACHE)
  os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the Hub
  if os.environ.get("JAXTUNE_TEST_COMPILE_CACHE", "1") == "0":
    return
  COMPILE_CACHE = Path(tempfile.mkdtemp(prefix="jaxtune-tests-compile-cache-"))
  settings = {
    "jax_compilation_cache_dir": str(COMPILE_CACHE / "command-lines"),
    "jax_persistent_cache_min_compile_time_secs": 0,  # CPU compiles are short, and add up
    "jax_persistent_cache_min_entry_size_bytes": -1,
  }
  os.environ.update({k.upper(): str(v) for k, v in settings.items()})  # for command lines
  settings["jax_compilation_cache_dir"] = str(COMPILE_CACHE / "pytest")
  import jax

  for k, v in settings.items():
    jax.config.update(k, v)


def compile_cache_env(env: dict, lane: str) -> dict:
  """``env`` for a process that runs at the same time as others: its compilation cache in a
  directory of its own (lane), shared only with processes of the same lane that run later."""
  if COMPILE_CACHE is not None:
    env = {**env, "JAX_COMPILATION_CACHE_DIR": str(COMPILE_CACHE / lane)}
  return env


# Tests marked ``beside`` (heavy, self-contained, in-process) run in a pytest process of their
# own, a background job beside this one, when the session also holds the test that checks
# them (BESIDE_CHECK); otherwise (a file or a test run alone) here, as any test. The child
# knows itself by BESIDE_VAR.
BESIDE_VAR = "JAXTUNE_TESTS_BESIDE"
BESIDE_CHECK = "test_beside.py::test_the_tests_marked_beside_pass_in_a_process_of_their_own"
BESIDE: list[str] = []  # the node ids this session moved to the child


def pytest_collection_finish(session):
  """Python's cyclic garbage collector, once the test modules (torch, transformers, jax) are
  imported: those objects frozen out of its sweeps, young collections ~30x rarer and full ones
  ~100x. Tracing and lowering make millions of short-lived objects; test_train's mesh tests
  spent 3.0 s of 49 s collecting (2.4 s of it in full sweeps over the imports), 1.3 s with
  this."""
  gc.collect()
  gc.freeze()
  gc.set_threshold(20_000, 20, 20)


def pytest_collection_modifyitems(config, items):
  """Tests marked ``gpu`` are skipped where JAX sees no GPU (CPU machines, CI; and a GPU machine
  unless JAX_PLATFORMS lets JAX use it: this file defaults it to cpu). Tests marked ``late``
  (they only read a background job's results) run after the others, so their job, queued
  last (jobs go in the order tests first use them), has the whole session to finish. Tests
  marked ``beside`` leave this session for the child of BESIDE_CHECK where it is selected."""
  beside = [item for item in items if item.get_closest_marker("beside")]
  checked = any(item.nodeid.endswith(BESIDE_CHECK) for item in items)
  if beside and checked and not os.environ.get(BESIDE_VAR):
    BESIDE[:] = [item.nodeid for item in beside]
    items[:] = [item for item in items if not item.get_closest_marker("beside")]
  late = [item for item in items if item.get_closest_marker("late")]
  items[:] = [item for item in items if not item.get_closest_marker("late")] + late
  gpu = [item for item in items if item.get_closest_marker("gpu")]
  if gpu and not _has_gpu():
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; JAX sees none")
    for item in gpu:
      item.add_marker(skip)


def _has_gpu() -> bool:
  import jax

  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:  # no GPU backend, or none allowed by JAX_PLATFORMS
    return False


def pytest_unconfigure(config):
  if DATASETS_CACHE is not None:
    shutil.rmtree(DATASETS_CACHE, ignore_errors=True)
  if COMPILE_CACHE is not None:
    shutil.rmtree(COMPILE_CACHE, ignore_errors=True)


def tiny_llama_config(**overrides):
  from transformers import LlamaConfig

  kw = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
  )
  kw.update(overrides)
  return LlamaConfig(**kw)


# Tiny configs of each family: norms, softcaps, windows, query scale and rope all differ from
# the defaults enough to show a wrong implementation (test_families, test_gguf).
FAMILY_COMMON = dict(
  vocab_size=256,
  hidden_size=128,
  intermediate_size=192,
  num_hidden_layers=4,
  num_attention_heads=4,
  max_position_embeddings=256,
  rms_norm_eps=1e-6,
)
GEMMA3_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
_FAMILY = {
  "llama": ("LlamaConfig", dict(num_key_value_heads=2, head_dim=32)),
  "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
  "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)),
  "gemma": ("GemmaConfig", dict(num_key_value_heads=1, head_dim=64)),
  "gemma2": (
    "Gemma2Config",
    dict(
      num_key_value_heads=2,
      head_dim=64,
      query_pre_attn_scalar=48,
      sliding_window=8,
      attn_logit_softcapping=5.0,
      final_logit_softcapping=3.0,
    ),
  ),
  "gemma3": (
    "Gemma3TextConfig",
    dict(
      num_key_value_heads=2,
      head_dim=64,
      query_pre_attn_scalar=48,
      sliding_window=8,
      layer_types=GEMMA3_TYPES,
      final_logit_softcapping=6.0,
      rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
      },
    ),
  ),
}


def family_config(family: str, **overrides):
  """A tiny transformers config of ``family``; ``overrides`` replace any field."""
  import transformers as tf

  cls, own = _FAMILY[family]
  return getattr(tf, cls)(**{**FAMILY_COMMON, **own, **overrides})


def build_hf_llama(seed=0, **overrides):
  """A random LlamaForCausalLM in fp32 with norm weights perturbed so a wrong norm shows."""
  from transformers import LlamaForCausalLM

  torch.manual_seed(seed)
  cfg = tiny_llama_config(**overrides)
  cfg._attn_implementation = "eager"
  model = LlamaForCausalLM(cfg).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.add_(0.3 * torch.randn_like(p))
  return model


# Command-line runs in the background. Tests that start `python -m jaxtune.train` (or .export,
# .generate) and then only inspect what it wrote or said get the finished processes from a
# fixture. The runs start with the session, one job at a time in a background thread, in the
# order the tests need them: on CI's two cores this process keeps about one core busy (tracing,
# compiling, interpreting kernels), so a command line beside it costs little wall time. Only
# the jobs of the selected tests run. Their processes have a compilation cache lane of their
# own ("background"), as they run beside this process and the command lines it waits for.

_JOBS: dict[str, Callable] = {}
_RUNNING: set[subprocess.Popen] = set()


def background_run(name: str):
  """Decorator: ``job(directory, runs) -> result`` becomes the fixture ``name``, whose value is
  ``result``. ``directory`` is the job's own temporary directory; ``runs.result(other)`` waits
  for another job (one that a test needing this job also asks for, so it runs first). Jobs
  start their processes with ``start_cli`` or ``run_cli``."""

  def register(job):
    _JOBS[name] = job

    @pytest.fixture(name=name)
    def fixture(_background_runs):
      return _background_runs.result(name)

    return fixture

  return register


def command_line_env(env: dict) -> dict:
  """``env`` for a command line of jaxtune's the tests start: XLA_FLAGS less TEST_XLA_FLAGS."""
  flags = env.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").split()
  return {**env, "XLA_FLAGS": " ".join(flags)}


def _runs_a_command_line(argv: list[str]) -> bool:
  """Whether ``argv`` runs ``python -m jaxtune.<entry>`` (itself or as a wrapper's child)."""
  return any(a == "-m" and b.startswith("jaxtune.") for a, b in itertools.pairwise(argv))


def start_cli(argv: list[str], **kwargs) -> subprocess.Popen:
  """Popen, by default with text pipes for stdout and stderr and the background compilation
  cache lane (a jaxtune command line in command_line_env; the tests' own code, as in
  ``python -c``, as this process compiles); ``env=`` given is used as it is (test_multihost
  keeps TEST_XLA_FLAGS: it compares losses with a run in this process). Killed if the session
  ends first."""
  kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
  if "env" not in kwargs:
    env = command_line_env(dict(os.environ)) if _runs_a_command_line(argv) else dict(os.environ)
    kwargs["env"] = compile_cache_env(env, "background")
  proc = subprocess.Popen(argv, **kwargs)
  _RUNNING.add(proc)
  return proc


def finish(proc: subprocess.Popen, timeout: float = 900) -> subprocess.CompletedProcess:
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.communicate()
    raise
  finally:
    _RUNNING.discard(proc)
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(argv: list[str], timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
  """subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)."""
  return finish(start_cli(argv, **kwargs), timeout)


class _Runs:
  def __init__(self, jobs: dict[str, Callable[["_Runs"], Any]]):
    self._done = {name: threading.Event() for name in jobs}
    self._results: dict[str, tuple[Any, BaseException | None]] = {}
    self._stopping = False
    self.ran_s = 0.0  # the jobs' time
    self.waited_s = 0.0  # the tests' time waiting for them
    self.took: dict[str, float] = {}  # each job's time
    self._thread = threading.Thread(target=self._run, args=(jobs,), name="background-runs")
    self._thread.daemon = True
    self._thread.start()

  def _run(self, jobs):
    for name, job in jobs.items():
      if self._stopping:
        break
      start = time.perf_counter()
      try:
        self._results[name] = (job(self), None)
      except BaseException as e:  # handed to the test that asks for the result
        self._results[name] = (None, e)
      took = time.perf_counter() - start
      self.ran_s += took
      self.took[name] = took
      self._done[name].set()

  def result(self, name: str):
    if threading.current_thread() is self._thread and not self._done[name].is_set():
      raise RuntimeError(f"background job {name} has not run; ask for it in the test too.")
    start = time.perf_counter()
    self._done[name].wait()
    if threading.current_thread() is not self._thread:
      self.waited_s += time.perf_counter() - start
    value, error = self._results[name]
    if error is not None:
      raise error
    return value

  def stop(self):
    self._stopping = True
    for proc in list(_RUNNING):
      proc.kill()
    self._thread.join(timeout=60)


_SUMMARY: list[str] = []


@pytest.fixture(autouse=True)
def _no_step_store_in_this_process(monkeypatch):
  """The command lines' step store (step_store.py) is off in this process at every test's start
  and end: tests monkeypatch what a step computes, which the store's key cannot see. (A test
  that runs a command line's main() here turns it on for the rest of that test; none of
  those patches the step. The environment stays as it is: command lines the tests start as
  processes use the store.) Tests of the store turn it on themselves."""
  from jaxtune.training import step_store

  monkeypatch.setattr(step_store, "_store_dir", None)


# The persistent cache's settings that a command line's main() run in this process changes
# (compile_cache.use_compile_cache: its directory, and a size limit, which turns on JAX's
# least-recently-used eviction: every write lists and stats the whole directory), put back
# after each test, with JAX's cache object dropped so that the next compile opens it anew with
# them (JAX keeps the one made at the process's first compile). Without this, when the first
# compile of the session came inside such a main() (the command-line tier runs first), the
# whole session wrote through the eviction pass: 36% of the quick tier's time in
# LRUCache._evict_if_needed (py-spy), the tier 9-11 min against 5:11 before the tiers.
_CACHE_SETTINGS = (
  "jax_compilation_cache_dir",
  "jax_compilation_cache_max_size",
  "jax_persistent_cache_min_compile_time_secs",
)


@pytest.fixture(autouse=True)
def _compile_cache_settings_restored():
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  saved = {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}
  yield
  changed = {n: v for n, v in saved.items() if getattr(jax.config, n) != v}
  for name, value in changed.items():
    jax.config.update(name, value)
  if changed:
    compilation_cache.reset_cache()


@pytest.fixture(scope="session", autouse=True)
def _background_runs(request, tmp_path_factory):
  first_use = {}
  for i, item in enumerate(request.session.items):
    for name in item.fixturenames:
      if name in _JOBS:
        first_use.setdefault(name, i)
  order = sorted(first_use, key=lambda n: (first_use[n], list(_JOBS).index(n)))
  jobs = {name: functools.partial(_JOBS[name], tmp_path_factory.mktemp(name)) for name in order}
  if jobs:
    # The jobs read the default checkpoint; written here first, as its tokenizer's import of
    # transformers in the jobs' thread could race this thread's (a machine with no cache:
    # "cannot import name 'PreTrainedTokenizerFast'").
    from jaxtune.run import default_model

    default_model.ensure_default_checkpoint()
  runs = _Runs(jobs)
  yield runs
  runs.stop()
  if jobs:
    _SUMMARY.append(
      f"background command lines: {len(jobs)} job(s) ran {runs.ran_s:.0f}s beside the tests, "
      f"which waited {runs.waited_s:.0f}s for them ("
      + ", ".join(f"{name} {took:.0f}s" for name, took in runs.took.items())
      + ")"
    )


def pytest_terminal_summary(terminalreporter):
  for line in _SUMMARY:
    terminalreporter.write_line(line)


@background_run("default_run")
def _default_run(directory, runs):
  """The default run from the command line (``--steps 40``, every other setting its default),
  made once: test_train checks that it learns and exports, test_generate generates from it.
  Returns (run directory, the finished process)."""
  out = directory / "run"
  return out, run_cli([sys.executable, "-m", "jaxtune.train", "--out", str(out), "--steps", "40"])


@pytest.fixture
def hf_llama_dir(tmp_path):
  """Factory: write a tiny HF Llama checkpoint and return (dir, torch model)."""

  def make(seed=0, max_shard_size=None, **overrides):
    model = build_hf_llama(seed, **overrides)
    out = tmp_path / f"llama_{seed}_{len(os.listdir(tmp_path))}"
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out, model

  return make


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(ids).long()).logits.float().numpy()


def max_rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.abs(got - want).max() / np.abs(want).max())


def copy_dequantized_into(model, hf) -> int:
  """Write jaxtune's dequantized NF4 weights into the matching torch Linears of ``hf``.

  Asserts quantization changed each weight (so the copy matters); returns how many it copied.
  """
  from jaxtune.models import lora

  modules = dict(hf.named_modules())
  count = 0
  for path, linear in lora.iter_linears(model):
    if not linear.quantized:
      continue
    for layer in range(linear.codes.shape[0]):
      w = np.array(linear.dense_weight(np.float32, layer))
      name = "model." + ".".join(path).replace("layers.", f"layers.{layer}.", 1)
      with torch.no_grad():
        assert not np.array_equal(modules[name].weight.numpy(), w)
        modules[name].weight.copy_(torch.from_numpy(w))
      count += 1
  return count


def _peft_module_name(path, layer: int) -> str:
  inner = ".".join(path).replace("layers.", f"layers.{layer}.", 1)
  return f"base_model.model.model.{inner}"


def copy_peft_lora_into(model, peft_model) -> None:
  """Set jaxtune's stacked LoRA A/B of ``model`` to the adapters of ``peft_model``."""
  import jax.numpy as jnp

  from jaxtune.models.lora import iter_linears

  modules = dict(peft_model.named_modules())
  for path, linear in iter_linears(model):
    if linear.lora_a is None:
      continue
    for field, attr in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
      stacked = np.stack([
        getattr(modules[_peft_module_name(path, l)], attr)["default"].weight.detach().numpy().T
        for l in range(linear.layers)
      ])  # fmt: skip
      assert getattr(linear, field)[...].shape == stacked.shape, path
      getattr(linear, field)[...] = jnp.asarray(stacked)


def assert_lora_grads_match_peft(model, grads, peft_model, rel: float = 1e-5) -> int:
  """jaxtune's LoRA gradients (an nnx.State like the LoRAParam split of ``model``) against the
  .grad of ``peft_model``'s adapters, each within ``rel`` of its largest entry; returns how
  many arrays it compared."""
  from jaxtune.models.lora import iter_linears

  modules = dict(peft_model.named_modules())
  grad_of = dict(grads.flat_state())
  compared = 0
  for path, linear in iter_linears(model):
    if linear.lora_a is None:
      continue
    for field, attr in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
      g = np.asarray(grad_of[(*path, field)].get_value())
      want = np.stack([
        getattr(modules[_peft_module_name(path, l)], attr)["default"].weight.grad.numpy().T
        for l in range(linear.layers)
      ])  # fmt: skip
      scale = np.abs(want).max()
      assert scale > 0, (path, field)
      assert np.abs(g - want).max() / scale <= rel, (path, field)
      compared += 1
  return compared


# A tiny Llama for mesh tests: 8 heads / 4 kv heads so that tensor=4 divides both; hidden 256
# keeps NF4 blocks whole.
MESH_SHAPE = dict(
  hidden_size=256,
  intermediate_size=512,
  num_attention_heads=8,
  num_key_value_heads=4,
  head_dim=32,
  num_hidden_layers=2,
)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_with_random_adapters(hf, rank: int, alpha: float, seed: int, **config):
  """``hf`` under PEFT LoRA on all seven projections, every A and B random (N(0, 0.05^2)),
  so that the adapters change the output."""
  from peft import LoraConfig, get_peft_model

  peft_model = get_peft_model(
    hf,
    LoraConfig(
      r=rank, lora_alpha=alpha, target_modules=list(LORA_TARGETS), lora_dropout=0.0, **config
    ),
  )
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in peft_model.named_parameters():
      if "lora_" in name:
        p.copy_(0.05 * torch.randn_like(p))
  return peft_model


def mesh_lora_model(path, run, spec: str):
  """(runtime, NF4 model with rank-4 LoRA placed on it) of ``run`` under mesh ``spec`` on the
  first devices of the 8 fake CPU ones."""
  import math

  import jax

  import jaxtune
  from jaxtune.models.config import ModelConfig
  from jaxtune.parallel import mesh as meshlib
  from jaxtune.run import resolve as resolver

  devices = jax.devices()[: math.prod(meshlib.parse_mesh(spec, 8).values())]
  rt = resolver.resolve(run.replace(mesh=spec), ModelConfig.from_hf(path), devices=devices).runtime
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32", mesh=rt.mesh)
  return rt, jaxtune.apply_lora(model, rank=4, alpha=8, seed=0)


@background_run("tests_beside")
def _tests_beside(directory, runs):
  """The tests marked ``beside`` that this session moved (BESIDE), run by pytest in a process
  of its own: (node ids, exit code, the junit report's path, the output's tail)."""
  if not BESIDE:
    return [], None, None, ""
  report = directory / "report.xml"
  root = Path(__file__).parent.parent
  argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
          f"--junitxml={report}", *BESIDE]  # fmt: skip
  env = compile_cache_env({**os.environ, BESIDE_VAR: "1"}, "background")
  proc = run_cli(argv, timeout=1800, cwd=root, env=env)
  return list(BESIDE), proc.returncode, report, (proc.stdout + proc.stderr)[-6000:]

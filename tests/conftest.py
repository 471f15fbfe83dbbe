"""Shared helpers: tiny, seeded transformers checkpoints written to disk as users have them."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Tests fake 8 CPU devices for the mesh tests; must be set before jax initialises.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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


def pytest_configure(config):
  global COMPILE_CACHE
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


def pytest_unconfigure(config):
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


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
  """The default run from the command line (``--steps 40``, every other setting its default),
  made once: test_train checks that it learns and exports, test_generate generates from it.
  Returns (run directory, the finished process)."""
  out = tmp_path_factory.mktemp("default_run") / "run"
  proc = subprocess.run(
    [sys.executable, "-m", "jaxtune.train", "--out", str(out), "--steps", "40"],
    capture_output=True,
    text=True,
    timeout=900,
  )
  return out, proc


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
  import jaxtune

  modules = dict(hf.named_modules())
  count = 0
  for path, linear in jaxtune.lora.iter_linears(model):
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

"""``jaxtune.train``: a command line's run from Python (notebooks, scripts), in this process,
its mistakes spelled as this caller spells the settings."""

import dataclasses
import re
from pathlib import Path
from typing import Any

from jaxtune.errors import RunConfigError, UserError
from jaxtune.run import run_dir
from jaxtune.run.session import Trained, run_training
from jaxtune.run_config import RunConfig


def generate(
  model: Any, tokenizer: Any, prompts: Any, max_new_tokens: int = 128, **kw: Any
) -> list[str]:
  """Completions of ``prompts`` by ``model`` (``jaxtune.models.decoding.generate``, its
  keywords), computed as a run's plan would on this machine (``run.choices.resolve_decode``:
  the NF4 kernel for decoding's few tokens on one Hopper GPU, with its codes copied into
  their faster order where that copy fits in the free memory; the model is the caller's, so
  never permuted in place). ``decode=`` overrides that plan."""
  import jax

  from jaxtune.models import decoding
  from jaxtune.parallel.runtime import free_device_bytes
  from jaxtune.run.choices import loaded_bytes, resolve_decode

  if "decode" not in kw:
    # resolve_decode weighs free memory before loading: the loaded model's bytes added back.
    free = free_device_bytes()
    kw["decode"] = resolve_decode(
      model.config, devices=jax.device_count(), device=jax.devices()[0],
      free=None if free is None else free + loaded_bytes(model.config),
    )  # fmt: skip
  return decoding.generate(model, tokenizer, prompts, max_new_tokens, **kw)


def train(
  config: RunConfig | str | Path | dict[str, Any] | None = None,
  data: Any = None,
  *,
  eval_data: Any = None,
  resume: bool = False,
  allow_changes: bool = False,
  **settings: Any,
) -> Trained:
  """Fine-tune from Python (notebooks, scripts): the command line's run, in this process.

  ``config``: a RunConfig, a YAML file or a dict of settings (the command line's names,
  ``learning_rate=2e-4``); ``settings`` override it. ``data`` (and ``eval_data``): a path, a
  Hub dataset id, a ``datasets.Dataset`` or an iterable of dicts. Returns ``(run_dir,
  model)``; a mistake raises ``jaxtune.UserError`` (one sentence) before anything is written.
  """
  given = None  # a RunConfig: its settings that differ from the defaults (run_training)
  if isinstance(config, RunConfig):
    run = config.replace(**settings)
  else:
    if isinstance(config, str | Path):
      base = RunConfig.read_yaml(config)
    elif isinstance(config, dict):
      base = dict(config)
    elif config is None:
      base = {}
    else:
      raise RunConfigError(
        "config must be a RunConfig, a YAML path or a dict of settings, got "
        f"{type(config).__name__}."
      )
    chosen = {**base, **settings}
    if resume:  # the run's own config.yaml first, as on the command line
      chosen = run_dir.resumed_settings(Path(chosen.get("out", RunConfig.out)), chosen)
    run, given = RunConfig.from_settings(chosen), set(chosen)
  if isinstance(data, str | Path):
    run, data = run.replace(data=str(data)), None
  if isinstance(eval_data, str | Path):
    run, eval_data = run.replace(eval_data=str(eval_data)), None
  try:
    return run_training(
      run, resume=resume, data=data, eval_data=eval_data, allow_changes=allow_changes, given=given
    )
  except UserError as e:  # the sentence names the settings as this caller spells them
    e.args = (python_names(str(e)),)
    raise


_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


def python_names(sentence: str) -> str:
  """A command line's sentence with each flag of a run setting spelled as jaxtune.train's
  keyword (``--batch-size`` -> ``batch_size``; ``--resume`` -> ``resume=True``)."""
  names = {f.name for f in dataclasses.fields(RunConfig)}
  switches = {"resume": "resume=True", "allow-changes": "allow_changes=True"}

  def spelled(m: re.Match) -> str:
    flag = m[1]
    if flag in switches:
      return switches[flag]
    name = flag.replace("-", "_")
    return name if name in names else m[0]

  return _FLAG.sub(spelled, sentence)

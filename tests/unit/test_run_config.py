"""RunConfig's sections: flat and sectioned YAML read alike, to_yaml writes sections and reads
back, a setting under the wrong section is refused, and a run directory of an older version
(a flat config.yaml) still resumes."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

import jaxtune
from jaxtune.errors import RunConfigError
from jaxtune.run import checks, run_dir
from jaxtune.run_config import SECTION_NAMES, SECTION_OF, SECTIONS, RunConfig
from jaxtune.train import build_parser

# One setting or more of every section, none at its default.
SETTINGS = {
  "model": "meta-llama/Llama-3.2-1B",
  "quantization": None,
  "data": "chats.jsonl",
  "seq_len": 512,
  "packing": False,
  "method": "dpo",
  "beta": 0.3,
  "steps": 40,
  "learning_rate": 1.0e-4,
  "batch_size": 4,
  "grad_accum": 2,
  "eval_split": 0.1,
  "lora_rank": 8,
  "lora_targets": ["q_proj", "v_proj"],
  "remat": "full",
  "mesh": "2x4",
  "out": "runs/x",
  "export": "peft",
}


def _sectioned(settings: dict) -> dict:
  sections = {}
  for name, value in settings.items():
    sections.setdefault(SECTION_OF[name], {})[name] = value
  return sections


def _old_config_yaml(run: RunConfig) -> str:
  """config.yaml as versions before the sections wrote it: every setting at the top level."""
  return yaml.safe_dump(
    {**dataclasses.asdict(run), "lora_targets": list(run.lora_targets)}, sort_keys=False
  )


def _write(path: Path, text: str) -> Path:
  path.write_text(text)
  return path


def test_every_setting_has_one_section_and_the_class_lists_them_section_by_section():
  fields = dataclasses.fields(RunConfig)
  assert [f.metadata.get("section") for f in fields if f.metadata.get("section") is None] == []
  order = [SECTION_NAMES.index(f.metadata["section"]) for f in fields]
  assert order == sorted(order), "fields not grouped in SECTIONS order"
  assert set(SECTION_OF.values()) == set(SECTION_NAMES)  # no empty section
  assert all(isinstance(about, str) and about for _, about in SECTIONS)
  run = RunConfig(learning_rate=3e-4, lora_rank=4)
  assert run.section("optimizer")["learning_rate"] == 3e-4
  assert run.section("adapters")["lora_rank"] == 4 and "learning_rate" not in run.section(
    "adapters"
  )
  together = {k: v for name in SECTION_NAMES for k, v in run.section(name).items()}
  assert together == dataclasses.asdict(run)
  with pytest.raises(RunConfigError, match=r"^unknown section 'training'; the sections are model,"):
    run.section("training")


def test_flat_sectioned_and_mixed_yaml_read_to_the_same_run(tmp_path):
  flat = RunConfig.from_yaml(_write(tmp_path / "flat.yaml", yaml.safe_dump(SETTINGS)))
  sections = _sectioned(SETTINGS)
  sectioned = RunConfig.from_yaml(_write(tmp_path / "s.yaml", yaml.safe_dump(sections)))
  # The model's and data's settings and steps at the top level, the others under sections.
  top = [k for k in SETTINGS if SECTION_OF[k] in ("model", "data") or k == "steps"]
  mixed = {k: SETTINGS[k] for k in top}
  mixed.update(_sectioned({k: v for k, v in SETTINGS.items() if k not in top}))
  assert "optimizer" in mixed and "model" in mixed and not isinstance(mixed["model"], dict)
  mixed = RunConfig.from_yaml(_write(tmp_path / "m.yaml", yaml.safe_dump(mixed)))
  assert flat == sectioned == mixed
  assert flat == RunConfig.from_settings(sections) == RunConfig.from_settings(SETTINGS)
  assert (flat.learning_rate, flat.lora_targets, flat.data, flat.model) == (
    1e-4,
    ("q_proj", "v_proj"),
    "chats.jsonl",
    "meta-llama/Llama-3.2-1B",
  )
  assert RunConfig.read_yaml(tmp_path / "s.yaml") == RunConfig.read_yaml(tmp_path / "flat.yaml")


def test_to_yaml_writes_the_sections_under_their_headings_and_reads_back_equal(tmp_path):
  run = RunConfig.from_settings(SETTINGS).checked().replace(memory_limit=70.5, hub_private=True)
  text = run.to_yaml()
  data = yaml.safe_load(text)
  assert list(data) == list(SECTION_NAMES)
  for name, about in SECTIONS:
    assert f"# {about}\n{name}:\n" in text
    assert data[name] == {
      **run.section(name),
      **({"lora_targets": ["q_proj", "v_proj"]} if name == "adapters" else {}),
    }
  back = RunConfig.from_yaml(_write(tmp_path / "config.yaml", text))
  assert back == run
  assert (
    RunConfig.from_yaml(_write(tmp_path / "default.yaml", RunConfig().to_yaml())) == RunConfig()
  )


@pytest.mark.parametrize(
  ("text", "sentence"),
  [
    (
      "model:\n  learning_rate: 1.0e-4\n",
      "learning_rate is a setting of the section optimizer, not model; move it under optimizer "
      "(or to the top level).",
    ),
    (
      "optimizer:\n  lora_rank: 8\n",
      "lora_rank is a setting of the section adapters, not optimizer; move it under adapters "
      "(or to the top level).",
    ),
    (
      "training:\n  steps: 3\n  out: runs/a\n",
      "unknown section 'training'; its settings belong under optimizer and output (the sections "
      "are model, data, method, optimizer, evaluation, adapters, performance, output).",
    ),
    (
      "optimiser:\n  foo: 1\n",
      "unknown section 'optimiser'; did you mean 'optimizer'? (the sections are model, data, "
      "method, optimizer, evaluation, adapters, performance, output).",
    ),
    (
      "optimizer:\n  lerning_rate: 1\n",
      "optimizer: unknown setting 'lerning_rate'; did you mean 'learning_rate'? (the settings "
      "are the flags of python -m jaxtune.train --help, with _ for -).",
    ),
    (
      "steps: 3\noptimizer:\n  steps: 4\n",
      "steps is given twice, at the top level and under optimizer; keep one.",
    ),
    ("optimizer: 3\n", "the section optimizer must hold its settings as name: value lines, got 3."),
  ],
  ids=[
    "wrong-section",
    "wrong-section-2",
    "unknown-section",
    "section-typo",
    "unknown-in-section",
    "twice",
    "section-not-a-mapping",
  ],
)
def test_a_setting_in_the_wrong_place_is_one_sentence_naming_where_it_belongs(
  tmp_path, text, sentence
):
  path = _write(tmp_path / "c.yaml", text)
  with pytest.raises(RunConfigError, match=f"^{re.escape(f'{path}: {sentence}')}$"):
    RunConfig.read_yaml(path)
  with pytest.raises(RunConfigError, match=f"^{re.escape(sentence)}$"):
    RunConfig.from_settings(yaml.safe_load(text))


def test_settings_named_like_their_section_stay_settings(tmp_path):
  path = _write(tmp_path / "c.yaml", "model: org/m\ndata: d.jsonl\nmethod: orpo\nmodel_x: 1\n")
  with pytest.raises(RunConfigError, match="unknown setting 'model_x'"):
    RunConfig.read_yaml(path)
  path.write_text("model: org/m\ndata: null\nmethod: orpo\noptimizer:\n")
  assert RunConfig.read_yaml(path) == {"model": "org/m", "data": None, "method": "orpo"}


@pytest.mark.parametrize("layout", ["flat (older versions)", "sectioned"])
def test_a_run_directory_resumes_from_either_layout_of_config_yaml(tmp_path, layout):
  saved = RunConfig.from_settings(SETTINGS).checked()
  out = tmp_path / "run"
  (out / "checkpoints" / "40").mkdir(parents=True)
  text = _old_config_yaml(saved) if layout.startswith("flat") else saved.to_yaml()
  assert ("\noptimizer:\n" in text) == (layout == "sectioned")
  _write(out / "config.yaml", text)
  given = {"out": str(out), "steps": 60}
  settings = run_dir.resumed_settings(out, given)
  assert settings["steps"] == 60 and settings["lora_rank"] == 8 and "epochs" not in settings
  run = RunConfig.from_settings(settings).checked()
  assert run == saved.replace(steps=60, out=str(out))
  resume = checks.check_resume(run, out, None, resume=True)
  assert resume.saved == saved
  assert resume.changes == {"steps": (40, 60)}  # out is where the run is, never a change


def test_help_groups_the_flags_by_section():
  parser = build_parser()
  groups = {g.title: g for g in parser._action_groups}
  for f in dataclasses.fields(RunConfig):
    flag = "--" + f.name.replace("_", "-")
    group = groups[f.metadata["section"]]
    assert any(flag in a.option_strings for a in group._group_actions), (flag, group.title)
  text = parser.format_help()
  positions = [text.index(f"\n{name}:\n") for name in SECTION_NAMES]
  assert positions == sorted(positions)
  assert text.index("\n  --learning-rate") > positions[SECTION_NAMES.index("optimizer")]


def test_the_shipped_configs_show_both_layouts():
  configs = sorted((Path(jaxtune.__file__).parent / "configs").glob("*.yaml"))
  layouts = {
    p.name: any(isinstance(v, dict) for v in yaml.safe_load(p.read_text()).values())
    for p in configs
  }
  assert True in layouts.values() and False in layouts.values(), layouts

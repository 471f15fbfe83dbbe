"""The bad-input catalogue, continued: data files and folders that are empty, damaged or named
oddly, and GRPO rewards that do not import, raise or return the wrong thing (issue 52).

Each case runs ``python -m jaxtune.train``'s main in this process, as test_catalogue.py's
``test_bad_input`` does: exit code 2, one ``error: ...`` sentence, the workspace byte for byte
as before. A cache of jaxtune's own that is damaged between two runs is no user's mistake: it
is made anew, said in one line (the tests at the end).
"""

import glob
import json
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
from test_catalogue import (
  MAINS,
  REPO,
  Case,
  Work,
  _assert_one_sentence,
  _snapshot,
  _write_tiny_model,
)

from jaxtune.data import sources
from jaxtune.data import tokenize as data_tokenize
from jaxtune.run import checks, default_model
from jaxtune.run.default_model import DATASET
from jaxtune.training import rewards


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
  """test_catalogue's model (a fixture imported would be a name ruff sees unused)."""
  return _write_tiny_model(tmp_path_factory.mktemp("catalogue-data") / "model")


def _args(w: Work, *extra: str) -> list[str]:
  """A run of ``w``'s with its batch and sequence length set (on CPUs alone jaxtune may
  choose smaller ones, which may not suit the 8 test devices and the tiny model)."""
  return w.train_args("--batch-size", "8", "--seq-len", "64", *extra)


def _rows(n: int = 8) -> list[dict]:
  return [json.loads(line) for line in DATASET.read_text().splitlines()[:n]]


def _saved(w: Work, damage) -> list[str]:
  """A datasets.save_to_disk directory of good rows, then ``damage(directory)`` done to it."""
  directory = w.root / "saved"
  datasets.Dataset.from_list(_rows()).save_to_disk(str(directory))
  damage(directory)
  return _args(w, "--data", str(directory))


def _cut(f: Path, keep: float = 0.5) -> None:
  raw = f.read_bytes()
  f.write_bytes(raw[: int(len(raw) * keep)])


ARROW = "data-00000-of-00001.arrow"


def _glob_with_a_directory(w: Work) -> list[str]:
  d = w.root / "many"
  (d / "old").mkdir(parents=True)
  (d / "a.jsonl").write_text(w.data.read_text())
  return _args(w, "--data", f"{d}/*")


def _prompts(w: Work) -> Path:
  rows = [{"prompt": f"Question {i}: is it good?"} for i in range(4)]
  return w.file("prompts.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def _grpo(w: Work, reward: str) -> list[str]:
  """A GRPO run of one step on 4 prompts x 2 completions of up to 4 tokens (8 rows: one per
  device), scored by ``reward``."""
  return _args(
    w,
    *("--method", "grpo", "--reward", reward, "--data", str(_prompts(w))),
    *("--batch-size", "4", "--num-generations", "2", "--max-new-tokens", "4"),
  )


REWARDS = """\
def down(prompts, completions, **columns):
  return ask_the_service(completions)


def ask_the_service(completions):
  raise RuntimeError("reward service down")


def as_dict(prompts, completions, **columns):
  return {"score": [1.0] * len(completions)}
"""


CASES = [
  # Data files and folders
  Case(
    "data-empty-zero-bytes",
    lambda w: _args(w, "--data", str(w.file("empty.jsonl", b""))),
    r"empty\.jsonl holds no examples; it is empty",
  ),
  Case(
    "data-glob-matches-directory",
    _glob_with_a_directory,
    r"--data .*many/\* matches the directory .*many/old, not a data file; narrow the pattern "
    r"to files \(such as \*\.jsonl\), or pass the directory itself",
  ),
  Case(
    "data-csv-ragged-row",
    lambda w: _args(
      w, "--data", str(w.file("rows.csv", "text,label\nhello,1\nworld,2,extra\nagain,3\n"))
    ),
    r"rows\.csv:3 has 3 fields, more than the 2 columns of its header; quote the field that "
    r"holds a comma, or fix that row",
  ),
  Case(
    "data-directory-name-is-a-pattern",
    lambda w: (
      (w.root / "runs[1]").mkdir()
      or (w.root / "runs[1]" / "train.jsonl").write_text(w.data.read_text())
      and _args(w, "--data", str(w.root / "runs[1]"))
    ),
    r"the directory .*runs\[1\] has \*, \? or \[ in its path, which datasets reads as a "
    r"pattern; rename it, or pass one of its data files",
  ),
  Case(
    "data-saved-arrow-truncated",
    lambda w: _saved(w, lambda d: _cut(d / ARROW)),
    r"the datasets\.save_to_disk directory .*saved is damaged: .*saved/data-00000-of-00001\."
    r"arrow is truncated or damaged \(Expected to read \d+ [^)]*\); save the dataset there "
    r"again, or pass its original data files",
  ),
  Case(
    "data-saved-arrow-missing",
    lambda w: _saved(w, lambda d: (d / ARROW).unlink()),
    r"the datasets\.save_to_disk directory .*saved is damaged: .*saved/data-00000-of-00001\."
    r"arrow is missing",
  ),
  Case(
    "data-saved-state-not-json",
    lambda w: _saved(w, lambda d: _cut(d / "state.json")),
    r"the datasets\.save_to_disk directory .*saved is damaged: .*saved/state\.json is not "
    r"valid JSON \(",
  ),
  Case(
    "data-saved-info-not-json",
    lambda w: _saved(w, lambda d: (d / "dataset_info.json").write_text("{oops")),
    r"is damaged: .*saved/dataset_info\.json is not valid JSON \(Expecting property name",
  ),
  # GRPO rewards
  Case(
    "reward-syntax-error",
    lambda w: (
      w.file("broken_rewards.py", "def score(prompts, completions):\n  return [1.0\n")
      and _args(w, "--method", "grpo", "--reward", "broken_rewards:score")
    ),
    r"--reward broken_rewards:score: module 'broken_rewards' has a syntax error at line 2 of "
    r".*broken_rewards\.py \('\[' was never closed\); fix it",
  ),
  Case(
    "reward-import-fails",
    lambda w: (
      w.file("env_rewards.py", "import os\nKEY = os.environ['NO_SUCH_REWARD_KEY']\n")
      and _args(w, "--method", "grpo", "--reward", "env_rewards:score")
    ),
    r"--reward env_rewards:score: importing module 'env_rewards' raised KeyError "
    r"\('NO_SUCH_REWARD_KEY'\) at line 2 of .*env_rewards\.py; fix the module",
  ),
  Case(
    "reward-file-missing",
    lambda w: _args(w, "--method", "grpo", "--reward", f"{w.root / 'nope.py'}:score"),
    r"--reward .*nope\.py:score: .*nope\.py is not a file; name a Python file or an "
    r"importable module",
  ),
  Case(
    "reward-raises",
    lambda w: _grpo(w, f"{w.file('service.py', REWARDS)}:down"),
    r"reward .*service\.py:down raised RuntimeError at step 1 \(reward service down\); fix the "
    r"reward, then run again or --resume \(checkpoints saved before it are in .*run/checkpoints\)",
  ),
  Case(
    "reward-returns-dict",
    lambda w: _grpo(w, f"{w.file('service.py', REWARDS)}:as_dict"),
    r"reward .*service\.py:as_dict returned a dict \(\{'score': \[1\.0, [^]]*, \.\.\.\]\}\) at "
    r"step 1, not a list; it must return one number per completion",
  ),
]
# Cases that load the model and generate (GRPO's first rollout): seconds each.
GENERATING = {"reward-raises", "reward-returns-dict"}


def test_data_cases_are_documented():
  readme = (REPO / "README.md").read_text()
  section = readme[readme.index("## Troubleshooting") :]
  missing = [c.id for c in CASES if f"`{c.id}`" not in section]
  assert not missing, f"README's troubleshooting table lacks {missing}"


@pytest.mark.parametrize(
  "case",
  [pytest.param(c, marks=[pytest.mark.slow] if c.id in GENERATING else []) for c in CASES],
  ids=[c.id for c in CASES],
)
def test_bad_input(case, tiny_model, tmp_path, capsys, monkeypatch):
  work = Work(tmp_path, tiny_model)
  argv = case.setup(work)
  monkeypatch.syspath_prepend(str(tmp_path))  # reward modules named by module
  before = _snapshot(tmp_path)
  capsys.readouterr()
  code = MAINS[case.entry](argv)
  _, err = capsys.readouterr()
  assert code == 2, err
  _assert_one_sentence(err, case.match)
  assert _snapshot(tmp_path) == before
  if case.id == "reward-raises":  # the reward's own frames, below the sentence; none of ours
    below = err[err.index("error:") :].splitlines()[1:]
    assert any(re.search(r'File ".*service\.py", line 6, in ask_the_service', x) for x in below)
    assert not any("jaxtune" in x for x in below), err


# ---------------------------------------------------------------- names taken as they are


def test_a_file_name_with_brackets_is_read_as_it_is_named(tmp_path):
  """data[1].jsonl exists: it is that file, not the pattern matching data1.jsonl (also there)."""
  (tmp_path / "data[1].jsonl").write_text('{"text": "bracketed"}\n')
  (tmp_path / "data1.jsonl").write_text('{"text": "plain"}\n')
  table, _ = sources.open_source(str(tmp_path / "data[1].jsonl"))
  assert table["text"] == ["bracketed"]
  table, _ = sources.open_source(str(tmp_path / "data?.jsonl"))  # a pattern still globs
  assert table["text"] == ["plain"]


def test_blank_and_zero_byte_files_are_empty(tmp_path):
  for name, text in (("a.jsonl", "\n \n"), ("b.json", ""), ("c.csv", ""), ("d.csv", "x,y\n")):
    (tmp_path / name).write_text(text)
    with pytest.raises(sources.DataError, match=rf"{name} holds no examples; it is empty\.$"):
      sources.open_source(str(tmp_path / name))


def test_a_ragged_row_is_named_by_the_line_it_starts_on(tmp_path):
  """A quoted field spanning two lines: the ragged row after it starts on line 6."""
  f = tmp_path / "q.csv"
  f.write_text('text,label\nhello,1\n"a, b",2\n"two\nlines",3\nbad,4,5\n')
  with pytest.raises(sources.DataError, match=r"q\.csv:6 has 3 fields, more than the 2"):
    sources.open_source(str(f))


# ---------------------------------------------------------------- caches made anew


@pytest.fixture(scope="module")
def tok():
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(default_model.ensure_default_checkpoint())


def _cache_files(path: Path, pattern: str) -> list[Path]:
  """The datasets cache's files of the data file ``path`` (its prepared copy and the tokenized
  rows sit in one directory), whose names match ``pattern``."""
  table, _ = sources.open_source(str(path))
  directory = Path(table.cache_files[0]["filename"]).parent
  return sorted(Path(f) for f in glob.glob(str(directory / pattern)))


def _end_of_first_batch(f: Path) -> int:
  """Where the first record batch of the Arrow stream file ``f`` ends."""
  import pyarrow as pa

  stream = pa.BufferReader(f.read_bytes())
  assert pa.ipc.read_message(stream).type == "schema"
  assert pa.ipc.read_message(stream).type == "record batch"
  return stream.tell()


@pytest.mark.parametrize(
  "pattern, line",
  [
    ("cache-jaxtune-*.arrow", "jaxtune: the tokenized cache of {} is damaged ({} is truncated"),
    ("json-train*.arrow", "jaxtune: datasets' cache of {} is damaged ({} "),
  ],
  ids=["tokenized-rows", "prepared-copy"],
)
@pytest.mark.parametrize("cut", ["in-a-batch", "between-batches"])
def test_a_cache_damaged_between_two_runs_is_made_anew(tok, tmp_path, capsys, pattern, line, cut):
  """The cache that datasets keeps of a data file, cut short between two runs, inside a record
  batch or after the first of its three (which reads without an error, 1,000 rows short): the
  second run says so in one line, makes it anew and gets the rows of the first."""
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(2500)))
  first = data_tokenize.tokenize(str(path), tok)
  (damaged,) = _cache_files(path, pattern)
  raw = damaged.read_bytes()
  damaged.write_bytes(raw[: len(raw) // 2 if cut == "in-a-batch" else _end_of_first_batch(damaged)])
  capsys.readouterr()
  second = data_tokenize.tokenize(str(path), tok)
  err = capsys.readouterr().err
  said = [x for x in err.splitlines() if x.startswith("jaxtune:")]
  assert len(said) == 1 and said[0].startswith(line.format(path, damaged)), err
  assert said[0].endswith(" anew")
  assert second.how.startswith("tokenized in")
  for a, b in ((first.tokens, second.tokens), (first.labels, second.labels)):
    np.testing.assert_array_equal(a, b)
  third = data_tokenize.tokenize(str(path), tok)  # whole again: a hit, nothing said
  assert third.how.startswith("tokenized earlier") and "jaxtune:" not in capsys.readouterr().err


# ---------------------------------------------------------------- rewards


def test_what_a_reward_returns_must_be_one_number_per_completion():
  def returning(value):
    return lambda prompts, completions, **_: value

  for value, said in (
    ({0: 1.0, 1: 0.0}, r"returned a dict \(\{0: 1\.0, 1: 0\.0\}\) at step 7, not a list"),
    ("11", r"returned a str \('11'\) at step 7, not a list"),
    (1.0, r"returned a float \(1\.0\) at step 7, not a list"),
    (None, r"returned None at step 7, not a list"),
    (np.ones((2, 1)), r"returned an array of shape \(2, 1\) at step 7, not a list"),
    ([1.0, "1"], r"returned a value that is not a number at step 7 \(for completion 2: a str"),
    ([1.0, float("inf")], r"returned a NaN or infinite value at step 7 \(for completion 2: inf"),
  ):
    with pytest.raises(rewards.RewardError, match=rf"^reward r {said}"):
      rewards.score([("r", returning(value))], ["p", "q"], ["a", "b"], {}, step=7)
  for good in ([1, 0.5], (True, 0), np.float32([1, 2])):
    assert rewards.score([("r", returning(good))], ["p", "q"], ["a", "b"], {}, 7)["r"] == list(
      map(float, good)
    )


def test_a_reward_file_is_imported_once_and_its_import_errors_are_named(tmp_path, monkeypatch):
  f = tmp_path / "my_rewards.py"
  f.write_text("CALLS = []\ndef score(prompts, completions, **_):\n  return [1.0] * len(prompts)\n")
  ((name, fn),) = rewards.load(f"{f}:score")
  assert name == f"{f}:score" and fn(["p"], ["c"]) == [1.0]
  assert rewards.load(f"{f}:score")[0][1] is fn  # the file runs once
  monkeypatch.syspath_prepend(str(tmp_path))
  (tmp_path / "needs_more.py").write_text("import no_such_package_for_rewards\n")
  with pytest.raises(
    rewards.RunConfigError,
    match=r"importing module 'needs_more' raised ModuleNotFoundError \(No module named "
    r"'no_such_package_for_rewards'\) at line 1 of .*needs_more\.py; install what it imports, "
    r"or fix the module\.$",
  ):
    rewards.load("needs_more:score")


@pytest.mark.slow
def test_a_reward_that_raises_later_leaves_the_checkpoint_before_it(tiny_model, tmp_path, capsys):
  """A reward that fails at its second call (step 2): step 1 trained and its checkpoint was
  saved (synchronously) before the error, which names the step and the checkpoints."""
  work = Work(tmp_path, tiny_model)
  reward = work.file(
    "flaky.py",
    "CALLS = []\n\ndef score(prompts, completions, **_):\n  CALLS.append(1)\n"
    "  if len(CALLS) > 1:\n    raise ConnectionError('the judge timed out')\n"
    "  return [float(len(c)) for c in completions]\n",
  )
  argv = _grpo(work, f"{reward}:score")
  argv[argv.index("--steps") + 1] = "2"
  code = MAINS["train"]([*argv, "--save-every", "1", "--report-to", "none"])
  err = capsys.readouterr().err
  assert code == 2, err
  ckpts = work.out / "checkpoints"
  _assert_one_sentence(
    err,
    rf"reward .*flaky\.py:score raised ConnectionError at step 2 \(the judge timed out\); fix "
    rf"the reward, then run again or --resume \(checkpoints saved before it are in "
    rf"{re.escape(str(ckpts.resolve()))}\)\.$",
  )
  assert checks.has_checkpoints(ckpts) and sorted(p.name for p in ckpts.iterdir()) == ["1"]
  assert 'flaky.py", line 6, in score' in err.split("error:")[1]

"""Real data in: every source kind and format through HF datasets, the loss mask token by token,
the tokenization cache, long examples, the chosen seq-len, the eval split, streaming resume,
and `jaxtune.train` from Python. Bad inputs are in test_catalogue.py."""

import copy
import json
import sys

import numpy as np
import pytest
from conftest import background_run, run_cli

import jaxtune
from jaxtune.data import formats
from jaxtune.data import rows as data
from jaxtune.data import streaming as data_streaming
from jaxtune.data import tokenize as data_tokenize
from jaxtune.data.settings import DataSettings
from jaxtune.errors import DataError
from jaxtune.run import default_model, loading

IGNORE = data.IGNORE


@pytest.fixture(scope="module")
def tok():
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(default_model.ensure_default_checkpoint())


@pytest.fixture(scope="module")
def plain_tok(tok):
  """The same tokenizer without a chat template."""
  t = copy.deepcopy(tok)
  t.chat_template = None
  return t


def _enc(tok, text):
  return tok(text, add_special_tokens=False)["input_ids"]


def _special(tok, name):
  return tok.convert_tokens_to_ids(name)


def _expected_chat(tok, messages):
  """The default template's tokens and labels, built turn by turn without the template: each
  turn is <|role|> content <|eos|>; an assistant turn trains on its content and <|eos|>."""
  ids, labels = [], []
  eos = tok.eos_token_id
  for m in messages:
    head, body = [_special(tok, f"<|{m['role']}|>")], _enc(tok, m["content"]) + [eos]
    ids += head + body
    labels += [IGNORE] * len(head) + (body if m["role"] == "assistant" else [IGNORE] * len(body))
  return ids, labels


CHAT = [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "What is 2 plus 2?"},
  {"role": "assistant", "content": "It is 4."},
  {"role": "user", "content": "And 3 plus 3?"},
  {"role": "assistant", "content": "6."},
]


def test_chat_mask_is_the_assistant_turns_token_by_token(tok):
  want = _expected_chat(tok, CHAT)
  assert formats.Encoder("messages", tok)({"messages": CHAT}, 0) == want
  # Content as a list of text parts reads as the joined string.
  parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
  assert formats.Encoder("messages", tok)({"messages": parts}, 0) == want
  # ShareGPT: the same conversation, the same tokens and mask.
  speaker = {"system": "system", "user": "human", "assistant": "gpt"}
  sharegpt = [{"from": speaker[m["role"]], "value": m["content"]} for m in CHAT]
  assert formats.Encoder("conversations", tok)({"conversations": sharegpt}, 0) == want
  # --train-on-prompt: every token trains.
  ids, labels = formats.Encoder("messages", tok, train_on_prompt=True)({"messages": CHAT}, 0)
  assert labels == ids == want[0]


def test_alpaca_mask_with_and_without_a_chat_template(tok, plain_tok):
  row = {"instruction": "Name the capital.", "input": "France", "output": "Paris is."}
  # With a template: instruction and input are the user turn.
  turns = [
    {"role": "user", "content": "Name the capital.\n\nFrance"},
    {"role": "assistant", "content": "Paris is."},
  ]
  assert formats.Encoder("alpaca", tok)(row, 0) == _expected_chat(tok, turns)
  # Without one: Alpaca's own prompt, loss on the output and EOS.
  ids, labels = formats.Encoder("alpaca", plain_tok)(row, 0)
  prompt = formats.ALPACA_PROMPT_INPUT.format(instruction="Name the capital.", input="France")
  assert plain_tok.decode(ids) == prompt + "Paris is.<|eos|>"
  trained = [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE]
  assert [lab for lab in labels if lab != IGNORE] == trained
  assert plain_tok.decode(trained) == "Paris is.<|eos|>"
  first = labels.index(next(lab for lab in labels if lab != IGNORE))
  assert plain_tok.decode(ids[:first]) == prompt
  # No input: the shorter prompt.
  ids, _ = formats.Encoder("alpaca", plain_tok)({**row, "input": ""}, 0)
  assert plain_tok.decode(ids).startswith(
    formats.ALPACA_PROMPT.format(instruction="Name the capital.")
  )


def test_prompt_completion_mask_for_strings_and_messages(tok):
  ids, labels = formats.Encoder("prompt_completion", tok)(
    {"prompt": "The sky is", "completion": " blue today."}, 0
  )
  n = len(_enc(tok, "The sky is"))
  assert ids[:n] == _enc(tok, "The sky is") and labels[:n] == [IGNORE] * n
  assert tok.decode(ids[n:]) == " blue today.<|eos|>" and labels[n:] == ids[n:]
  prompt = [{"role": "user", "content": "Hi"}]
  completion = [{"role": "assistant", "content": "Hello."}]
  got = formats.Encoder("prompt_completion", tok)({"prompt": prompt, "completion": completion}, 0)
  assert got == _expected_chat(tok, prompt + completion)


def test_text_trains_every_token_and_ends_with_eos(tok):
  ids, labels = formats.Encoder("text", tok)({"text": "The red fox."}, 0)
  assert ids == labels and ids[-1] == tok.eos_token_id
  assert tok.decode(ids, skip_special_tokens=True) == "The red fox."


def test_format_is_detected_from_the_columns():
  full = lambda c: 3  # noqa: E731
  cases = {
    ("text",): "text",
    ("messages", "id"): "messages",
    ("conversations",): "conversations",
    ("instruction", "input", "output", "text"): "alpaca",  # tatsu-lab/alpaca has all four
    ("prompt", "completion"): "prompt_completion",
  }
  for columns, fmt in cases.items():
    assert formats.detect(columns, full, 3, "d") == fmt
  with pytest.raises(DataError, match="mixes formats: of its 3 rows, 2 in format messages and 1"):
    formats.detect(("text", "messages"), {"messages": 2, "text": 1}.get, 3, "d")
  with pytest.raises(DataError, match="the columns a, b, which match no format"):
    formats.detect(("a", "b"), full, 3, "d")


# ---------------------------------------------------------------- sources, trained


def _rows(fmt: str, n: int = 24) -> list[dict]:
  out = []
  for i in range(n):
    q, a = f"What is {i} plus {i}?", f"{i} plus {i} is {2 * i}."
    out.append(
      {
        "text": {"text": f"{q} {a}"},
        "messages": {
          "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        },
        "conversations": {
          "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        },
        "alpaca": {"instruction": q, "input": "", "output": a},
        "prompt_completion": {"prompt": q, "completion": " " + a},
        "mapped": {"question": q, "answer": " " + a},
      }[fmt]
    )
  return out


def _write(path, fmt, kind):
  import datasets

  rows = _rows(fmt)
  if kind == "jsonl":
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  elif kind == "json":
    path.write_text(json.dumps(rows))
  else:
    table = datasets.Dataset.from_list(rows)
    if kind == "parquet":
      table.to_parquet(str(path))
    elif kind == "csv":
      table.to_csv(str(path), index=False)
    elif kind == "arrow":
      table.save_to_disk(str(path.parent / "tmp-arrow"))
      arrow = next((path.parent / "tmp-arrow").glob("*.arrow"))
      arrow.rename(path)
    elif kind == "saved":
      datasets.DatasetDict(train=table).save_to_disk(str(path))
    elif kind == "splits":  # a directory of files named by split, as on the Hub
      path.mkdir()
      table.select(range(16)).to_json(str(path / "train.jsonl"))
      table.select(range(16, 24)).to_json(str(path / "test.jsonl"))
  return path


# (format, how it is stored, extra settings): every format and every source kind at least once.
CASES = [
  ("text", "jsonl", {}),
  ("messages", "json", {}),
  ("conversations", "parquet", {}),
  ("alpaca", "csv", {}),
  ("prompt_completion", "arrow", {}),
  ("messages", "saved", {}),
  ("mapped", "csv", {"data_columns": "prompt=question,completion=answer"}),
  ("alpaca", "splits", {"eval_data": "SAME"}),  # --eval-data the same source: its test split
]


# The cases that also train end to end (the rest are loaded: what differs between formats and
# sources is how their examples become token rows; a run trains on those rows alike).
RUN = ("text-jsonl", "mapped-csv", "alpaca-splits")


@pytest.mark.slow
@pytest.mark.parametrize("fmt,kind,extra", CASES, ids=[f"{f}-{k}" for f, k, _ in CASES])
def test_each_format_and_source_loads_and_trains(fmt, kind, extra, tmp_path, capsys, tok):
  """Every format and source kind is read into rows with trained tokens; the cases in ``RUN``
  (a plain source, columns mapped by --data-columns, a split directory with its test split as
  --eval-data) also train two steps through ``jaxtune.train``."""
  suffix = {"saved": "", "splits": ""}.get(kind, "." + kind)
  path = _write(tmp_path / f"{fmt}{suffix}", fmt, kind)
  shown = "prompt_completion" if fmt == "mapped" else fmt
  if f"{fmt}-{kind}" not in RUN:
    rows, _, report = data_tokenize.load(str(path), tok, DataSettings(seq_len=128))
    assert (report.format, report.examples) == (shown, 24)
    assert len(rows) > 0 and np.count_nonzero(np.asarray(rows.labels) != IGNORE) > 0
    return
  if extra.get("eval_data") == "SAME":
    extra = {**extra, "eval_data": str(path)}
  # One row length for every case, so that all share one compiled step (an unset --seq-len
  # follows each data set's lengths: test_unset_seq_len_holds_99_percent_capped_by_the_model).
  run_dir, model = jaxtune.train(
    data=path, out=str(tmp_path / "run"), steps=2, export=None, log_every=1, seq_len=128, **extra
  )
  said = capsys.readouterr().out
  assert f"{shown}, {16 if kind == 'splits' else 24} examples" in said, said
  rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [1, 2]
  assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
  if "eval_data" in extra:  # every trained token of the test split, none of train's
    held, _, _ = data_tokenize.load(str(path), tok, DataSettings(seq_len=128, split="test"))
    evals = [r["eval_tokens"] for r in rows if "eval_tokens" in r]
    assert evals == [np.count_nonzero(held.labels != IGNORE)]
  assert rows[0]["tokens"] > 0
  assert model.layers.self_attn.q_proj.lora_b is not None


@pytest.mark.slow
@pytest.mark.beside
def test_train_takes_a_dataset_or_dicts_from_python(tmp_path, capsys):
  import datasets

  rows = _rows("messages")
  # A datasets.Dataset built in memory, with a held-out fraction.
  run_dir, _ = jaxtune.train(
    {"steps": 2, "export": None}, data=datasets.Dataset.from_list(rows), out=str(tmp_path / "a"),
    eval_split=0.25,
  )  # fmt: skip
  metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert any("eval_loss" in m for m in metrics)
  assert "6 held out for eval" in capsys.readouterr().out
  # A plain list of dicts, over a RunConfig.
  run = jaxtune.RunConfig(steps=1, export=None, out=str(tmp_path / "b"), seq_len=128)
  run_dir, _ = jaxtune.train(run, data=iter(rows))
  assert (run_dir / "config.yaml").is_file()
  with pytest.raises(jaxtune.UserError, match="must yield dicts"):
    jaxtune.train(run.replace(out=str(tmp_path / "c")), data=[1, 2])
  assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------- the pipeline


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_tokenization_is_cached_for_the_same_data_and_tokenizer(tok, plain_tok, tmp_path):
  path = _jsonl(tmp_path / "c.jsonl", _rows("text"))
  first, _, r1 = data_tokenize.load(path, tok, DataSettings(seq_len=64))
  second, _, r2 = data_tokenize.load(path, tok, DataSettings(seq_len=64))
  assert r1.tokenized.startswith("tokenized in") and r2.tokenized.startswith("tokenized earlier")
  np.testing.assert_array_equal(first.input_ids, second.input_ids)
  np.testing.assert_array_equal(first.labels, second.labels)
  # Another tokenizer (here: its template) is another cache entry.
  other = copy.deepcopy(plain_tok)
  other.add_tokens(["<|new|>"])
  _, _, r3 = data_tokenize.load(path, other, DataSettings(seq_len=64))
  assert r3.tokenized.startswith("tokenized in")


def test_long_examples_are_counted_and_truncated_or_dropped(tok, tmp_path):
  lengths = [10, 40, 100]  # next-token pairs of each example
  words = [" ".join(["fox"] * 400)]
  base = _enc(tok, words[0])
  rows = [{"text": tok.decode(base[:n])} for n in lengths]
  pairs = [len(formats.Encoder("text", tok)(r, 0)[0]) - 1 for r in rows]
  path = _jsonl(tmp_path / "long.jsonl", rows)
  ds, _, report = data_tokenize.load(path, tok, DataSettings(seq_len=32, pack=False))
  assert report.long == sum(p > 32 for p in pairs) == 2 and report.long_action == "truncate"
  assert sorted(np.count_nonzero(ds.segment_ids, axis=1)) == sorted(min(p, 32) for p in pairs)
  assert "2 longer than seq-len truncated" in report.line()
  ds, _, report = data_tokenize.load(
    path, tok, DataSettings(seq_len=32, pack=False, long_examples="drop")
  )
  assert report.long == 2 and ds.examples == 1 and "dropped" in report.line()
  # Chat: a truncation that leaves no assistant token drops the example, and says so.
  chats = [
    {"messages": [{"role": "user", "content": "hi " * 60}, {"role": "assistant", "content": "yo"}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
  ]
  ds, _, report = data_tokenize.load(
    _jsonl(tmp_path / "chat.jsonl", chats), tok, DataSettings(seq_len=32)
  )
  assert (report.long, report.no_labels, ds.examples) == (1, 1, 1)
  assert "1 without a trained token dropped" in report.line()


def test_unset_seq_len_holds_99_percent_capped_by_the_model(tok, tmp_path):
  pairs = np.array([300] * 198 + [700] * 2)
  assert data_tokenize.auto_seq_len(pairs, None) == 512  # the 99th percentile is 300
  assert data_tokenize.auto_seq_len(np.array([300] * 97 + [700] * 3), None) == 768
  assert data_tokenize.auto_seq_len(pairs, 256) == 256  # the model's positions
  assert data_tokenize.auto_seq_len(np.array([9000]), None) == 4096
  rows = [{"text": "fox " * k} for k in [20] * 30]
  ds, _, report = data_tokenize.load(
    _jsonl(tmp_path / "s.jsonl", rows), tok, DataSettings(seq_len=None)
  )
  assert ds.seq_len == 256 and report.seq_len_auto and "seq-len 256 (chosen: 99%" in report.line()
  long = [{"text": "fox " * 400}] * 3
  ds, _, report = data_tokenize.load(
    _jsonl(tmp_path / "l.jsonl", long), tok, DataSettings(seq_len=None, max_positions=256)
  )
  assert ds.seq_len == 256 and report.seq_len_capped and "capped" in report.line()


def test_eval_split_is_seeded_disjoint_and_stable(tok, tmp_path):
  path = _jsonl(tmp_path / "e.jsonl", _rows("text", 50))
  train_a, held_a, report = data_tokenize.load(
    path, tok, DataSettings(seq_len=64, eval_split=0.1, seed=3, pack=False)
  )
  train_b, held_b, _ = data_tokenize.load(
    path, tok, DataSettings(seq_len=64, eval_split=0.1, seed=3, pack=False)
  )
  assert report.eval_examples == 5 and held_a.examples == 5 and train_a.examples == 45
  np.testing.assert_array_equal(held_a.input_ids, held_b.input_ids)  # as a resumed run sees
  seen = {tuple(r) for r in train_a.input_ids}
  assert not any(tuple(r) in seen for r in held_a.input_ids)
  _, held_c, _ = data_tokenize.load(
    path, tok, DataSettings(seq_len=64, eval_split=0.1, seed=4, pack=False)
  )
  assert not np.array_equal(held_a.input_ids, held_c.input_ids)


@pytest.mark.parametrize("packing", [True, False])
def test_a_run_configs_data_settings_reach_load(tok, tmp_path, packing):
  """The run layer builds one DataSettings from the RunConfig: its sequence length, packing,
  long-example action and eval split are what the rows are made with."""
  from jaxtune.run import session

  rows = [{"text": f"fox {i} " * 4} for i in range(12)] + [{"text": "fox " * 200}]
  run = jaxtune.RunConfig(
    data=_jsonl(tmp_path / "r.jsonl", rows), seq_len=48, packing=packing,
    long_examples="drop", eval_split=0.25,
  )  # fmt: skip
  ds, held, report = session._load_data(run, tok, 1024, None, None)
  assert ds.seq_len == report.seq_len == 48 and not report.seq_len_auto
  assert (report.long, report.long_action) == (1, "drop")  # the long one, dropped
  assert report.eval_examples == held.examples == 3 and ds.examples == 9
  assert ds.packed is packing and held.seq_len == 48
  assert len(ds) < 9 if packing else len(ds) == 9  # several examples a row, or one each


def test_stream_resumes_at_the_same_example(tok, tmp_path):
  path = _jsonl(tmp_path / "stream.jsonl", _rows("text", 50))
  kw = dict(settings=DataSettings(seq_len=32, seed=1), buffer=16)
  whole = data_streaming.StreamingDataset(path, tok, **kw)
  batches = [whole.batch(i, 4, 1, 1) for i in range(12)]  # crosses buffers and an epoch
  again = data_streaming.StreamingDataset(path, tok, **kw)
  for i in range(5):
    again.batch(i, 4, 1, 1)
  state = again.state()
  resumed = data_streaming.StreamingDataset(path, tok, **kw)
  resumed.seek(json.loads(json.dumps(state)))  # as the checkpoint stores it
  for i in range(5, 12):
    got = resumed.batch(i, 4, 1, 1)
    for k in got:
      np.testing.assert_array_equal(got[k], batches[i][k])
  # Streams map columns and detect formats from their first rows, as tables do.
  mapped = data_streaming.StreamingDataset(
    _jsonl(tmp_path / "qa.jsonl", _rows("mapped")), tok,
    DataSettings(seq_len=32, columns="prompt=question,completion=answer"), buffer=8,
  )  # fmt: skip
  assert mapped.report.format == "prompt_completion"
  assert np.any(mapped.batch(0, 4, 1, 0)["labels"] != IGNORE)


@background_run("streamed_runs")
def _streamed_runs(directory, runs):
  """Command-line runs of streamed data: 4 steps; 2 steps, then resumed to 4. (Their --out
  directories, the three processes.)"""
  path = _jsonl(directory / "stream.jsonl", _rows("text", 60))
  argv = [sys.executable, "-m", "jaxtune.train", "--data", path, "--data-streaming"]
  argv += ["--export", "none", "--schedule", "constant", "--warmup-steps", "0"]
  whole, part = directory / "whole", directory / "part"
  procs = [run_cli([*argv, "--out", str(whole), "--steps", "4"])]
  procs.append(run_cli([*argv, "--out", str(part), "--steps", "2"]))
  procs.append(run_cli([*argv, "--out", str(part), "--steps", "4", "--resume"]))
  return whole, part, procs


@pytest.mark.slow
def test_streamed_run_resumed_matches_an_uninterrupted_one(streamed_runs):
  whole, part, procs = streamed_runs
  for proc in procs:
    assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resuming from step 2 of 4" in procs[2].stderr
  loss = lambda d: [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
  assert loss(part)[-2:] == pytest.approx(loss(whole)[-2:], rel=1e-6)


@background_run("no_torch_children")
def _no_torch_children(directory, runs):
  """The two child processes of the tests below, run beside the other tests."""
  return [run_cli([sys.executable, "-c", code], timeout=300) for code in _NO_TORCH_CODE]


def test_reading_and_tokenizing_need_no_torch(no_torch_children):
  """torch is a test dependency only. The run-time code that could reach it is transformers
  (the tokenizer) and datasets: both work where torch cannot be found, as on a machine without
  it. (No module of ours imports torch: test_imports checks every import statement.)"""
  child = no_torch_children[0]
  assert child.returncode == 0, child.stderr[-2000:]


_NO_TORCH_CODE = [
  """
import importlib.util, sys
_find = importlib.util.find_spec
importlib.util.find_spec = lambda n, p=None: None if n.split(".")[0] == "torch" else _find(n, p)
class NoTorch:
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] == "torch":
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
from jaxtune.data import tokenize as data_tokenize
from jaxtune.data.settings import DataSettings
from jaxtune.run import default_model, loading
tok = loading.load_tokenizer(default_model.ensure_default_checkpoint())
settings = DataSettings(seq_len=128, num_proc=2)
ds, _, report = data_tokenize.load(str(default_model.DATASET), tok, settings)
assert ds.examples == 600, report
assert "torch" not in sys.modules
""",
  (
    "import sys; from jaxtune.run import default_model, loading; from jaxtune.training import "
    "log as run_log; "
    "loading.load_tokenizer(default_model.ensure_default_checkpoint()); "
    "run_log._summary_writer(); "
    "assert 'torch' not in sys.modules, 'torch was imported'; "
    "import torch; torch.zeros(1)"
  ),
]


def _row(value) -> str:
  return json.dumps({"text": value}, ensure_ascii=True) + "\n"


SURROGATES = {
  # text of the "text" field as it is written in the file -> whether it must be refused
  "a-pair": (r"smile \ud83d\ude00", False),
  "high-alone": (r"cut \ud83d here", True),
  "low-alone": (r"cut \ude00 here", True),
  "high-at-the-end": (r"cut \ud83d", True),
  "escaped-backslash": (r"a path C:\\ud800 is text", False),
  "odd-backslashes": (r"\\\ud800 is an escape", True),
  "two-highs": (r"\ud83d\ud83d\ude00", True),
}


@pytest.mark.parametrize("case", SURROGATES)
def test_a_lone_surrogate_is_named_by_file_and_line(tmp_path, case):
  raw, refused = SURROGATES[case]
  path = tmp_path / "s.jsonl"
  path.write_text(_row("fine") * 2 + '{"text": "' + raw + '"}\n' + _row("fine"))
  assert json.loads(path.read_text().splitlines()[2])  # the line is valid JSON either way
  if not refused:
    from jaxtune.data.damage import check_text_file

    check_text_file(path, "json")
    return
  from jaxtune.data import damage

  with pytest.raises(DataError, match=rf"^{path}:3 holds \\u[dD][89a-fA-F]\w\w, half of a UTF-16"):
    damage.check_text_file(path, "json")


def _nested(depth: int) -> str:
  """A messages row whose content is a list nested ``depth`` levels deep in all (the row's own
  object is level 1), with brackets inside a string that must not count."""
  inner = "[" * (depth - 1) + '"[[{{ \\" ]"' + "]" * (depth - 1)
  return '{"text": "x", "extra": ' + inner + "}\n"


def test_rows_nested_deeper_than_arrow_holds_are_named_and_the_limit_is_arrows(tmp_path):
  from jaxtune.data import damage

  deep = damage.MAX_DEPTH
  ok = tmp_path / "ok.jsonl"
  ok.write_text(_row("a") + _nested(deep) + _row("b"))
  damage.check_text_file(ok, "json")
  too = tmp_path / "too.jsonl"
  too.write_text(_row("a") * 4 + _nested(deep + 1) + _row("b"))
  with pytest.raises(DataError, match=rf"^{too}:5 nests \[ and {{ more than {deep} levels deep"):
    damage.check_text_file(too, "json")
  # A file that is one JSON array of rows: the array's own level is not the row's.
  array = tmp_path / "rows.json"
  array.write_text("[\n" + ",\n".join([_row("a").strip(), _nested(deep).strip()]) + "\n]\n")
  damage.check_text_file(array, "json")
  array.write_text("[\n" + ",\n".join([_row("a").strip(), _nested(deep + 1).strip()]) + "\n]\n")
  with pytest.raises(DataError, match=rf"^{array}:3 nests"):
    damage.check_text_file(array, "json")
  # The limit is datasets' own: the deepest row passed reads, one level more does not.
  ds = pytest.importorskip("datasets")
  assert ds.load_dataset("json", data_files=str(ok), split="train").num_rows == 3
  with pytest.raises(Exception) as e:
    ds.load_dataset("json", data_files=str(too), split="train", cache_dir=str(tmp_path / "c"))
  causes, error = [], e.value
  while error is not None:
    causes.append(str(error))
    error = error.__cause__ or error.__context__
  assert any("Recursion level" in cause for cause in causes), causes


@pytest.mark.parametrize(
  "cls_name, name_in_config",
  [
    ("PreTrainedTokenizerFast", None),  # as saved (Llama 3's)
    ("LlamaTokenizerFast", "LlamaTokenizer"),  # Llama 2, Mistral
    ("Qwen2TokenizerFast", "Qwen2Tokenizer"),  # (model-specific: AutoTokenizer decides)
    ("PreTrainedTokenizerFast", "PreTrainedTokenizerFast"),
  ],
)
def test_the_tokenizer_is_the_one_auto_tokenizer_gives(tok, tmp_path, cls_name, name_in_config):
  """loading.load_tokenizer loads a plain tokenizer class without AutoTokenizer (whose import
  pulls in torch), and leaves model-specific ones to it: either way the same class, ids,
  specials and chat text as AutoTokenizer."""
  import transformers
  from transformers import AutoTokenizer

  cls = getattr(transformers, cls_name)
  saved = cls(tokenizer_object=tok.backend_tokenizer, bos_token="<|bos|>", eos_token="<|eos|>")
  saved.chat_template = tok.chat_template
  saved.save_pretrained(tmp_path)
  if name_in_config is not None:
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = name_in_config
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  plain = json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"]
  direct = loading._tokenizer_by_class(tmp_path)
  assert (direct is not None) == (plain in loading.PLAIN_TOKENIZERS), plain
  ours, auto = loading.load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
  assert type(ours) is type(auto)
  text = "Hello there, how are you? 1234 héllo"
  assert ours(text)["input_ids"] == auto(text)["input_ids"]
  chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
  assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
    chat, tokenize=False
  )
  assert (ours.bos_token, ours.eos_token, ours.all_special_ids) == (
    auto.bos_token,
    auto.eos_token,
    auto.all_special_ids,
  )


def test_the_tokenizer_and_tensorboard_import_no_torch(no_torch_children):
  """Where torch is installed, AutoTokenizer's and tensorboardX's imports load it (seconds of
  every command line's start); a plain tokenizer and the TensorBoard writer come without it,
  and torch stays importable after."""
  child = no_torch_children[1]
  assert child.returncode == 0, child.stderr[-2000:]

"""Tests of pwtrain.data: corpus build, tokenizers, packing, determinism and exact resume."""

import glob
import json
import os
import pathlib

import numpy as np
import pytest
from helpers import load_config

from pwtrain.data import build_eval_set, build_tokenizer, build_train_batches, corpus
from pwtrain.data.loader import TrainBatches, merge_states
from pwtrain.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, sentencepiece_path


def make_config(**overrides):
  """configs/palm_tiny.py shrunk for data tests; keys as 'data.seq_len'."""
  settings = {"data.max_files": 30, "data.seq_len": 32, "train.global_batch": 4, **overrides}
  return load_config("palm_tiny", settings)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """One TFDS data_dir for the module, so the small corpora are built once."""
  return str(tmp_path_factory.mktemp("tfds"))


def take(batches, n):
  return [next(batches) for _ in range(n)]


def assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b, strict=True):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])


def token_stream(batches):
  """The packed token stream: each row is a window of seq_len + 1 tokens, in order."""
  rows = [np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1) for b in batches]
  return np.concatenate(rows).ravel()


def test_pystdlib_is_the_stdlib_files_and_max_files_is_its_identity(data_dir):
  small = corpus.prepare_pystdlib(data_dir, max_files=20)
  large = corpus.prepare_pystdlib(data_dir, max_files=25)
  assert small.data_dir != large.data_dir  # no stale reuse across max_files
  paths = corpus.list_source_files(corpus.stdlib_dir(), 20)
  expected = sorted(pathlib.Path(corpus.stdlib_dir(), p).read_bytes() for p in paths)
  # Every file is in exactly one of the splits: training, or held out for evaluation.
  train, held_out = small.as_data_source("train"), small.as_data_source("validation")
  assert sorted(ex["text"] for ex in [*train, *held_out]) == expected
  assert len(train) > len(held_out) >= 1
  assert len(large.as_data_source("train")) + len(large.as_data_source("validation")) == 25
  # A second prepare reuses the build.
  info = pathlib.Path(small.data_dir, "dataset_info.json")
  mtime = info.stat().st_mtime_ns
  corpus.prepare_pystdlib(data_dir, max_files=20)
  assert info.stat().st_mtime_ns == mtime


def test_source_files_are_sorted_sampled_and_skip_tests():
  everything = corpus.list_source_files(corpus.stdlib_dir())
  ten = corpus.list_source_files(corpus.stdlib_dir(), 10)
  assert everything == sorted(everything) and len(everything) > 100
  assert len(ten) == 10 and set(ten) <= set(everything)
  assert len({p.split(os.sep)[0] for p in ten}) > 3  # spread over the library, not a prefix
  assert not any({"test", "tests", "site-packages"} & set(p.split(os.sep)) for p in everything)


def test_default_data_dir_is_in_workdir(tmp_path):
  build_train_batches(make_config(**{"data.max_files": 5}), str(tmp_path))
  assert list((tmp_path / "tfds" / "pystdlib").iterdir())


def test_same_config_same_batches_other_seed_other_batches(data_dir, tmp_path):
  config = make_config(**{"data.data_dir": data_dir})
  _, first = build_train_batches(config, str(tmp_path / "a"))
  _, second = build_train_batches(config, str(tmp_path / "b"))
  reference = take(first, 5)
  assert_same(reference, take(second, 5))
  _, reseeded = build_train_batches(
    make_config(**{"data.data_dir": data_dir, "seed": 1}), str(tmp_path)
  )
  assert not np.array_equal(reference[0]["inputs"], next(reseeded)["inputs"])


def test_batches_are_packed_windows(data_dir, tmp_path):
  config = make_config(**{"data.data_dir": data_dir, "train.global_batch": 16})
  tokenizer, batches = build_train_batches(config, str(tmp_path))
  got = take(batches, 100)  # ~200k tokens: a few dozen documents
  for batch in got:
    assert set(batch) == {"inputs", "targets"}
    for array in batch.values():
      assert array.shape == (16, 32) and array.dtype == np.int32
      assert array.min() >= 0 and array.max() < tokenizer.vocab_size
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
  stream = token_stream(got)
  assert (stream == tokenizer.eos_id).any()  # documents are separated
  assert (stream >= 0).all()  # an endless stream is packed without unfilled positions
  assert "def " in tokenizer.decode(stream)


def test_packing_keeps_every_token_and_reshuffles_each_epoch():
  # 8 documents of one letter each, 172 tokens with their EOS; the longest spans 5 windows.
  docs = [{"text": bytes([ord("a") + i]) * (3 + 5 * i)} for i in range(8)]
  letters = sorted(d["text"].decode() for d in docs)
  tokenizer = ByteTokenizer()

  def documents(config, num_batches):
    stream = token_stream(take(TrainBatches(config, tokenizer, docs), num_batches))
    # Show EOS as "|" to split the decoded stream back into documents.
    return tokenizer.decode(np.where(stream == tokenizer.eos_id, ord("|") + 2, stream)).split("|")

  config = make_config(**{"data.seq_len": 7, "train.global_batch": 2})
  texts = documents(config, 50)  # 800 tokens: 4.6 epochs
  epochs = [texts[i * 8 : (i + 1) * 8] for i in range(4)]
  for epoch in epochs:  # every document once per epoch, whole, nothing else
    assert sorted(epoch) == letters
  assert len({tuple(epoch) for epoch in epochs}) == 4  # a fresh order each epoch
  assert epochs[0] != letters
  # Another seed gives other orders, not the same ones shifted by an epoch.
  reseeded = documents(make_config(**{"data.seq_len": 7, "train.global_batch": 2, "seed": 1}), 50)
  assert reseeded[:8] not in epochs and sorted(reseeded[:8]) == letters

  in_order = make_config(**{"data.seq_len": 7, "train.global_batch": 2, "data.shuffle": False})
  assert documents(in_order, 25)[:16] == letters + letters


def test_resume_mid_epoch_after_json_round_trip(data_dir, tmp_path):
  config = make_config(**{"data.data_dir": data_dir})
  _, batches = build_train_batches(config, str(tmp_path))
  take(batches, 3)
  state = json.loads(json.dumps(batches.get_state()))
  expected = take(batches, 5)
  _, resumed = build_train_batches(config, str(tmp_path))
  resumed.set_state(state)
  assert_same(take(resumed, 5), expected)


def test_resume_from_every_step():
  # Short windows over short documents: many states fall exactly on a document boundary, the case
  # that a naive JSON round trip of Grain's packer state gets wrong.
  docs = [{"text": bytes([ord("a") + i % 26]) * (1 + i % 9)} for i in range(40)]
  config = make_config(**{"data.seq_len": 5, "train.global_batch": 2})
  tokenizer = ByteTokenizer()
  batches = TrainBatches(config, tokenizer, docs)
  for _ in range(40):
    state = json.loads(json.dumps(batches.get_state()))
    expected = take(batches, 2)
    resumed = TrainBatches(config, tokenizer, docs)
    resumed.set_state(state)
    assert_same(take(resumed, 2), expected)


class Recorded(list):
  """A list of documents that notes which it was asked for."""

  def __init__(self, docs):
    super().__init__(docs)
    self.read: set[int] = set()

  def __getitem__(self, index):
    self.read.add(index)
    return super().__getitem__(index)


def test_streams_read_alone_are_the_rows_of_the_whole_batch():
  """data.streams=2: stream i fills rows [4i, 4i+4) of each 8-row batch from its own documents;
  a reader of one stream reads only those documents, gives the same rows, and two such readers'
  states merged resume a reader of both exactly."""
  # 600 documents: the 30 batches read (and the reader's prefetch) stay within the first epoch.
  docs = [{"text": bytes([ord("a") + i % 26]) * (5 + i % 11)} for i in range(600)]
  config = make_config(**{"data.seq_len": 6, "train.global_batch": 8, "data.streams": 2})
  tokenizer = ByteTokenizer()
  whole = take(TrainBatches(config, tokenizer, docs), 30)
  readers = {}
  for stream in (0, 1):
    source = Recorded(docs)
    readers[stream] = TrainBatches(config, tokenizer, source, streams=[stream])
    source.read.clear()  # construction checks a few documents
    own = take(readers[stream], 30)
    rows = slice(4 * stream, 4 * stream + 4)
    other = slice(4 - 4 * stream, 8 - 4 * stream)
    for mine, reference in zip(own, whole, strict=True):
      np.testing.assert_array_equal(mine["inputs"][rows], reference["inputs"][rows])
      np.testing.assert_array_equal(mine["targets"][rows], reference["targets"][rows])
      assert (mine["targets"][other] == -1).all() and (mine["inputs"][other] == 0).all()
    readers[stream].documents = source.read
  assert readers[0].documents and readers[1].documents
  assert not readers[0].documents & readers[1].documents  # each its own documents
  assert len(readers[0].documents | readers[1].documents) < len(docs) / 2
  # Not the single stream: streams pack apart (the batch's documents differ).
  single = take(
    TrainBatches(make_config(**{"data.seq_len": 6, "train.global_batch": 8}), tokenizer, docs), 1
  )
  assert not np.array_equal(single[0]["inputs"], whole[0]["inputs"])

  merged = json.loads(json.dumps(merge_states([r.get_state() for r in readers.values()])))
  resumed = TrainBatches(config, tokenizer, docs)
  resumed.set_state(merged)
  continued = TrainBatches(config, tokenizer, docs)
  take(continued, 30)
  assert_same(take(resumed, 5), take(continued, 5))
  with pytest.raises(ValueError, match=r"lacks streams \[1\]"):
    TrainBatches(config, tokenizer, docs).set_state(readers[0].get_state())


def test_streams_setting_is_checked_and_part_of_the_stream(data_dir, tmp_path):
  with pytest.raises(
    ValueError, match=r"data.streams=3 must divide train.global_batch=4; valid: 1, 2, 4"
  ):
    build_train_batches(make_config(**{"data.streams": 3}), str(tmp_path))
  _, one = build_train_batches(make_config(**{"data.data_dir": data_dir}), str(tmp_path))
  take(one, 2)
  state = one.get_state()
  _, two = build_train_batches(
    make_config(**{"data.data_dir": data_dir, "data.streams": 2}), str(tmp_path)
  )
  with pytest.raises(ValueError, match="data.streams: saved 1, now 2"):
    two.set_state(state)
  # A state saved before data.streams existed (format 1: one stream) still resumes.
  old = {"format": 1, "stream": {k: v for k, v in state["stream"].items() if k != "data.streams"}}
  old["grain"] = state["grain"]["0"]
  _, resumed = build_train_batches(make_config(**{"data.data_dir": data_dir}), str(tmp_path))
  resumed.set_state(json.loads(json.dumps(old)))
  assert_same(take(resumed, 2), take(one, 2))


def test_state_from_other_settings_is_refused(data_dir, tmp_path):
  _, batches = build_train_batches(make_config(**{"data.data_dir": data_dir}), str(tmp_path))
  state = batches.get_state()
  other = make_config(**{"data.data_dir": data_dir, "data.seq_len": 16})
  _, shorter = build_train_batches(other, str(tmp_path))
  with pytest.raises(ValueError, match="data.seq_len"):
    shorter.set_state(state)


def test_byte_tokenizer_round_trip():
  tokenizer = ByteTokenizer()
  text = "def f(x):\n\treturn 'héllo ✓' \x00\n"
  ids = tokenizer.encode(text)
  assert ids.dtype == np.int32 and len(ids) == len(text.encode())
  assert ids.min() >= 2 and ids.max() < tokenizer.vocab_size == 258
  np.testing.assert_array_equal(ids, tokenizer.encode(text.encode()))
  assert tokenizer.decode(ids) == text
  assert tokenizer.decode([tokenizer.eos_id, *ids, tokenizer.pad_id, 300]) == text
  assert (tokenizer.pad_id, tokenizer.eos_id) == (0, 1)


def test_sentencepiece_trains_once_and_is_cached(data_dir, tmp_path):
  config = make_config(
    **{"data.data_dir": data_dir, "data.tokenizer": "sentencepiece", "data.sp_vocab_size": 384}
  )
  tokenizer, batches = build_train_batches(config, str(tmp_path))
  assert isinstance(tokenizer, SentencePieceTokenizer)
  assert (tokenizer.vocab_size, tokenizer.pad_id, tokenizer.eos_id) == (384, 0, 1)
  code = "class A:\n    def f(self, x):\n        return x  # ünïcode\n\n\tpass\n"
  assert tokenizer.decode(tokenizer.encode(code)) == code
  stream = token_stream(take(batches, 100))
  assert stream.max() < 384 and (stream == 1).any()

  path = sentencepiece_path(str(tmp_path), 384)
  mtime = os.stat(path).st_mtime_ns
  # The cached model is used without reading any corpus: this data_dir has none.
  config.data.data_dir = str(tmp_path / "no_corpus_here")
  again = build_tokenizer(config.data, str(tmp_path))
  assert os.stat(path).st_mtime_ns == mtime
  np.testing.assert_array_equal(again.encode(code), tokenizer.encode(code))


def test_sentencepiece_vocab_too_small_is_a_config_error(data_dir, tmp_path):
  config = make_config(
    **{"data.data_dir": data_dir, "data.tokenizer": "sentencepiece", "data.sp_vocab_size": 100}
  )  # below the 256 byte-fallback pieces
  with pytest.raises(ValueError, match="data.sp_vocab_size=100"):
    build_train_batches(config, str(tmp_path))
  assert not os.path.exists(sentencepiece_path(str(tmp_path), 100))


def test_unknown_tokenizer(tmp_path):
  config = make_config(**{"data.tokenizer": "wordpiece"})
  with pytest.raises(ValueError, match="data.tokenizer='wordpiece'.*'byte', 'sentencepiece'"):
    build_tokenizer(config.data, str(tmp_path))


def test_unprepared_tfds_dataset_is_not_downloaded(tmp_path):
  empty = tmp_path / "empty"
  config = make_config(**{"data.dataset": "lm1b", "data.data_dir": str(empty)})
  with pytest.raises(ValueError, match="data.dataset='lm1b'") as error:
    build_train_batches(config, str(tmp_path))
  assert str(empty) in str(error.value) and "tfds build lm1b" in str(error.value)
  assert not empty.exists() or not any(empty.iterdir())  # nothing fetched or written


def test_unknown_tfds_dataset(tmp_path):
  config = make_config(**{"data.dataset": "no_such_dataset_xyz", "data.data_dir": str(tmp_path)})
  with pytest.raises(ValueError, match="data.dataset='no_such_dataset_xyz'"):
    build_train_batches(config, str(tmp_path))


def test_unknown_split(data_dir, tmp_path):
  config = make_config(**{"data.data_dir": data_dir, "data.split": "test"})
  with pytest.raises(ValueError, match=r"data.split='test'.*\['train', 'validation'\]"):
    build_train_batches(config, str(tmp_path))
  config = make_config(**{"data.data_dir": data_dir, "data.eval_split": "test"})
  tokenizer, _ = build_train_batches(config, str(tmp_path))
  with pytest.raises(ValueError, match=r"data.eval_split='test' is not a split"):
    build_eval_set(config, str(tmp_path), tokenizer)


def test_empty_corpus(tmp_path):
  (tmp_path / "src").mkdir()
  with pytest.raises(ValueError, match="data.max_files"):
    corpus.prepare_pystdlib(str(tmp_path / "tfds"), root=str(tmp_path / "src"))
  (tmp_path / "src" / "empty.py").write_bytes(b"")
  with pytest.raises(ValueError, match="corpus would be empty"):
    corpus.prepare_pystdlib(str(tmp_path / "tfds"), root=str(tmp_path / "src"))
  config, tokenizer = make_config(), ByteTokenizer()
  with pytest.raises(ValueError, match="corpus is empty.*data.split='train' has no examples"):
    TrainBatches(config, tokenizer, [])
  with pytest.raises(ValueError, match="corpus is empty: all texts.*data.text_key='text'"):
    TrainBatches(config, tokenizer, [{"text": b""}] * 3)
  with pytest.raises(ValueError, match="data.text_key='text' is not a feature"):
    TrainBatches(config, tokenizer, [{"body": b"x = 1"}])


def test_other_roots_build_as_tfds_datasets(tmp_path):
  (tmp_path / "src" / "pkg").mkdir(parents=True)
  (tmp_path / "src" / "a.py").write_text("a = 1\n")
  (tmp_path / "src" / "pkg" / "b.py").write_text("b = 2\n")
  builder = corpus.prepare_pystdlib(str(tmp_path / "tfds"), root=str(tmp_path / "src"))
  texts = [ex["text"] for split in ("train", "validation") for ex in builder.as_data_source(split)]
  assert sorted(texts) == [b"a = 1\n", b"b = 2\n"]  # one file trains, one is held out
  assert len(builder.as_data_source("validation")) == 1


def test_model_vocab_too_small(data_dir, tmp_path):
  config = make_config(**{"data.data_dir": data_dir, "model.vocab_size": 256})
  with pytest.raises(ValueError, match="model.vocab_size=256.*258"):
    build_train_batches(config, str(tmp_path))


def test_unwritable_data_dir(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")  # a directory cannot be made under a file, not even by root
  config = make_config(**{"data.data_dir": str(blocker / "tfds")})
  with pytest.raises(ValueError, match="data.data_dir=.* is not writable"):
    build_train_batches(config, str(tmp_path))


def test_a_damaged_dataset_file_is_one_clear_error(tmp_path):
  (tmp_path / "src").mkdir()
  for i in range(3):
    (tmp_path / "src" / f"m{i}.py").write_text("x = 1\n" * 2000)
  config = make_config(**{"data.data_dir": str(tmp_path / "tfds")})
  builder = corpus.prepare_pystdlib(config.data.data_dir, root=str(tmp_path / "src"))
  (path,) = glob.glob(os.path.join(os.fspath(builder.data_dir), "*-train.array_record*"))
  with open(path, "r+b") as f:
    f.truncate(1000)
  source = corpus.ReadableSource(builder.as_data_source("train"), builder, config.data, "train")
  with pytest.raises(
    ValueError,
    match=r"data.dataset='pystdlib': a file of .*-train\.\* is "
    r"damaged \(ArrayRecord file should be at least 64KB big\); delete .* and "
    r"run again to rebuild it",
  ):
    source[0]


def test_held_out_files_are_chosen_by_their_own_hash():
  keys = [f"pkg/module_{i}.py" for i in range(400)]
  held = corpus.held_out_keys(keys, 0.05)
  assert 5 < len(held) < 40  # ~5%
  # A file's side depends on its name alone: in a larger or smaller corpus it stays put.
  assert corpus.held_out_keys(keys[:200], 0.05) == {k for k in held if k in keys[:200]}
  # Both sides are non-empty whenever there are two files.
  assert len(corpus.held_out_keys(keys[:2], 0.05)) == 1
  assert len(corpus.held_out_keys(keys[:2], 0.999999)) == 1


def test_eval_set_is_the_held_out_split_packed_in_order(data_dir, tmp_path):
  config = make_config(**{"data.max_files": 40, "data.data_dir": data_dir, "train.eval_batches": 3})
  tokenizer, _ = build_train_batches(config, str(tmp_path))
  first = build_eval_set(config, str(tmp_path), tokenizer)
  again = build_eval_set(config, str(tmp_path), tokenizer)
  assert len(first.batches) == 3
  for a, b in zip(first.batches, again.batches, strict=True):
    for key in ("inputs", "targets"):
      assert a[key].shape == (4, 32) and a[key].dtype == np.int32
      np.testing.assert_array_equal(a[key], b[key])  # the same batches at every evaluation
    assert (a["targets"] >= 0).all()  # the split repeats: every position is a target
  # Read in order: the stream starts with the first held-out file.
  source = corpus.open_source(config.data, str(tmp_path), split="validation")
  head = tokenizer.encode(source[0]["text"])[:32]
  np.testing.assert_array_equal(first.batches[0]["inputs"][0, : len(head)], head)
  # Bits per byte count the bytes of text the targets stand for: one per byte id, none for EOS.
  targets = np.concatenate([b["targets"].ravel() for b in first.batches])
  text = bytes((targets[targets >= tokenizer.offset] - tokenizer.offset).astype(np.uint8).tolist())
  assert first.num_bytes == len(text) <= len(targets)


# -- your own files and tokenizers ------------------------------------------------------------


def own_files(root):
  """Two text files and a JSONL file of 40 documents under `root`."""
  root.mkdir(exist_ok=True)
  (root / "a.txt").write_text("alpha " * 300)
  (root / "b.md").write_text("# beta\n" + "beta gamma\n" * 200)
  lines = [json.dumps({"text": f"document {i}: " + "delta " * 40, "id": i}) for i in range(40)]
  (root / "c.jsonl").write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]) + "\n")
  return f"{root}/*.txt, {root}/*.md,{root}/*.jsonl"


def test_own_files_are_built_split_and_rebuilt_when_they_change(tmp_path):
  files = own_files(tmp_path / "own")
  config = make_config(**{"data.dataset": "files", "data.files": files})
  train_source = corpus.open_source(config.data, str(tmp_path))
  eval_source = corpus.open_source(config.data, str(tmp_path), split="validation")
  texts = sorted(ex["text"] for ex in [*train_source, *eval_source])
  assert len(texts) == 42  # 2 files + 40 JSONL lines (the blank line skipped)
  assert b"alpha " * 300 in texts and any(t.startswith(b"document 7: ") for t in texts)
  assert 1 <= len(eval_source) < len(train_source)
  tokenizer, batches = build_train_batches(config, str(tmp_path))
  stream = np.concatenate([b["inputs"].ravel() for b in [next(batches) for _ in range(20)]])
  assert b"delta" in bytes((stream[stream >= 2] - 2).astype(np.uint8).tolist())
  # Editing a file makes a new build; the resumed stream would differ, so resuming is refused.
  state = batches.get_state()
  (tmp_path / "own" / "a.txt").write_text("changed " * 300)
  # Either split: a document's side is decided by a hash of its absolute path, which holds
  # pytest's tmp_path, so a.txt is held out in about one run in twenty.
  rebuilt = [
    *corpus.open_source(config.data, str(tmp_path)),
    *corpus.open_source(config.data, str(tmp_path), split="validation"),
  ]
  assert any(ex["text"].startswith(b"changed") for ex in rebuilt)
  _, fresh = build_train_batches(config, str(tmp_path))
  with pytest.raises(ValueError, match=r"data.files: files changed .*own/a\.txt") as refused:
    fresh.set_state(state)
  assert "added" not in str(refused.value) and "removed" not in str(refused.value)
  (tmp_path / "own" / "e.txt").write_text("new " * 300)
  (tmp_path / "own" / "b.md").unlink()
  _, fresh = build_train_batches(config, str(tmp_path))
  with pytest.raises(ValueError, match=r"files added .*e\.txt; removed .*b\.md; changed .*a\.txt"):
    fresh.set_state(state)


def test_own_files_errors_name_the_setting(tmp_path):
  config = make_config(**{"data.dataset": "files", "data.files": str(tmp_path / "none*.txt")})
  with pytest.raises(ValueError, match=r"data.files=.* matches no files"):
    build_train_batches(config, str(tmp_path))
  (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
  config = make_config(**{"data.dataset": "files", "data.files": str(tmp_path / "bad.jsonl")})
  with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not a JSON object .*'text'"):
    build_train_batches(config, str(tmp_path))


def test_bad_records_can_be_skipped_counted_and_named(tmp_path, caplog):
  """data.skip_bad_records=True: a JSONL line without the text field and a file that is not
  UTF-8 are skipped, counted and named in one line; the good records are the corpus."""
  import logging

  lines = [json.dumps({"text": f"good line {i} " * 20}) for i in range(40)]
  lines.insert(3, '{"body": "no text"}')
  lines.insert(7, "not json at all")
  (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
  (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait ".encode("latin-1") * 20)
  files = f"{tmp_path}/*.jsonl,{tmp_path}/*.txt"
  config = make_config(
    **{"data.dataset": "files", "data.files": files, "data.skip_bad_records": True}
  )
  with caplog.at_level(logging.WARNING, logger="pwtrain"):
    build_train_batches(config, str(tmp_path / "work"))
  (line,) = [r.getMessage() for r in caplog.records if "skip_bad_records" in r.getMessage()]
  assert line.startswith("data.skip_bad_records: skipped 3 bad record(s) of data.files: ")
  for name in (
    "mixed.jsonl:4 (KeyError",
    "mixed.jsonl:8 (JSONDecodeError",
    "latin1.txt (not UTF-8",
  ):
    assert name in line, line


def test_a_skipped_record_never_leaves_the_validation_split_empty(tmp_path):
  """The held-out split is drawn from the records that read cleanly: here the one file the hash
  would hold out is the bad one, and the good files still give both splits. (The good names are
  ones the hash keeps in training: among many keys, exactly those it holds out are held out.)"""
  candidates = [str(tmp_path / f"good{i}.txt") for i in range(1000)]
  held = corpus.held_out_keys(candidates, corpus.EVAL_FRACTION)
  good = [path for path in candidates if path not in held][:4]
  bad = next(
    str(tmp_path / f"bad{i}.txt")
    for i in range(10_000)
    if corpus.held_out_keys([*good, str(tmp_path / f"bad{i}.txt")], corpus.EVAL_FRACTION)
    == {str(tmp_path / f"bad{i}.txt")}
  )
  for path in good:
    pathlib.Path(path).write_text(f"{path} is good text " * 20)
  pathlib.Path(bad).write_bytes("caf\xe9 ".encode("latin-1") * 20)
  config = make_config(
    **{"data.dataset": "files", "data.files": f"{tmp_path}/*.txt", "data.skip_bad_records": True}
  )
  build_train_batches(config, str(tmp_path / "work"))
  held_out = corpus.open_source(config.data, str(tmp_path / "work"), split="validation")
  assert len(held_out) == 1


def test_a_one_document_corpus_names_the_missing_validation_split(tmp_path):
  (tmp_path / "only.txt").write_text("all the text there is " * 20)
  config = make_config(**{"data.dataset": "files", "data.files": str(tmp_path / "only.txt")})
  build_train_batches(config, str(tmp_path / "work"))
  assert corpus.held_out_keys(["whatever it hashes to"], fraction=1.0) == set()  # never held out
  with pytest.raises(ValueError, match=r"one document holds none out: add files, or set train"):
    corpus.open_source(config.data, str(tmp_path / "work"), split="validation")


def llama_like_sentencepiece(path):
  """A SentencePiece model with another id layout than pwtrain's own: unk 0, bos 1, eos 2, no
  pad (as LLaMA's)."""
  import io

  import sentencepiece as spm

  model = io.BytesIO()
  lines = [f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}" for i in range(300)]
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(lines), model_writer=model, vocab_size=400, model_type="bpe",
    unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, minloglevel=2,
  )  # fmt: skip
  path.write_bytes(model.getvalue())
  return str(path)


def test_an_existing_sentencepiece_model_is_loaded_with_its_own_ids(tmp_path):
  path = llama_like_sentencepiece(tmp_path / "sp.model")
  config = make_config(
    **{
      "data.dataset": "files",
      "data.files": own_files(tmp_path / "own"),
      "data.tokenizer": "sentencepiece",
      "data.tokenizer_path": path,
    }
  )
  tokenizer, batches = build_train_batches(config, str(tmp_path))
  assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id) == (400, 2, 2)
  assert not os.path.exists(tmp_path / "tokenizer")  # nothing trained
  text = "the quick brown fox"
  assert tokenizer.decode(tokenizer.encode(text)) == text
  stream = np.concatenate([b["inputs"].ravel() for b in [next(batches) for _ in range(20)]])
  assert (stream == 2).any() and stream.max() < tokenizer.vocab_size  # EOS separates documents
  assert tokenizer.token_bytes[tokenizer.encode(" fox")].sum() == 4
  with pytest.raises(ValueError, match="model.vocab_size=300 is smaller .* 400"):
    build_train_batches(
      make_config(**{**config_overrides(config), "model.vocab_size": 300}), str(tmp_path)
    )


def config_overrides(config):
  keys = ("dataset", "files", "tokenizer", "tokenizer_path")
  return {f"data.{k}": config.data[k] for k in keys}


def test_a_hugging_face_tokenizer_is_loaded(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=["<unk>", "</s>"],
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator([f"def f{i}(x):\n    return x + {i}\n" for i in range(200)], trainer)
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  config = make_config(
    **{
      "data.dataset": "files",
      "data.files": own_files(tmp_path / "own"),
      "data.tokenizer": "huggingface",
      "data.tokenizer_path": path,
    }
  )
  tokenizer, batches = build_train_batches(config, str(tmp_path))
  assert tokenizer.eos_id == tok.token_to_id("</s>") and tokenizer.vocab_size <= 300
  text = "def g(y):\n    return y * 2\n"
  assert tokenizer.decode(tokenizer.encode(text)) == text
  assert tokenizer.token_bytes[tokenizer.encode(text)].sum() == len(text.encode())
  assert tokenizer.token_bytes[tokenizer.eos_id] == 0
  stream = np.concatenate([b["inputs"].ravel() for b in [next(batches) for _ in range(30)]])
  assert (stream == tokenizer.eos_id).any()  # EOS separates documents
  with pytest.raises(ValueError, match=r"data.eos_token='<eot>'"):
    build_train_batches(
      make_config(**{**config_overrides(config), "data.eos_token": "<eot>"}), str(tmp_path)
    )
  with pytest.raises(ValueError, match=r"data.tokenizer_path=.*missing.json' is not a file"):
    build_train_batches(
      make_config(
        **{**config_overrides(config), "data.tokenizer_path": str(tmp_path / "missing.json")}
      ),
      str(tmp_path),
    )

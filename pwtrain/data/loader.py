"""Training batches: a Grain pipeline from a random-access text source to packed token windows.

  source -> shuffle(seed) -> repeat (reshuffled per epoch) -> [every k-th: stream i of k]
    -> tokenize (tokenizer.document: + EOS) -> (iterator) -> concat-then-split into windows of
    seq_len + 1
    -> batch -> {'inputs', 'targets'}

Packing follows PaLM: documents are concatenated with EOS separators and cut into fixed windows,
so no token is padding and long documents span several windows. The reader runs in-process (one
prefetch thread per stream), which keeps it deterministic and cheap next to the training step,
and the whole iterator position is a small JSON state for the checkpoint.

Streams (`data.streams` = k, default 1). Packing makes a window depend on every document before
it, so one packed stream can only be read whole. With k streams, stream i packs documents i,
i + k, i + 2k, ... of the shuffled sequence on its own and fills rows [i*B/k, (i+1)*B/k) of
every batch of B rows. A reader may then read only some streams (distributed mode: the rows its
processes' islands consume, e.g. one stream per pod); the batches are the same in every mode and
process count for the same k. k = 1 is the single stream of before.
"""

import dataclasses
import json
from collections.abc import Collection, Sequence
from typing import Any

import grain
import numpy as np

from pwtrain.data import corpus
from pwtrain.data import tokenizer as tokenizer_lib
from pwtrain.errors import DataError

# 2: one Grain state per stream read ("grain": {"<i>": state}); 1 (still read): one stream,
# "grain": its state.
STATE_FORMAT = 2

# The target of a window position no document filled: negative, which carries no loss
# (models.lm_loss), so that no real token id has to be given up for padding.
NO_TARGET = -1

# Documents read ahead by the prefetch thread. A batch of the default config needs a fraction of
# one stdlib file (or ~70 lm1b sentences), so a small buffer hides the read without competing
# with the training step for the CPU.
_PREFETCH_DOCS = 64

# The config entries that decide which token lands where: a state saved under other values would
# restore to a different stream, so `set_state` refuses it. (`train.global_batch` is absent: the
# state counts windows, so a resumed run may change its batch size.)
_STREAM_KEYS = (
  "seed",
  "data.dataset",
  "data.split",
  "data.text_key",
  "data.tokenizer",
  "data.add_special_tokens",
  "data.seq_len",
  "data.shuffle",
  "data.streams",
)


class TrainBatches:
  """Endless iterator of {'inputs': int32[B, L], 'targets': int32[B, L]}, exactly resumable.

  B = train.global_batch and L = data.seq_len; `targets` is `inputs` shifted left by one within
  each packed window of L + 1 tokens, with `NO_TARGET` (-1: no loss) wherever the window has no
  token.

  `streams` (default: all of data.streams) are the streams this reader reads, possibly none;
  the rows of the others hold inputs 0 and targets NO_TARGET, and whoever made the reader
  promises not to use them (distributed mode: no island of this process consumes them).
  """

  def __init__(
    self,
    config: Any,
    tokenizer: Any,
    source: Sequence[dict[str, Any]],
    streams: Collection[int] | None = None,
  ):
    data_cfg = config.data
    if data_cfg.seq_len < 1:
      raise DataError(f"data.seq_len must be >= 1, got {data_cfg.seq_len}.")
    if config.train.global_batch < 1:
      raise DataError(f"train.global_batch must be >= 1, got {config.train.global_batch}.")
    check_streams(data_cfg.streams, config.train.global_batch)
    if config.seed < 0:
      raise DataError(f"seed must be >= 0 (it seeds the data shuffle), got {config.seed}.")
    if tokenizer.vocab_size > config.model.vocab_size:
      raise DataError(
        f"model.vocab_size={config.model.vocab_size} is smaller than the vocabulary of "
        f"data.tokenizer={data_cfg.tokenizer!r} ({tokenizer.vocab_size} ids); raise "
        f"model.vocab_size to at least {tokenizer.vocab_size}."
      )
    corpus.check_source(source, data_cfg)
    self.tokenizer = tokenizer
    self.seq_len = data_cfg.seq_len
    self.global_batch = config.train.global_batch
    self.num_streams = data_cfg.streams
    self.streams = tuple(range(self.num_streams) if streams is None else sorted(set(streams)))
    if not set(self.streams) <= set(range(self.num_streams)):
      raise DataError(f"streams {self.streams} are not all below data.streams={self.num_streams}")
    self._stream = _stream_settings(config)
    seed = config.seed if data_cfg.shuffle else None
    self.rows_per_stream = self.global_batch // self.num_streams
    self._iterators = {
      i: iter(
        packed_batches(
          source,
          data_cfg.text_key,
          tokenizer,
          self.seq_len,
          self.rows_per_stream,
          seed,
          (i, self.num_streams),
        )
      )
      for i in self.streams
    }

  def __iter__(self) -> "TrainBatches":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = {i: _inputs_and_targets(next(it)) for i, it in self._iterators.items()}
    shape, rows = (self.global_batch, self.seq_len), self.rows_per_stream
    batch = {"inputs": np.zeros(shape, np.int32), "targets": np.full(shape, NO_TARGET, np.int32)}
    for i, part in parts.items():
      for key in batch:
        batch[key][i * rows : (i + 1) * rows] = part[key]
    return batch

  def get_state(self) -> dict[str, Any]:
    """A JSON-serialisable position of the streams read here: the next batch after
    `set_state(state)` is this one's next. (Distributed mode merges the processes' states into
    one with every stream: `merge_states`.)"""
    return {
      "format": STATE_FORMAT,
      "stream": dict(self._stream),
      "grain": {str(i): _to_json(it.get_state()) for i, it in self._iterators.items()},
    }

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores the position of every stream read here from `state` (which may hold more); an
    empty state, {}, is every stream's start (a checkpoint written before any data was read:
    an imported model's, pwtrain.convert)."""
    if not state:
      return
    state = _current_format(state)
    changed = {
      key: (value, self._stream.get(key))
      for key, value in state["stream"].items()
      if self._stream.get(key) != value
    }
    seen = changed.pop("data.files_seen", None)
    if seen and "data.files" in changed:  # which files: added, removed or changed since
      changed["data.files"] = _files_changed(*seen)
    if changed:
      details = ", ".join(
        f"{k}: {old}" if k == "data.files" and seen else f"{k}: saved {old!r}, now {new!r}"
        for k, (old, new) in changed.items()
      )
      raise DataError(
        f"The data iterator state was saved with other settings ({details}); resuming would "
        f"produce a different token stream. Restore those settings or use a fresh workdir."
      )
    missing = [i for i in self._iterators if str(i) not in state["grain"]]
    if missing:
      raise DataError(f"The data iterator state lacks streams {missing} of data.streams")
    for i, it in self._iterators.items():
      it.set_state(_from_json(state["grain"][str(i)]))


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """One state with the streams of all `states` (get_state of readers of one config that read
  different streams; a stream read by several is at the same position in each)."""
  merged = dict(states[0], grain={})
  for state in states:
    merged["grain"].update(state["grain"])
  merged["grain"] = dict(sorted(merged["grain"].items(), key=lambda item: int(item[0])))
  return merged


def streams_of_rows(config: Any, rows: Collection[int]) -> tuple[int, ...]:
  """The streams (of data.streams) that fill any of `rows` (rows of the global batch)."""
  per_stream = config.train.global_batch // config.data.streams
  return tuple(sorted({row // per_stream for row in rows}))


def check_streams(streams: Any, global_batch: int) -> None:
  """Raises ValueError unless `data.streams` is a positive divisor of train.global_batch."""
  if not isinstance(streams, int) or streams < 1 or global_batch % streams:
    valid = ", ".join(str(n) for n in range(1, global_batch + 1) if global_batch % n == 0)
    raise DataError(
      f"data.streams={streams!r} must divide train.global_batch={global_batch}; valid: {valid}"
    )


def _current_format(state: dict[str, Any]) -> dict[str, Any]:
  if state.get("format") == 1:  # one stream, saved before data.streams existed
    return {
      "format": STATE_FORMAT,
      "stream": {**state["stream"], "data.streams": 1},
      "grain": {"0": state["grain"]},
    }
  if state.get("format") != STATE_FORMAT:
    raise DataError(f"Unknown data iterator state format {state.get('format')!r}.")
  return state


def packed_batches(
  source, text_key: str, tokenizer, seq_len: int, batch: int, seed: int | None, stream=(0, 1)
):
  """The endless Grain pipeline of packed windows of seq_len + 1 tokens, `batch` per batch; the
  documents shuffled (anew each epoch) with `seed`, or read in order when it is None. `stream`
  (i, k) packs only every k-th document from the i-th on (k = 1: all)."""

  def tokenize(example):
    return {"tokens": tokenizer.document(example[text_key])}

  ds = grain.MapDataset.source(source)
  if seed is not None:
    # A global shuffle by index permutation: no buffer, and reading stays random access. Shuffle
    # *before* repeat, so that Grain permutes epoch e with shuffle_seed + e: a fresh order each
    # epoch, reproducibly. That is also why the config seed is hashed first: used as is, seed 1
    # would replay seed 0's second epoch as its first. (Grain wants a uint32.)
    shuffle_seed = int(np.random.SeedSequence(seed).generate_state(1)[0])
    ds = ds.shuffle(seed=shuffle_seed)
  # Endless: training stops by step count, evaluation by batch count.
  ds = ds.repeat()
  index, count = stream
  if count > 1:
    ds = ds[index::count]
  ds = ds.map(tokenize)
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=_PREFETCH_DOCS))
  ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})
  return ds.batch(batch, drop_remainder=True)


def _inputs_and_targets(batch: dict) -> dict[str, np.ndarray]:
  tokens = batch["tokens"]
  # Segment id 0 marks window positions no document filled. An endless stream never leaves any,
  # but the loss mask must not depend on that, nor on the packer padding with 0.
  filled = batch["tokens_segment_ids"][:, 1:] != 0
  return {
    "inputs": np.ascontiguousarray(tokens[:, :-1]),
    "targets": np.where(filled, tokens[:, 1:], np.int32(NO_TARGET)),
  }


@dataclasses.dataclass(frozen=True)
class EvalSet:
  """The batches every evaluation of a run reads, and the text they stand for."""

  batches: list[dict[str, np.ndarray]]  # {"inputs", "targets"}: int32[train.global_batch, L]
  num_bytes: int  # UTF-8 bytes of text the real (>= 0) targets stand for (bits per byte)


def build_eval_set(config: Any, workdir: str, tokenizer: Any) -> EvalSet:
  """`train.eval_batches` batches of `data.eval_split`, packed like training's but read in
  order from the split's start (again from the start if the split runs out, so every window
  position is a target): the same batches whenever it is called with the same config."""
  source = corpus.open_source(config.data, workdir, split=config.data.eval_split)
  data_cfg, train_cfg = config.data, config.train
  ds = packed_batches(
    source, data_cfg.text_key, tokenizer, data_cfg.seq_len, train_cfg.global_batch, None
  )
  iterator = iter(ds)
  batches = [_inputs_and_targets(next(iterator)) for _ in range(train_cfg.eval_batches)]
  sizes = tokenizer.token_bytes
  num_bytes = sum(int(sizes[b["targets"][b["targets"] >= 0]].sum()) for b in batches)
  return EvalSet(batches, num_bytes)


def open_train_source(config: Any, workdir: str) -> tuple[Any, Sequence[dict[str, Any]]]:
  """Opens (preparing if needed) the training corpus and builds the tokenizer: (tokenizer,
  source), what a TrainBatches is made from."""
  source = corpus.open_source(config.data, workdir)
  return tokenizer_lib.build_tokenizer(config.data, workdir, source=source), source


def build_train_batches(config: Any, workdir: str) -> tuple[Any, TrainBatches]:
  """(tokenizer, batches of every stream) of the training corpus (open_train_source)."""
  tokenizer, source = open_train_source(config, workdir)
  return tokenizer, TrainBatches(config, tokenizer, source)


def _stream_settings(config: Any) -> dict[str, Any]:
  settings = {key: _lookup(config, key) for key in _STREAM_KEYS}
  # These matter only for the built-in corpus / for SentencePiece; elsewhere changing them is
  # harmless and must not block a resume.
  if config.data.dataset == corpus.BUILTIN:
    settings["data.max_files"] = config.data.max_files
  if config.data.dataset == corpus.FILES:  # which files, as they are now
    settings["data.files"] = corpus.files_identity(config.data)[1]
    settings["data.files_seen"] = corpus.files_seen(config.data)  # named if they change
  if config.data.tokenizer_path:  # the tokenizer file's content
    settings["data.tokenizer_path"] = tokenizer_lib.file_identity(config.data.tokenizer_path)
  elif config.data.tokenizer == "sentencepiece":
    settings["data.sp_vocab_size"] = config.data.sp_vocab_size
  return settings


def _files_changed(saved: dict, now: dict) -> tuple[str, None]:
  """What changed in data.files since the state was saved, naming the files."""
  parts = []
  for what, names in (
    ("added", sorted(set(now) - set(saved))),
    ("removed", sorted(set(saved) - set(now))),
    ("changed", sorted(k for k in set(saved) & set(now) if saved[k] != now[k])),
  ):
    if names:
      more = f" and {len(names) - 3} more" if len(names) > 3 else ""
      parts.append(f"{what} {', '.join(names[:3])}{more}")
  return "files " + "; ".join(parts or ["differ"]), None


def _lookup(config: Any, dotted: str) -> Any:
  for name in dotted.split("."):
    config = config[name]
  return config


def _to_json(state: Any) -> Any:
  """Grain's state as plain JSON values (tuples become lists; anything else JSON lacks fails here,
  not later inside the checkpointer)."""
  return json.loads(json.dumps(state))


def _from_json(state: Any) -> Any:
  """Undoes JSON's tuple -> list: Grain states hold no lists, but do hold tuples that matter.

  The packer (ConcatThenSplit) marks "no remainder" with the tuple (-1, -1) and tests it with
  `!=`; given the list [-1, -1] from JSON it believes a remainder is pending and, on restore,
  drops the next document. Grain's own Orbax handler round-trips through JSON the same way.
  """
  if isinstance(state, dict):
    return {key: _from_json(value) for key, value in state.items()}
  if isinstance(state, list):
    return tuple(_from_json(value) for value in state)
  return state

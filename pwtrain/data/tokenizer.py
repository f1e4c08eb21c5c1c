"""Tokenizers: raw bytes, SentencePiece (trained on the corpus and cached in the workdir, or an
existing model at `data.tokenizer_path`), or a Hugging Face `tokenizers` JSON file.

Documents are separated by `eos_id`. The byte tokenizer and pwtrain's own SentencePiece models
reserve id 0 for padding and id 1 for EOS; a loaded tokenizer keeps its own ids (padding is only
for display: the loss ignores negative targets, not an id). Interface: `vocab_size`, `pad_id`,
`eos_id`, `token_bytes`, `encode(str | bytes) -> int32[n]`, `decode(ids)`, and what a document
and a prompt are in the token stream, `document(text)` and `prompt(text)` (`Documents`).
"""

import functools
import hashlib
import io
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import sentencepiece as spm

from pwtrain.data import corpus
from pwtrain.errors import DataError

TOKENIZERS = ("byte", "sentencepiece", "huggingface")
# data.eos_token="" for a Hugging Face tokenizer: the first of these in its vocabulary.
EOS_TOKENS = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
PAD_ID = 0
EOS_ID = 1

# SentencePiece trains on at most this much text (evenly spaced examples, split into lines), so
# training takes about a second whatever the corpus size; more barely changes a small vocab.
_SP_TRAIN_BYTES = 4_000_000
_SP_TRAIN_MAX_EXAMPLES = 20_000


class Documents:
  """A document in the packed stream is its ids then EOS, which separates it from the next; a
  prompt is the start of a document, so it follows an EOS. Generation (sampling, serving) stops
  at any of `stop_ids`: EOS, and a Hugging Face tokenizer's data.stop_tokens."""

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  def document(self, text: str | bytes) -> np.ndarray:
    return np.append(self.encode(text), np.int32(self.eos_id))

  def prompt(self, text: str | bytes) -> np.ndarray:
    return np.concatenate([[self.eos_id], self.encode(text)]).astype(np.int32)


class ByteTokenizer(Documents):
  """UTF-8 bytes: byte b has id b + 2, after pad (0) and EOS (1). Never unknown, never trained."""

  pad_id = PAD_ID
  eos_id = EOS_ID
  offset = 2
  vocab_size = 256 + offset

  @property
  def token_bytes(self) -> np.ndarray:
    """int64[vocab_size]: the UTF-8 bytes each id stands for (1 per byte; pad and EOS none)."""
    return (np.arange(self.vocab_size) >= self.offset).astype(np.int64)

  def encode(self, text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, np.uint8).astype(np.int32) + self.offset

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Drops special and out-of-range ids (e.g. from a model whose vocab is padded)."""
    ids = np.asarray(ids, np.int64).ravel()
    data = ids[(ids >= self.offset) & (ids < self.vocab_size)] - self.offset
    # A model may cut a multi-byte character in two; show that rather than fail.
    return data.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer(Documents):
  """A trained SentencePiece model with pad id 0 and EOS id 1 (see `train_sentencepiece`)."""

  def __init__(self, model_path: str):
    self.model_path = model_path
    try:
      self._sp = spm.SentencePieceProcessor(model_file=model_path)
    except (OSError, RuntimeError) as e:
      raise DataError(
        f"data.tokenizer_path={model_path!r} is not a SentencePiece model ({_first_line(e)})"
      ) from None
    self.eos_id = self._sp.eos_id()
    if self.eos_id < 0:
      raise DataError(
        f"data.tokenizer_path={model_path!r}: the SentencePiece model has no end-of-sequence "
        "piece, which separates documents; use a model trained with one (eos_id >= 0)"
      )
    self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id
    self.vocab_size = self._sp.get_piece_size()

  @functools.cached_property
  def token_bytes(self) -> np.ndarray:
    """int64[vocab_size]: the UTF-8 bytes each piece stands for ("▁" is a space, a byte-fallback
    piece one byte; control and unknown pieces none)."""
    sp = self._sp
    sizes = np.zeros(self.vocab_size, np.int64)
    for i in range(self.vocab_size):
      if sp.is_byte(i):
        sizes[i] = 1
      elif not (sp.is_control(i) or sp.is_unknown(i)):
        sizes[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    return sizes

  def encode(self, text: str | bytes) -> np.ndarray:
    if not isinstance(text, str):
      text = bytes(text).decode("utf-8", errors="replace")
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Drops pad/EOS and out-of-range ids, like `ByteTokenizer.decode`."""
    ids = np.asarray(ids, np.int64).ravel()
    keep = (ids != self.pad_id) & (ids != self.eos_id) & (ids >= 0) & (ids < self.vocab_size)
    return self._sp.decode(ids[keep].tolist())


class HuggingFaceTokenizer(Documents):
  """A Hugging Face `tokenizers` JSON file (`pip install 'pwtrain[tokenizers]'`); EOS is
  `eos_token`, or the first of EOS_TOKENS in its vocabulary; generation also stops at
  `stop_tokens` (data.stop_tokens).

  With `add_special_tokens` (data.add_special_tokens: an imported model's, pwtrain.convert),
  documents and prompts are encoded as transformers encodes them, with the special tokens the
  tokenizer's post-processor adds (a BOS where it adds one): a document is that, then EOS unless
  the tokenizer ended it with one; a prompt is that without a final EOS, and no EOS in front."""

  def __init__(
    self,
    path: str,
    eos_token: str = "",
    add_special_tokens: bool = False,
    stop_tokens: Sequence[str] = (),
  ):
    try:
      import tokenizers
    except ImportError:
      raise DataError(
        "data.tokenizer='huggingface' needs the tokenizers package: "
        "pip install 'pwtrain[tokenizers]'"
      ) from None
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the library raises its own exception types
      raise DataError(
        f"data.tokenizer_path={path!r} is not a Hugging Face tokenizer JSON ({_first_line(e)})"
      ) from None
    vocab = self._tok.get_vocab(with_added_tokens=True)
    candidates = (eos_token,) if eos_token else EOS_TOKENS
    found = [t for t in candidates if t in vocab]
    if not found:
      raise DataError(
        f"data.eos_token={eos_token!r}: {', '.join(candidates)} not in the vocabulary of "
        f"{path!r}; set data.eos_token to the token that ends a document"
      )
    self.eos_id = vocab[found[0]]
    unknown = [t for t in stop_tokens if t not in vocab]
    if unknown:
      raise DataError(
        f"data.stop_tokens: {unknown[0]!r} is not in the vocabulary of {path!r}; list tokens of "
        "this tokenizer"
      )
    self._stop_ids = tuple(dict.fromkeys([self.eos_id, *(vocab[t] for t in stop_tokens)]))
    self.pad_id = self.eos_id
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self._special = {v for k, v in vocab.items() if k in _added_special(self._tok)}
    self.add_special_tokens = add_special_tokens

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """EOS, then data.stop_tokens' ids."""
    return self._stop_ids

  @functools.cached_property
  def token_bytes(self) -> np.ndarray:
    """int64[vocab_size]: the UTF-8 bytes each id decodes to alone (special tokens none)."""
    sizes = np.zeros(self.vocab_size, np.int64)
    for i in range(self.vocab_size):
      if i not in self._special:
        sizes[i] = len(self._tok.decode([i], skip_special_tokens=True).encode("utf-8"))
    return sizes

  def encode(self, text: str | bytes) -> np.ndarray:
    if not isinstance(text, str):
      text = bytes(text).decode("utf-8", errors="replace")
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Drops special and out-of-range ids, like the other tokenizers."""
    ids = np.asarray(ids, np.int64).ravel()
    keep = (ids >= 0) & (ids < self.vocab_size)
    return self._tok.decode(ids[keep].tolist(), skip_special_tokens=True)

  def _with_special(self, text) -> np.ndarray:
    if not isinstance(text, str):
      text = bytes(text).decode("utf-8", errors="replace")
    return np.asarray(self._tok.encode(text, add_special_tokens=True).ids, np.int32)

  def document(self, text: str | bytes) -> np.ndarray:
    if not self.add_special_tokens:
      return super().document(text)
    ids = self._with_special(text)
    return ids if len(ids) and ids[-1] == self.eos_id else np.append(ids, np.int32(self.eos_id))

  def prompt(self, text: str | bytes) -> np.ndarray:
    if not self.add_special_tokens:
      return super().prompt(text)
    ids = self._with_special(text)
    return ids[:-1] if len(ids) and ids[-1] == self.eos_id else ids


def _added_special(tok) -> set[str]:
  return {t.content for t in tok.get_added_tokens_decoder().values() if t.special}


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def file_identity(path: str) -> str:
  """A short hash of a file's bytes: which tokenizer file a data stream was made with."""
  with open(os.path.expanduser(path), "rb") as f:
    return hashlib.sha1(f.read()).hexdigest()[:16]


def train_sentencepiece(lines: Iterator[str], vocab_size: int, model_path: str) -> None:
  """Trains a BPE model for source code / text and writes it to `model_path` atomically."""
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=lines,
      model_writer=model,
      vocab_size=vocab_size,
      model_type="bpe",  # trains ~20x faster than unigram here, with as good a compression
      pad_id=PAD_ID,
      eos_id=EOS_ID,
      unk_id=2,
      bos_id=-1,  # documents are only separated (by EOS), as in PaLM
      # Exact round trip, which code needs: no Unicode normalisation, keep every space (Python
      # indentation), no invented leading space; unseen characters fall back to byte pieces
      # (these take 256 ids, so the vocab must exceed ~300).
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      add_dummy_prefix=False,
      allow_whitespace_only_pieces=True,
      byte_fallback=True,
      max_sentence_length=1 << 16,
      num_threads=os.cpu_count() or 1,
      minloglevel=2,
    )
  except RuntimeError as e:  # e.g. "Vocabulary size too high (N). Please set it to <= M."
    raise DataError(f"data.sp_vocab_size={vocab_size}: SentencePiece cannot train: {e}") from e
  # Written under a temporary name and renamed, so an interrupted run never leaves a truncated
  # model for the next one to load.
  directory = os.path.dirname(model_path)
  os.makedirs(directory, exist_ok=True)
  with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp", delete=False) as f:
    f.write(model.getvalue())
  os.replace(f.name, model_path)


def sentencepiece_path(workdir: str, vocab_size: int) -> str:
  return os.path.join(workdir, "tokenizer", f"sp_{vocab_size}.model")


def build_tokenizer(
  data_cfg: Any, workdir: str, source: Sequence[dict[str, Any]] | None = None
) -> ByteTokenizer | SentencePieceTokenizer:
  """The tokenizer named by `data.tokenizer`: with `data.tokenizer_path`, the SentencePiece model
  or Hugging Face JSON there; "sentencepiece" without a path, one trained for this workdir.

    SentencePiece is trained on `source` (default: `corpus.open_source(data_cfg, workdir)`) only
    when `<workdir>/tokenizer/sp_<data.sp_vocab_size>.model` is missing. The model is pinned to the
    workdir on purpose: a resumed run must keep the ids its checkpoint was trained with, even if
    `data.*` changed; use a fresh workdir to retrain.
  """
  if data_cfg.tokenizer == "byte":
    return ByteTokenizer()
  path = os.path.expanduser(data_cfg.tokenizer_path)
  if path and not os.path.isfile(path):
    raise DataError(f"data.tokenizer_path={data_cfg.tokenizer_path!r} is not a file")
  if data_cfg.tokenizer == "huggingface":
    if not path:
      raise DataError("data.tokenizer='huggingface' needs data.tokenizer_path (a JSON file)")
    return HuggingFaceTokenizer(
      path, data_cfg.eos_token, data_cfg.add_special_tokens, data_cfg.get("stop_tokens", ())
    )
  if data_cfg.tokenizer == "sentencepiece" and path:
    return SentencePieceTokenizer(path)
  if data_cfg.tokenizer == "sentencepiece":
    path = sentencepiece_path(workdir, data_cfg.sp_vocab_size)
    if not os.path.exists(path):
      if source is None:
        source = corpus.open_source(data_cfg, workdir)
      logging.getLogger(__name__).info(
        "Training SentencePiece (vocab %d) -> %s", data_cfg.sp_vocab_size, path
      )
      lines = _training_lines(source, data_cfg.text_key)
      train_sentencepiece(lines, data_cfg.sp_vocab_size, path)
    return SentencePieceTokenizer(path)
  raise DataError(f"data.tokenizer={data_cfg.tokenizer!r} is unknown; valid: {TOKENIZERS}.")


def _training_lines(source: Sequence[dict[str, Any]], text_key: str) -> Iterator[str]:
  """Non-empty lines of evenly spaced examples, up to `_SP_TRAIN_BYTES` of text.

  Lines, because SentencePiece learns pieces within a "sentence" and skips long ones; newlines
  themselves are then covered by byte pieces.
  """
  num_examples = min(len(source), _SP_TRAIN_MAX_EXAMPLES)
  num_bytes = 0
  for i in range(num_examples):
    text = source[i * len(source) // num_examples][text_key]
    num_bytes += len(text)
    if not isinstance(text, str):
      text = bytes(text).decode("utf-8", errors="replace")
    yield from (line for line in text.split("\n") if line)
    if num_bytes >= _SP_TRAIN_BYTES:
      return

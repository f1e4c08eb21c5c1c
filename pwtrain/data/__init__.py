"""Data: a text corpus (TFDS), a tokenizer, and a resumable Grain iterator of packed batches."""

from pwtrain.data.loader import (
  EvalSet,
  TrainBatches,
  build_eval_set,
  build_train_batches,
  merge_states,
  open_train_source,
  streams_of_rows,
)
from pwtrain.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, build_tokenizer

__all__ = [
  "ByteTokenizer",
  "EvalSet",
  "SentencePieceTokenizer",
  "TrainBatches",
  "build_eval_set",
  "build_tokenizer",
  "build_train_batches",
  "merge_states",
  "open_train_source",
  "streams_of_rows",
]

"""Data: a text corpus (TFDS), a tokenizer, and a resumable Grain iterator of packed batches."""

from pwtrain.data.loader import TrainBatches, build_train_batches
from pwtrain.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, build_tokenizer

__all__ = [
  "ByteTokenizer",
  "SentencePieceTokenizer",
  "TrainBatches",
  "build_tokenizer",
  "build_train_batches",
]

"""The inputs of the serving engine's programs (engine.py, pieces.py) from the sequences they
serve: a prefill chunk of every sequence still prefilling, in one program (`prefill`), and a
decode step of every decoding one (`decode`).
"""

import dataclasses

import numpy as np

from pwtrain.serve.sequences import Sequence, sampling_rows


@dataclasses.dataclass
class Batch:
  """One program's inputs: `rows` (row -> the sequence given the token it picks there),
  `scored` ((sequence, prompt tokens, row): an echo's prompt log-probs it gives) and, for a
  prefill, `shape`: its (row count, length), the key of pieces.Pieces.prefill."""

  inputs: dict
  rows: dict
  scored: tuple = ()
  shape: tuple = ()


def prefill(seqs: list, *, shapes, max_batch: int, chunk: int, max_len: int, pad_id: int) -> Batch:
  """The next chunk (at most `chunk` tokens) of each of `seqs` (at most max_batch, in distinct
  slots), row r the r-th's, in the smallest of `shapes` ((row count, length) each) that holds
  them: the fewest rows, then the shortest length; advances each sequence's `fed` past its
  chunk. A padding row feeds `pad_id` at the scratch position max_len - 1 (pieces.py) of a slot
  no sequence of `seqs` holds, its chunk not final, so it changes nothing a sequence reads. A
  sequence whose own settings fail here (`sampling_rows`) raises with the error's `sequences`
  that sequence alone, so that it fails alone."""
  longest = max(len(seq.context[seq.fed : seq.fed + chunk]) for seq in seqs)
  size, length = min((r, n) for r, n in shapes if r >= len(seqs) and n >= longest)
  held = [seq.slot for seq in seqs]
  slots = held + [s for s in range(max_batch) if s not in held][: size - len(seqs)]
  tokens = np.full((size, length), pad_id, np.int32)
  positions = np.full((size, length), max_len - 1, np.int32)
  targets = np.zeros((size, length), np.int32)  # each position's next prompt token
  logits_at = np.zeros(size, np.int32)
  final, score = np.zeros(size, bool), np.zeros(size, bool)
  rows, scored = {}, []
  sampling = sampling_rows({}, size)
  for r, seq in enumerate(seqs):
    try:
      own = sampling_rows({0: seq}, 1)
    except Exception as e:
      e.sequences = [seq]
      raise
    for key, values in sampling.items():
      values[r] = own[key][0]
    start, piece = seq.fed, seq.context[seq.fed : seq.fed + chunk]
    tokens[r, : len(piece)] = piece
    positions[r] = np.minimum(start + np.arange(length), max_len - 1)
    seq.fed = start + len(piece)
    final[r], logits_at[r] = seq.fed == len(seq.context), len(piece) - 1
    request = seq.completion.request
    score[r] = request.echo and request.logprobs is not None and not seq.echoed
    after = seq.prompt[start + 1 : start + 1 + len(piece)]
    targets[r, : len(after)] = after
    if final[r]:
      rows[r] = seq
    if score[r]:
      scored.append((seq, len(after), r))  # the prompt tokens it scores
  inputs = {
    "tokens": tokens,
    "positions": positions,
    "slot": np.asarray(slots, np.int32),
    "logits_at": logits_at,
    "final": final,
    "targets": targets,
    "score": score,
    "sampling": sampling,
  }
  return Batch(inputs, rows, tuple(scored), (size, length))


def decode(decoding: list[Sequence], *, max_batch: int, max_len: int) -> Batch:
  """One token of each of `decoding`, row `slot` its slot's; the other slots inactive at the
  scratch position max_len - 1 (pieces.py)."""
  positions = np.full((max_batch, 1), max_len - 1, np.int32)
  active = np.zeros(max_batch, bool)
  rows = {}
  for seq in decoding:
    positions[seq.slot, 0], active[seq.slot] = seq.fed, True
    rows[seq.slot] = seq
  inputs = {
    "positions": positions,
    "active": active,
    "sampling": sampling_rows(rows, max_batch),
  }
  return Batch(inputs, rows)

"""What a landed token tells its client (engine.py): the sequence's next `Event`, with the text
that may be sent now (text.py), its log-probs, its finish reason, and with an echo's first event
the prompt and its tokens' log-probs (`scored` gathers those from the prefill chunks).
"""

import time

from pwtrain.serve.metrics import Stats
from pwtrain.serve.sequences import Event, Sequence
from pwtrain.serve.text import token_text


def next_event(seq: Sequence, out: dict, row: int, step: int, tokenizer, stats: Stats) -> Event:
  """The sequence's event for its token in row `row` of a program's `out` (the weights of
  `step`); its finish reason set when it ends there (EOS, a stop string, max_tokens)."""
  request = seq.completion.request
  echo = _echo(seq, tokenizer)
  if request.max_tokens == 0:  # an echo's prompt alone
    return Event(seq.index, "", step, finish_reason="length", echo=echo)
  token = int(out["token"][row])
  now = time.perf_counter()
  if seq.given:
    stats.observe("time_per_output_token_seconds", now - seq.last)
  else:
    stats.observe("time_to_first_token_seconds", now - seq.submitted)
  seq.last = now
  seq.given.append(token)
  seq.completion.completion_tokens += 1
  stats.count("completion_tokens")
  if token in tokenizer.stop_ids and not request.ignore_eos:  # EOS, or any of data.stop_tokens
    finish, text = "stop", seq.text.finish()
  else:
    text, stopped = seq.text.add(token)
    finish = "stop" if stopped else None
  if finish is None and len(seq.given) >= request.max_tokens:
    finish, text = "length", text + seq.text.finish()
  logprobs = None
  if request.logprobs is not None:
    logprobs = _logprobs(request, token, out, row, tokenizer)
  sampled = float(out["sampled_logprob"][row])  # under the distribution drawn from (pieces.py)
  return Event(
    seq.index, text, step, logprobs, finish, token=token, sampled_logprob=sampled, echo=echo
  )


def scored(seq: Sequence, count: int, scores: dict, tokenizer) -> None:
  """Adds the log-probs of the sequence's next `count` prompt tokens (an echo's) from a prefill
  chunk's `scores` (pieces.py: row j is the chunk's position j)."""
  request = seq.completion.request
  for j in range(count):
    token = int(seq.prompt[len(seq.scores) + 1])
    seq.scores.append(_logprobs(request, token, scores, j, tokenizer))


def _logprobs(request, token: int, out: dict, row: int, tokenizer) -> tuple:
  """(the token's text, its log-prob, {top text: log-prob}) from row `row` of `out`."""
  top = {
    token_text(tokenizer, int(i)): float(lp)
    for i, lp in zip(out["top_ids"][row][: request.logprobs],
                     out["top_logprobs"][row][: request.logprobs], strict=True)
  }  # fmt: skip
  return token_text(tokenizer, token), float(out["logprob"][row]), top


def _echo(seq: Sequence, tokenizer):
  """What an echo sends with the sequence's first event: (its prompt's text, the prompt tokens'
  log-probs, the first None), once; None without echo."""
  request = seq.completion.request
  if not request.echo or seq.echoed:
    return None
  seq.echoed = True
  text = request.prompts[seq.index // request.n]
  if request.logprobs is None:
    return text, None
  first = (token_text(tokenizer, int(seq.prompt[0])), None, None)
  return text, [first, *seq.scores]

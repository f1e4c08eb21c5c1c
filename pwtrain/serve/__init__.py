"""Serving the model over HTTP with OpenAI's completions and chat completions API, from a run's
checkpoints (`python -m pwtrain.serve`) or attached to the training run itself
(`serve.enabled=True`), its programs a priority client of the run's controller on the same
islands.

  weights.py   where the served weights are: the run's live parameters, or a checkpoint
  pieces.py    the compiled programs: KV-cache slots, prefill, decode, per-slot sampling
  engine.py    continuous batching on a thread: slots, the queue, tokens to clients
  tokens.py    what a landed token tells its client: text, log-probs, finish, an echo
  requests.py  a request parsed and range-checked; OpenAI-style errors
  chat.py      chat messages through the tokenizer's chat template (jinja2)
  text.py      tokens to text as they come: incomplete characters, stop strings
  replies.py   the engine's events as OpenAI's responses, whole or streamed
  app.py       the HTTP app (FastAPI): thin, no device arrays
  metrics.py   /metrics through prometheus_client
  server.py    the socket, uvicorn, and the attached and standalone servers
  __main__.py  the command

The HTTP stack (FastAPI, uvicorn, prometheus_client, jinja2) is the `[serve]` extra; nothing here
imports it until a server starts.
"""

from pwtrain.serve.server import attached, listening, read_token, standalone

__all__ = ["attached", "listening", "read_token", "standalone"]

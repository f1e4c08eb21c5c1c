"""The HTTP side: OpenAI's completions API on FastAPI. It parses and checks a request, queues it on
the engine and streams or returns what the engine produces; it never touches device arrays.

  POST /v1/completions   prompt, max_tokens, temperature, top_p, top_k, n, stop, seed, stream
                         (server-sent events ending with `data: [DONE]`), logprobs (up to 5)
  GET  /v1/models        the one model served
  GET  /health           whether the engine serves, the step of its weights, slots and queue
  GET  /metrics          Prometheus' text format (metrics.py)

Every response names the weights that produced it: `system_fingerprint` is `pwtrain-step-<N>`,
N the step of its newest token's weights (streamed: of the chunk's token), and each choice's
`weights` lists the runs of steps its tokens came from, [{"step", "tokens"}], in order. Errors
are OpenAI's shape with status 400 (a bad request: requests.py), 401 (a missing or wrong bearer
token, compared in constant time), 413 (a body over MAX_BODY bytes), 429 (the queue is full;
`Retry-After` says when to try again) and 503 (the server is stopping). A client that leaves
before its end frees its slots at the next token boundary.
"""

import asyncio
import hmac
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from pwtrain.serve.requests import CompletionRequest, Limits, RequestError, parse
from pwtrain.serve.sequences import Completion, Event, QueueFull, Stopped

MAX_BODY = 4 << 20  # bytes
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5  # how often a waiting non-streamed request checks that its client is there
OPEN = ("/health",)  # paths that need no token


def make_app(
  engine, tokenizer, limits: Limits, *, model: str, token: str = "", island_time=None,
  device_bytes=None,
):  # fmt: skip
  """The app over `engine`; `token`: the bearer token every path but OPEN requires ("": none);
  `island_time()`: the controller's busy seconds per island and client, `device_bytes()`: the
  bytes of this process's device arrays, for /metrics."""
  app = FastAPI(title="pwtrain", docs_url=None, redoc_url=None, openapi_url=None)
  stats = engine.stats
  app.add_middleware(_Guard, token=token, stats=stats)

  @app.exception_handler(RequestError)
  async def refused(request: Request, error: RequestError):
    return _error(error)

  @app.get("/health")
  async def health():
    status = engine.status()
    return JSONResponse({"status": "ok" if status["serving"] else "starting", **status},
                        status_code=200 if status["serving"] else 503)  # fmt: skip

  @app.get("/v1/models")
  async def models():
    card = {"id": model, "object": "model", "created": int(time.time()), "owned_by": "pwtrain"}
    return {"object": "list", "data": [card]}

  @app.get("/metrics")
  async def metrics():
    status = engine.status()
    gauges = {
      "slots": status["slots"],
      "slots_busy": status["busy"],
      "queue_waiting": status["waiting"],
      "weights_step": -1 if status["step"] is None else status["step"],
      "kv_cache_bytes": status["cache_bytes"],
    }
    if device_bytes is not None:
      gauges["device_bytes"] = device_bytes()
    text = stats.render(gauges, island_time() if island_time else {})
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

  @app.post("/v1/completions")
  async def completions(request: Request):
    if int(request.headers.get("content-length") or 0) > MAX_BODY:
      raise RequestError(413, f"the request body is over {MAX_BODY} bytes")
    body = await request.body()
    if len(body) > MAX_BODY:
      raise RequestError(413, f"the request body is over {MAX_BODY} bytes")
    parsed = parse(body, tokenizer, limits)
    events: asyncio.Queue = asyncio.Queue()
    completion = Completion(parsed, _deliver(asyncio.get_running_loop(), events))
    try:
      engine.submit(completion)
    except QueueFull as e:
      raise RequestError(429, f"the server is busy: {e}; try again", kind="rate_limit_error") from e
    except Stopped as e:
      raise RequestError(503, str(e), kind="server_error") from e
    stats.count("prompt_tokens", completion.prompt_tokens)
    reply = _Reply(completion, model)
    if parsed.stream:
      return StreamingResponse(
        _stream(reply, events, engine), media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
      )  # fmt: skip
    try:
      while not reply.done:
        try:
          event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except TimeoutError:
          if await request.is_disconnected():
            return JSONResponse({}, status_code=499)  # nobody reads it
          continue
        if event.error:
          raise RequestError(503, event.error, kind="server_error")
        reply.add(event)
      return reply.whole()
    finally:
      completion.cancel()  # frees the slots of whatever has not ended (a client that left)
      engine.wake()

  return app


def _deliver(loop, events: asyncio.Queue):
  """The engine's events into `events`, on the HTTP side's loop (dropped once it has closed)."""

  def put(event: Event) -> None:
    try:
      loop.call_soon_threadsafe(events.put_nowait, event)
    except RuntimeError:  # the loop has closed: nobody is waiting
      pass

  return put


async def _stream(reply: "_Reply", events: asyncio.Queue, engine):
  try:
    while not reply.done:
      event = await events.get()
      if event.error:
        error = RequestError(503, event.error, kind="server_error")
        yield f"data: {json.dumps(error.body())}\n\n"
        break
      reply.add(event)
      yield f"data: {json.dumps(reply.chunk(event))}\n\n"
    else:
      if reply.completion.request.include_usage:
        yield f"data: {json.dumps(reply.usage_chunk())}\n\n"
    yield "data: [DONE]\n\n"
  finally:  # also when the client leaves (the response task is cancelled)
    reply.completion.cancel()
    engine.wake()


class _Reply:
  """A completion's OpenAI response, built from the engine's events."""

  def __init__(self, completion: Completion, model: str):
    self.completion = completion
    request: CompletionRequest = completion.request
    self.head = {
      "id": f"cmpl-{uuid.uuid4().hex}",
      "object": "text_completion",
      "created": int(completion.created),
      "model": model,
    }
    count = request.num_sequences
    self.texts = [""] * count
    self.finish: list = [None] * count
    self.steps: list[list] = [[] for _ in range(count)]  # runs: [step, tokens]
    self.logprobs = None
    if request.logprobs is not None:
      self.logprobs = [_empty_logprobs() for _ in range(count)]
    self.ended = 0

  @property
  def done(self) -> bool:
    return self.ended == len(self.texts)

  def add(self, event: Event) -> None:
    i = event.index
    self.texts[i] += event.text
    runs = self.steps[i]
    if runs and runs[-1][0] == event.step:
      runs[-1][1] += 1
    else:
      runs.append([event.step, 1])
    if self.logprobs is not None and event.logprobs is not None:
      _append_logprobs(self.logprobs[i], event.logprobs)
    if event.finish_reason is not None:
      self.finish[i] = event.finish_reason
      self.ended += 1

  def chunk(self, event: Event) -> dict:
    """The streamed chunk of `event` (after `add`)."""
    logprobs = None
    if self.logprobs is not None and event.logprobs is not None:
      logprobs = {k: v[-1:] for k, v in self.logprobs[event.index].items()}
    choice = {
      "text": event.text,
      "index": event.index,
      "logprobs": logprobs,
      "finish_reason": event.finish_reason,
    }
    return {**self.head, "system_fingerprint": _fingerprint(event.step), "choices": [choice]}

  def usage_chunk(self) -> dict:
    return {**self.head, "choices": [], "usage": self._usage()}

  def whole(self) -> dict:
    choices = [
      {
        "text": text,
        "index": i,
        "logprobs": self.logprobs[i] if self.logprobs is not None else None,
        "finish_reason": self.finish[i],
        "weights": [{"step": step, "tokens": n} for step, n in self.steps[i]],
      }
      for i, text in enumerate(self.texts)
    ]
    newest = max(runs[-1][0] for runs in self.steps)
    return {**self.head, "system_fingerprint": _fingerprint(newest), "choices": choices,
            "usage": self._usage()}  # fmt: skip

  def _usage(self) -> dict:
    prompt, completion = self.completion.prompt_tokens, self.completion.completion_tokens
    return {
      "prompt_tokens": prompt,
      "completion_tokens": completion,
      "total_tokens": prompt + completion,
    }


def _fingerprint(step: int) -> str:
  return f"pwtrain-step-{step}"


def _empty_logprobs() -> dict:
  return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _append_logprobs(out: dict, logprobs: tuple) -> dict:
  token, logprob, top = logprobs
  offset = out["text_offset"][-1] + len(out["tokens"][-1]) if out["tokens"] else 0
  out["tokens"].append(token)
  out["token_logprobs"].append(logprob)
  out["top_logprobs"].append(top)
  out["text_offset"].append(offset)
  return out


class _Guard:
  """ASGI middleware: the bearer token (every path but OPEN, when there is one) and the count of
  responses by status code. Pure ASGI, so that a streamed response and its client's leaving
  pass through untouched."""

  def __init__(self, app, *, token: str, stats):
    self.app = app
    self.expected = b"Bearer " + token.encode() if token else b""
    self.stats = stats

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)

    async def counted(message):
      if message["type"] == "http.response.start":
        self.stats.count("requests", code=message["status"])
      await send(message)

    if self.expected and scope["path"] not in OPEN:
      given = dict(scope["headers"]).get(b"authorization", b"")
      if not hmac.compare_digest(given, self.expected):
        error = RequestError(401, "a valid 'Authorization: Bearer <token>' header is required")
        return await _error(error)(scope, receive, counted)
    await self.app(scope, receive, counted)


def _error(error: RequestError) -> JSONResponse:
  headers = {}
  if error.status == 429:
    headers["Retry-After"] = str(RETRY_AFTER_S)
  if error.status == 401:
    headers["WWW-Authenticate"] = "Bearer"
  return JSONResponse(error.body(), status_code=error.status, headers=headers)

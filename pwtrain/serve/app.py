"""The HTTP side: OpenAI's API on FastAPI. It parses and checks a request, queues it on the engine
and streams or returns what the engine produces (replies.py); it never touches device arrays.

  POST /v1/completions        prompt (text, token ids, or a list of either), max_tokens,
                              temperature, top_p, top_k, n, stop, seed, stream (server-sent
                              events ending with `data: [DONE]`), logprobs (up to 5)
  POST /v1/chat/completions   messages rendered by the tokenizer's chat template (chat.py)
  GET  /v1/models[/{id}]      the one model served
  GET  /health                whether the engine serves, the step of its weights, slots and queue
  GET  /metrics               Prometheus' text format (metrics.py)

Errors are OpenAI's shape, every one, with status 400 (a bad request: requests.py), 401 (a
missing or wrong bearer token, compared in constant time), 404 and 405 (no such path or
method), 413 (a body over MAX_BODY bytes, refused as soon as that many are read), 429 (the
queue is full; `Retry-After` says when to try again), 500 (a bug: that request alone fails) and
503 (the server is stopping); /metrics counts them all. A client that leaves before its end
(streamed or not) frees its slots at the next token boundary.
"""

import asyncio
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pwtrain.serve import chat as chat_lib
from pwtrain.serve.metrics import CONTENT_TYPE
from pwtrain.serve.replies import ChatReply, Reply
from pwtrain.serve.requests import Limits, RequestError, parse
from pwtrain.serve.sequences import Completion, Event, QueueFull, Stopped

log = logging.getLogger(__name__)

MAX_BODY = 4 << 20  # bytes
RETRY_AFTER_S = 1
OPEN = ("/health",)  # paths that need no token
_LEFT = object()  # a non-streamed request's client has gone


def make_app(
  engine, tokenizer, limits: Limits, *, model: str, token: str = "", island_time=None,
  device_bytes=None, chat_template: "chat_lib.ChatTemplate | None" = None,
):  # fmt: skip
  """The app over `engine`; `token`: the bearer token every path but OPEN requires ("": none);
  `island_time()`: the controller's busy seconds per island and client, `device_bytes()`: the
  bytes of this process's device arrays, for /metrics; `chat_template`: the tokenizer's
  (None: /v1/chat/completions is refused)."""
  app = FastAPI(title="pwtrain", docs_url=None, redoc_url=None, openapi_url=None)
  stats = engine.stats
  app.add_middleware(_Guard, token=token, stats=stats)

  def gauges() -> dict:
    status = engine.status()
    out = {
      "slots": status["slots"],
      "slots_busy": status["busy"],
      "queue_waiting": status["waiting"],
      "weights_step": -1 if status["step"] is None else status["step"],
      "kv_cache_bytes": status["cache_bytes"],
    }
    if device_bytes is not None:
      out["device_bytes"] = device_bytes()
    return out

  stats.read_when_scraped(gauges, island_time)

  @app.exception_handler(RequestError)
  async def refused(request: Request, error: RequestError):
    return _error(error)

  @app.exception_handler(HTTPException)
  async def not_here(request: Request, error: HTTPException):  # 404, 405: OpenAI's body too
    what = {404: f"no such path: {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}"}  # fmt: skip
    message = what.get(error.status_code, str(error.detail))
    return _error(RequestError(error.status_code, message), error.headers)

  @app.get("/health")
  async def health():
    status = engine.status()
    return JSONResponse({"status": "ok" if status["serving"] else "starting", **status},
                        status_code=200 if status["serving"] else 503)  # fmt: skip

  def card() -> dict:
    return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "pwtrain"}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [card()]}

  @app.get("/v1/models/{name:path}")
  async def one_model(name: str):
    if name != model:
      raise RequestError(404, f"no model {name!r}: this server serves {model!r}", "model",
                         code="model_not_found")  # fmt: skip
    return card()

  @app.get("/metrics")
  async def metrics():
    return Response(stats.render(), media_type=CONTENT_TYPE)

  @app.post("/v1/completions")
  async def completions(request: Request):
    parsed = parse(await _body(request), tokenizer, limits)
    return await _serve(request, parsed, Reply)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    parsed = chat_lib.parse(await _body(request), chat_template, tokenizer, limits)
    return await _serve(request, parsed, ChatReply)

  async def _serve(request: Request, parsed, reply_class):
    events: asyncio.Queue = asyncio.Queue()
    completion = Completion(parsed, _deliver(asyncio.get_running_loop(), events))
    try:
      engine.submit(completion)
    except QueueFull as e:
      raise RequestError(429, f"the server is busy: {e}; try again", kind="rate_limit_error") from e
    except Stopped as e:
      raise RequestError(503, str(e), kind="server_error") from e
    stats.count("prompt_tokens", completion.prompt_tokens)
    reply = reply_class(completion, model)
    if parsed.stream:
      return StreamingResponse(
        _stream(reply, events, engine), media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
      )  # fmt: skip
    watcher = asyncio.create_task(_until_gone(request, events))
    try:
      while not reply.done:
        event = await events.get()
        if event is _LEFT:
          return JSONResponse({}, status_code=499)  # nobody reads it
        if event.error:
          raise RequestError(503, event.error, kind="server_error")
        reply.add(event)
      return reply.whole()
    finally:
      watcher.cancel()
      completion.cancel()  # frees the slots of whatever has not ended (a client that left)
      engine.wake()

  return app


async def _body(request: Request) -> bytes:
  """The request's body, refused (413) as soon as it is over MAX_BODY bytes: read a piece at a
  time, so that a large (or chunked, of no declared length) body is never held whole."""
  too_big = RequestError(413, f"the request body is over {MAX_BODY} bytes")
  try:
    if int(request.headers.get("content-length") or 0) > MAX_BODY:
      raise too_big
  except ValueError:
    raise RequestError(400, "the Content-Length header is not a number") from None
  pieces, size = [], 0
  async for piece in request.stream():
    size += len(piece)
    if size > MAX_BODY:
      raise too_big
    pieces.append(piece)
  return b"".join(pieces)


async def _until_gone(request: Request, events: asyncio.Queue) -> None:
  """Puts _LEFT in `events` once the client disconnects (its request body is read: the next
  message the server receives is the disconnect)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass
  events.put_nowait(_LEFT)


def _deliver(loop, events: asyncio.Queue):
  """The engine's events into `events`, on the HTTP side's loop (dropped once it has closed)."""

  def put(event: Event) -> None:
    try:
      loop.call_soon_threadsafe(events.put_nowait, event)
    except RuntimeError:  # the loop has closed: nobody is waiting
      pass

  return put


async def _stream(reply: Reply, events: asyncio.Queue, engine):
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


class _Guard:
  """ASGI middleware: the bearer token (every path but OPEN, when there is one; the scheme's
  case is free, as HTTP's), the count of responses by status code and path, and an unexpected
  error as OpenAI's body with status 500 (counted too). Pure ASGI, so that a streamed response
  and its client's leaving pass through untouched."""

  def __init__(self, app, *, token: str, stats):
    self.app = app
    self.token = token.encode()
    self.stats = stats

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    started = False

    async def counted(message):
      nonlocal started
      if message["type"] == "http.response.start":
        started = True
        self.stats.request(message["status"], scope["path"])
      await send(message)

    if self.token and scope["path"] not in OPEN and not self._authorized(scope):
      error = RequestError(401, "a valid 'Authorization: Bearer <token>' header is required")
      return await _error(error)(scope, receive, counted)
    try:
      await self.app(scope, receive, counted)
    except Exception as e:  # noqa: BLE001 - a bug: this request fails, the server goes on
      log.exception("%s %s failed", scope.get("method"), scope["path"])
      if started:
        raise
      error = RequestError(500, f"the server failed: {type(e).__name__}", kind="server_error")
      await _error(error)(scope, receive, counted)

  def _authorized(self, scope) -> bool:
    given = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, credentials = given.strip().partition(b" ")
    ok = hmac.compare_digest(credentials.strip(), self.token)
    return ok and scheme.lower() == b"bearer"


def _error(error: RequestError, headers: dict | None = None) -> JSONResponse:
  headers = dict(headers or {})
  if error.status == 429:
    headers["Retry-After"] = str(RETRY_AFTER_S)
  if error.status == 401:
    headers["WWW-Authenticate"] = "Bearer"
  return JSONResponse(error.body(), status_code=error.status, headers=headers)

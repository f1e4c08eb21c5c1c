"""Serving a run's checkpoint over HTTP (pwtrain/serve/): one live server on 127.0.0.1 for the
module, spoken to with OpenAI's own client and with raw HTTP (httpx) for bad input; its greedy
completions against `pwtrain.sample`'s; and the command, which reloads a newer checkpoint.
"""

import concurrent.futures
import itertools
import json
import logging
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from helpers import (
  REPO,
  Gated,
  StreamError,
  openai_client,
  small_config,
  standalone_server,
  streamed_chunks,
  weights_step,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from prometheus_client.parser import text_string_to_metric_families

from pwtrain import sample, serve, train
from pwtrain.backend import Node, Program
from pwtrain.data import ByteTokenizer
from pwtrain.models.sampling import Sampling, next_token, pick
from pwtrain.serve import engine as engine_lib
from pwtrain.serve.text import TextStream

TOKEN = "s3cret-token"
MAX_LEN, MAX_BATCH, QUEUE = 128, 4, 4
STEPS = 6  # the checkpoint served
RUN = {"train.num_steps": STEPS, "train.checkpoint_every": 3}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A run of STEPS steps without serving: its workdir (checkpoints at steps 3 and 6) and
  result."""
  workdir = tmp_path_factory.mktemp("trained")
  config = small_config(**RUN)
  result = train.run(config, str(workdir), show_progress=False)
  return config, workdir, result


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
  sizes = dict(max_len=MAX_LEN, max_batch=MAX_BATCH, queue_size=QUEUE, prefill_chunk=64)
  token_dir = tmp_path_factory.mktemp("token")
  with standalone_server(small_config(**RUN), trained[1], token_dir, TOKEN, **sizes) as running:
    yield running


def _client(server) -> openai.OpenAI:
  return openai_client(server, TOKEN)


def _post(server, body, token=TOKEN, **kw):
  headers = {"Authorization": f"Bearer {token}"} if token else {}
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  return httpx.post(
    f"{server.url}/v1/completions", content=content, headers=headers, timeout=60, **kw
  )


def test_the_openai_client_completes_and_streams(server, trained):
  client = _client(server)
  name = trained[1].name  # the model's name is its run's workdir's
  assert [m.id for m in client.models.list().data] == [name]
  out = client.completions.create(
    model=name, prompt=["def f(x):", "import os"], max_tokens=5, n=2, temperature=0.7,
    seed=1, logprobs=2,
  )  # fmt: skip
  assert len(out.choices) == 4 and [c.index for c in out.choices] == [0, 1, 2, 3]
  assert out.system_fingerprint == f"pwtrain-step-{STEPS}"
  assert out.usage.prompt_tokens == 10 + 10  # each prompt with its leading EOS, once
  for choice in out.choices:
    assert choice.finish_reason in ("stop", "length")
    steps = choice.model_extra["weights"]
    assert steps[0]["step"] == STEPS and sum(s["tokens"] for s in steps) <= 5
    assert len(choice.logprobs.tokens) == sum(s["tokens"] for s in steps)
    # Two ids may share a text (the legacy format's dict keeps one): at most 2 each.
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
  assert out.usage.completion_tokens == sum(
    sum(s["tokens"] for s in c.model_extra["weights"]) for c in out.choices
  )
  # The same seed gives the same samples.
  again = client.completions.create(
    model=name, prompt=["def f(x):", "import os"], max_tokens=5, n=2, temperature=0.7,
    seed=1, logprobs=2,
  )  # fmt: skip
  assert [c.text for c in again.choices] == [c.text for c in out.choices]

  chunks = list(
    client.completions.create(
      model=name, prompt="class A:", max_tokens=6, temperature=0, stream=True,
      stream_options={"include_usage": True},
    )
  )  # fmt: skip
  assert chunks[-1].usage.completion_tokens >= 1 and not chunks[-1].choices
  texts = [c.choices[0] for c in chunks[:-1]]
  assert texts[-1].finish_reason in ("stop", "length") and all(
    c.finish_reason is None for c in texts[:-1]
  )
  assert all(c.system_fingerprint == f"pwtrain-step-{STEPS}" for c in chunks[:-1])
  whole = client.completions.create(model=name, prompt="class A:", max_tokens=6, temperature=0)
  assert "".join(c.text for c in texts) == whole.choices[0].text


def test_greedy_completions_are_pwtrain_sample_s(server, trained):
  """Greedy completions of prompts of different lengths, decoded together in one batch at their
  own positions, are token for token pwtrain.sample's at --temperature=0 (the command's own
  function) on the same checkpoint."""
  config, workdir, _ = trained
  prompts = ["def main(", "import os\nimport sys\n", "class Tree:\n    def f(self, a"]
  client = _client(server)
  with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
    served = list(
      pool.map(
        lambda p: client.completions.create(model="m", prompt=p, max_tokens=10, temperature=0),
        prompts,
      )
    )
  expected = sample.sample(
    config, str(workdir), prompts, sampling=Sampling(temperature=0), max_new_tokens=10,
    num_samples=1, seed=0,
  )  # fmt: skip
  for prompt, out, want in zip(prompts, served, expected, strict=True):
    choice = out.choices[0]
    assert prompt + choice.text == want.text
    assert choice.finish_reason == ("stop" if want.stopped_at_eos else "length")
    assert out.usage.completion_tokens == want.new_tokens + want.stopped_at_eos


def test_sequences_that_arrive_together_are_prefilled_in_one_program(server, monkeypatch):
  """A request's prompts (taking their slots together) are prefilled a chunk of each per program,
  in the smallest program that holds the chunks (fewest rows, then shortest: prefill_lengths of
  a 64-token chunk are 16 and 64): the first chunks of 3 prompts of 10, 22 and 78 tokens (with
  the leading EOS) in 4 rows of 64, then the longest's last 14 in 2 rows of 16. Their echoed
  prompt log-probs and greedy completions are those of each prompt served alone, in programs of
  other shapes."""
  from pwtrain.serve import batches, pieces

  assert pieces.prefill_lengths(64) == (16, 64) and pieces.prefill_lengths(16) == (16,)
  assert pieces.prefill_lengths(512) == (32, 128, 512) and pieces.prefill_lengths(8) == (8,)
  shapes, prefill = [], batches.prefill
  monkeypatch.setattr(
    batches, "prefill", lambda *a, **kw: shapes.append((batch := prefill(*a, **kw)).shape) or batch
  )
  long = "class Tree:\n    def f(self, a):\n        return [b for b in a if b]\n    x = 1\n"
  prompts = ["def main(", "import os\nimport sys\n", long]
  client = _client(server)
  ask = dict(model="m", max_tokens=6, temperature=0, echo=True, logprobs=2)
  alone = [client.completions.create(prompt=p, **ask).choices[0] for p in prompts]
  assert shapes == [(2, 16), (2, 64), (2, 64), (2, 16)]
  shapes.clear()
  before = _metric(server, "pwtrain_serve_prefill_chunks_total")
  together = client.completions.create(prompt=prompts, **ask).choices
  assert _metric(server, "pwtrain_serve_prefill_chunks_total") - before == 2
  assert shapes == [(4, 64), (2, 16)]
  for one, other in zip(alone, together, strict=True):
    assert one.text == other.text and one.logprobs.tokens == other.logprobs.tokens
    got, want = other.logprobs.token_logprobs, one.logprobs.token_logprobs
    assert got[0] is None and want[0] is None
    np.testing.assert_allclose(got[1:], want[1:], atol=1e-4)


def test_bad_input_gets_400_and_the_server_goes_on(server):
  long_prompt = "x" * MAX_LEN
  cases = {
    b"{not json": None,
    b'{"prompt": "ab\xff\xfe"}': None,  # not UTF-8
    json.dumps([1, 2]).encode(): None,
    json.dumps({"prompt": long_prompt}).encode(): "prompt",
    json.dumps({"prompt": 5}).encode(): "prompt",
    json.dumps({"prompt": "hi", "max_tokens": 0}).encode(): "max_tokens",
    json.dumps({"prompt": "hi", "max_tokens": MAX_LEN}).encode(): "max_tokens",
    json.dumps({"prompt": "hi", "temperature": -0.5}).encode(): "temperature",
    json.dumps({"prompt": "hi", "n": MAX_BATCH + 1}).encode(): "n",
    json.dumps({"prompt": ["a", "b"], "n": MAX_BATCH}).encode(): "n",
    json.dumps({"prompt": "hi", "top_p": 0}).encode(): "top_p",
    json.dumps({"prompt": "hi", "logprobs": 9}).encode(): "logprobs",
    json.dumps({"prompt": "hi", "stop": ["a", ""]}).encode(): "stop",
    json.dumps({"prompt": "hi", "echo": 1}).encode(): "echo",
    json.dumps({"prompt": "hi", "suffix": "x"}).encode(): "suffix",
    json.dumps({"prompt": [1, "a"]}).encode(): "prompt",
  }
  for body, param in cases.items():
    response = _post(server, body)
    assert response.status_code == 400, (body, response.text)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
    assert error["message"]
  ok = _post(server, {"prompt": "hi", "max_tokens": 2})
  assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_wrong_or_missing_token_gets_401(server):
  for token in ("", "wrong", TOKEN + "x"):
    response = _post(server, {"prompt": "hi"}, token=token)
    assert response.status_code == 401, token
    assert response.json()["error"]["type"] == "authentication_error"
  assert httpx.get(f"{server.url}/v1/models").status_code == 401
  assert httpx.get(f"{server.url}/health").status_code == 200  # open: for load balancers
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_full_queue_gets_429_and_a_client_that_leaves_frees_its_slots(server):
  """Every slot and the whole queue taken by two streamed requests: a third gets 429 with
  Retry-After. Both streams are then dropped after their first chunk: their slots come free
  at the next token, and the next request is served. (Greedy: the trained model's continuation
  of the prompt has no EOS, so no sequence ends early.)"""
  long = {"prompt": "a", "max_tokens": MAX_LEN - 2, "n": MAX_BATCH, "stream": True,
          "temperature": 0}  # fmt: skip
  headers = {"Authorization": f"Bearer {TOKEN}"}
  with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
    streams = []
    for _ in range(2):  # the first fills the slots, the second the queue
      stream = http.stream("POST", "/v1/completions", json=long)
      response = stream.__enter__()
      assert response.status_code == 200
      streams.append((stream, response))
      _wait(lambda: _health(server)["busy"] == MAX_BATCH)
    assert _health(server)["waiting"] == QUEUE
    full = http.post("/v1/completions", json={"prompt": "b", "max_tokens": 1})
    assert full.status_code == 429 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["type"] == "rate_limit_error"
    first = next(streams[0][1].iter_lines())
    assert first.startswith("data: {")
    for stream, _ in streams:
      stream.__exit__(None, None, None)  # the client leaves mid-stream
    _wait(lambda: _health(server)["busy"] == 0 and _health(server)["waiting"] == 0)
    served = http.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
    assert served.status_code == 200
  metrics = httpx.get(f"{server.url}/metrics", headers=headers).text
  assert re.search(r'^pwtrain_serve_requests_total\{code="429",path="/v1/completions"\} [1-9]',
                   metrics, re.M)  # fmt: skip
  assert re.search(r"^pwtrain_serve_cancelled_total [1-9]", metrics, re.M)


def test_a_new_request_s_prefill_takes_the_last_place_in_flight(server):
  """The island held (an ordinary program there waits for its input), a streamed completion's
  programs stay in flight: its prefill and decodes, which leave the last place of RUN_AHEAD.
  A second request's prefill takes that place at once, not after a decode in flight has run
  (engine.py's loop: on a remote worker, only a few serving programs run between two steps)."""
  engine, controller = server.engine, server.engine.controller
  island = engine._pieces.layout.islands[0]
  sharding = NamedSharding(Mesh(np.array(controller.cluster[island].devices), ("d",)), P())
  arg = jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding)
  hold = controller.compile("hold", lambda x: x + 1, island, (arg,), out_shardings=sharding)
  gate = concurrent.futures.Future()
  held = controller.run(Program((Node("hold", hold, ("x",)),), {"y": ("hold", 0)}), {"x": gate})
  body = {"prompt": "a", "max_tokens": 16, "temperature": 0}
  headers = {"Authorization": f"Bearer {TOKEN}"}
  requests = lambda: {id(f.serves[0].completion) for f in list(engine._flights)}  # noqa: E731
  with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      try:
        first = pool.submit(list, streamed_chunks(http, body))
        _wait(lambda: len(engine._flights) >= engine_lib.RUN_AHEAD - 1)
        time.sleep(0.2)  # room for one more decode, were it allowed
        second = pool.submit(list, streamed_chunks(http, body))
        deadline = time.monotonic() + 10
        while len(requests()) < 2 and time.monotonic() < deadline:
          time.sleep(0.01)
        in_flight = [len(f.serves) for f in engine._flights], len(requests())
      finally:
        gate.set_result(jax.device_put(np.float32(0), sharding))
      assert len(first.result()) == len(second.result()) == 16
  jax.block_until_ready(held["y"].result())
  assert in_flight == ([1, 1, 1, 1], 2), "the prefill waited for a decode in flight to run"


def test_no_request_fails_because_of_another(server, monkeypatch):
  """Numbers out of any range the engine takes (int32 settings, a temperature, a 64-bit seed)
  are 400s naming the field, while a request in flight goes on untouched; and a failure in the
  engine's thread for one request's tokens (the int32 overflow an unchecked top_k made, forced
  here for top_k=123) fails that request alone: the one beside it completes."""
  from pwtrain.serve import batches

  client = _client(server)
  pool = concurrent.futures.ThreadPoolExecutor(2)
  beside = pool.submit(
    client.completions.create, model="m", prompt="def ", max_tokens=40, temperature=0
  )
  bad = {
    "top_k": 2**31, "max_tokens": 10**30, "n": 2**64, "logprobs": 2**40, "temperature": 1e308,
    "seed": 2**70, "top_p": 1e-400,
  }  # fmt: skip
  for field, value in bad.items():
    response = _post(server, {"prompt": "hi", "max_tokens": 2, field: value})
    assert response.status_code == 400, (field, response.text)
    assert response.json()["error"]["param"] == field
  assert beside.result().choices[0].finish_reason == "length"

  rows = batches.sampling_rows

  def overflowing(seqs, num_rows):
    if any(seq.completion.request.top_k == 123 for seq in seqs.values()):
      np.int32(2**31)  # OverflowError, as an unchecked top_k of 2**31 made
    return rows(seqs, num_rows)

  monkeypatch.setattr(batches, "sampling_rows", overflowing)
  beside = pool.submit(
    client.completions.create, model="m", prompt="def ", max_tokens=40, temperature=0
  )
  _wait(lambda: _health(server)["busy"] >= 1)
  failing = _post(server, {"prompt": "hi", "max_tokens": 30, "top_k": 123})
  assert failing.status_code == 503 and "OverflowError" in failing.json()["error"]["message"]
  assert beside.result().choices[0].finish_reason == "length"
  pool.shutdown()


def test_every_error_is_openai_s_body_and_counted(server):
  """404, 405, an integer past Python's 4300 digits, a lone surrogate in the prompt or the stop
  strings and JSON nested past the parser's recursion: each OpenAI's error body with its status,
  and /metrics counts each by status and path, exactly."""
  headers = {"Authorization": f"Bearer {TOKEN}"}

  def counts() -> dict:
    out = {}
    for family in text_string_to_metric_families(
      httpx.get(f"{server.url}/metrics", headers=headers).text
    ):
      if family.name == "pwtrain_serve_requests":
        for sample_ in family.samples:
          if sample_.name.endswith("_total"):
            out[sample_.labels["code"], sample_.labels["path"]] = sample_.value
    return out

  before = counts()
  sent = [
    (httpx.get(f"{server.url}/v1/nothing", headers=headers), 404, "other"),
    (httpx.get(f"{server.url}/v1/completions", headers=headers), 405, "/v1/completions"),
    (_post(server, b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}"), 400, None),
    (_post(server, b'{"prompt": "a\\ud800b"}'), 400, None),
    (_post(server, b'{"prompt": "a", "stop": ["\\udfff"]}'), 400, None),
    (_post(server, b"[" * 100_000 + b"]" * 100_000), 400, None),
  ]
  chat = httpx.post(f"{server.url}/v1/chat/completions", headers=headers,
                    json={"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
  assert "no chat template" in chat.json()["error"]["message"]  # a byte model has none
  sent.append((chat, 400, None))
  for response, status, _ in sent:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
  after = counts()
  added = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
  assert added == {("404", "other"): 1, ("405", "/v1/completions"): 1,
                   ("400", "/v1/completions"): 4, ("400", "/v1/chat/completions"): 1,
                   ("200", "/metrics"): 1}  # fmt: skip


def test_metrics_are_prometheus_client_s(server):
  """/metrics parses as Prometheus' format, has the standard process metrics, and its token
  counter moves by exactly the tokens a response reports."""
  headers = {"Authorization": f"Bearer {TOKEN}"}

  def scrape() -> dict:
    text = httpx.get(f"{server.url}/metrics", headers=headers).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

  before = scrape()
  out = _client(server).completions.create(model="m", prompt="ab", max_tokens=7, temperature=0)
  after = scrape()
  for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "slots"):
    assert name in after or f"pwtrain_serve_{name}" in after, name
  tokens = "pwtrain_serve_completion_tokens_total"
  assert after[tokens] - before[tokens] == out.usage.completion_tokens
  assert after["pwtrain_serve_weights_step"] == STEPS


def test_a_body_over_the_limit_is_refused_as_it_is_read(server):
  """A chunked body (no declared length) of up to 200 MiB: the 413 comes once the limit is
  read, not after the whole body."""
  from pwtrain.serve.app import MAX_BODY

  host, port = server.sock.getsockname()[:2]
  piece = b"x" * (1 << 20)
  chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
  sent = 0
  with socket.create_connection((host, port), timeout=60) as conn:
    conn.sendall(
      b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
      b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
    )
    answer, pending = b"", b""
    while sent < 200 << 20 and not answer:
      readable, writable, _ = select.select([conn], [conn], [], 60)
      if readable:
        answer = conn.recv(4096)
      elif writable:
        if not pending:
          pending, sent = chunk, sent + len(piece)
        pending = pending[conn.send(pending) :]  # a chunk whole, however the socket takes it
  assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
  assert sent < MAX_BODY + (32 << 20), sent


def test_a_client_that_leaves_a_waiting_completion_frees_its_slots(server):
  """A non-streamed completion of every slot whose client closes its connection once the slots
  are busy: its sequences are cancelled at their next token, not run to max_tokens."""
  cancelled = lambda: _metric(server, "pwtrain_serve_cancelled_total")
  before = cancelled()
  body = json.dumps({"prompt": "a", "max_tokens": MAX_LEN - 2, "n": MAX_BATCH, "temperature": 0})
  with socket.create_connection(server.sock.getsockname()[:2], timeout=60) as conn:
    conn.sendall(
      f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    _wait(lambda: _health(server)["busy"] == MAX_BATCH)
  _wait(lambda: _health(server)["busy"] == 0)
  assert cancelled() - before == MAX_BATCH


def test_weights_deleted_under_a_completion_are_the_weights_moving(server, trained):
  """The published weights' arrays deleted while a completion streams (as a pod's rejoin
  replaces the state serving reads), then new weights published: the completion goes on to
  its end on the new weights, no error."""
  import jax

  from pwtrain import inference

  config, workdir, _ = trained
  source = server.source

  def publish() -> dict:
    step, _, params = inference.restore_params(config, str(workdir), source.mesh)
    replicated = jax.sharding.NamedSharding(source.mesh, jax.sharding.PartitionSpec())
    value = {"params": params, "step": jax.device_put(np.int32(step), replicated)}
    source.controller.publish(source.layout().cells[0].island, source.NAME, value).result()
    return value

  first = publish()
  chunks = _client(server).completions.create(
    model="m", prompt="a", max_tokens=MAX_LEN - 2, temperature=0, stream=True
  )
  texts = [next(chunks).choices[0]]
  jax.tree.map(lambda a: a.delete(), first)  # serving's next programs read deleted arrays
  time.sleep(0.5)
  publish()
  texts += [c.choices[0] for c in chunks]  # an error chunk would fail to parse as a choice
  assert texts[-1].finish_reason == "length", texts[-1]


def test_a_deleted_buffer_caught_by_python_or_by_the_runtime_is_the_weights_moving():
  """An array deleted before the launch is caught in Python; one deleted between that check and
  the launch is the runtime's INVALID_ARGUMENT (as seen under load): both are the weights
  moving, and other errors are not."""
  from pwtrain.serve.engine import _moved

  assert _moved(RuntimeError("Array has been deleted with shape=int32[]."))
  runtime = "INVALID_ARGUMENT: Invalid buffer passed to Execute() as argument 0 to replica 0: "
  assert _moved(ValueError(runtime + "INVALID_ARGUMENT: Buffer has been deleted or donated."))
  assert not _moved(ValueError("top_k must be at most 10"))
  assert not _moved(RuntimeError("INTERNAL: something else"))


def _metric(server, name: str) -> float:
  text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
  return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def _health(server) -> dict:
  return httpx.get(f"{server.url}/health").json()


def _wait(condition, timeout_s=60):
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.02)


# -- attached to a training run --------------------------------------------------------------


def test_serving_while_training_changes_nothing(trained, tmp_path, monkeypatch):
  """The same run serving its live parameters to a client that sends requests all along (greedy
  and sampled, streamed and not) trains bitwise as it does without: the same losses, the same
  final parameters, checkpoints at the same steps. Each response names the step of its newest
  token's weights; those never decrease, and a completion that outlived steps lists its runs of
  steps in order. (Step 3's batch waits for a response and step 6's for a later step's, so that
  a slow machine's run cannot end before there is anything to compare.)"""
  config, workdir, plain = trained
  port = _free_port()
  served_config = small_config(
    **{**RUN, "serve.enabled": True, "serve.port": port, "serve.max_len": 32,
       "serve.prefill_chunk": 16, "data.data_dir": str(workdir / "tfds")}
  )  # fmt: skip
  responses = []
  _gate_on_responses(monkeypatch, responses)
  served = _train_with_a_client(served_config, tmp_path, responses)
  assert [r["loss"] for r in served.history] == [r["loss"] for r in plain.history]
  assert [r["grad_norm"] for r in served.history] == [r["grad_norm"] for r in plain.history]
  same = jax.tree.map(np.array_equal, jax.device_get(served.state), jax.device_get(plain.state))
  assert all(jax.tree.leaves(same))
  assert _checkpoints(tmp_path) == _checkpoints(workdir) == [3, 6]
  ok = [r for r in responses if not isinstance(r, Exception)]
  assert responses[: len(ok)] == ok and len(responses) - len(ok) <= 1, responses[-2:]  # the end
  assert len(ok) >= 3, responses
  steps = [weights_step(r) for r in ok]
  assert steps == sorted(steps) and steps[-1] > steps[0], steps
  for r in ok:
    for choice in r["choices"]:
      runs = [run["step"] for run in choice["weights"]]
      assert runs == sorted(set(runs)) and runs[-1] <= steps[-1], choice["weights"]


@pytest.mark.slow
def test_serving_from_a_pipeline_of_pods_through_a_lost_pod(trained, tmp_path, caplog, monkeypatch):
  """2 pods of 2 pipeline stages, fault.elastic: the server serves from pod 1's stage islands
  (a decode through both, its activations moved between them); pod 1 is lost before step 3 and
  its work hosted by pod 0, and the server goes on from pod 0's islands; pod 1 rejoins before
  step 6, and the server serves from it again. Every response but the one the server's end cut
  is served, and their steps never decrease. (Step 5's batch waits until the server moved to
  pod 0 and step 16's until it moved back, so that a slow machine's run cannot end first.)"""
  _, workdir, _ = trained
  port = _free_port()
  config = small_config(
    **{
      **RUN, "train.num_steps": 16, "train.num_microbatches": 2, "parallel.islands": 4,
      "parallel.stages": 2, "parallel.pods": 2, "fault.elastic": True,
      "fault.inject": "kill:pod1@step3,rejoin:pod1@step6", "serve.enabled": True,
      "serve.port": port, "serve.max_len": 32, "serve.prefill_chunk": 16,
      "data.data_dir": str(workdir / "tfds"),
    }
  )  # fmt: skip
  responses = []

  def moves(n):  # the server has served from n layouts, and answered since the last move
    served = [m for m in caplog.messages if m.startswith("serving from islands")]
    ok = [r for r in responses if not isinstance(r, Exception)]
    return len(served) >= n and len(ok) >= n + 1

  _gate_batches(monkeypatch, {4: lambda: moves(2), 15: lambda: moves(3)})
  with caplog.at_level(logging.INFO, logger="pwtrain.serve"):
    result = _train_with_a_client(config, tmp_path, responses)
  assert result.final_step == 16
  ok = [r for r in responses if not isinstance(r, Exception)]
  assert responses[: len(ok)] == ok and len(responses) - len(ok) <= 1, responses[-2:]
  assert len(ok) >= 3, responses
  steps = [weights_step(r) for r in ok]
  assert steps == sorted(steps), steps
  served_from = [m.split()[-1] for m in caplog.messages if m.startswith("serving from islands")]
  assert served_from == ["island2,island3", "island0,island1", "island2,island3"], served_from


@pytest.mark.slow
@pytest.mark.processes
def test_serving_attached_to_a_remote_run_changes_nothing(trained, tmp_path, monkeypatch):
  """Remote mode, the run's islands on worker processes it launches: the serving programs are a
  second client of the same controller, sent to the workers behind the training steps already
  sent, and read the state each step publishes where it is on the worker (its params and step
  picked from it, not copied). The run trains bitwise as the embedded run without serving
  (remote runs are the embedded ones': test_remote.py); the responses' steps never decrease
  and move on while it trains. (Step 3's batch waits for a response and step 6's for a later
  step's, as in the embedded test.)"""
  config, workdir, plain = trained
  port = _free_port()
  served_config = small_config(
    **{**RUN, "backend.mode": "remote", "backend.launch_workers": True, "serve.enabled": True,
       "serve.port": port, "serve.max_len": 32, "serve.prefill_chunk": 16,
       "data.data_dir": str(workdir / "tfds")}
  )  # fmt: skip
  responses = []
  _gate_on_responses(monkeypatch, responses)
  served = _train_with_a_client(served_config, tmp_path, responses)
  assert [r["loss"] for r in served.history] == [r["loss"] for r in plain.history]
  same = jax.tree.map(np.array_equal, jax.device_get(served.state), jax.device_get(plain.state))
  assert all(jax.tree.leaves(same))
  ok = [r for r in responses if not isinstance(r, Exception)]
  assert responses[: len(ok)] == ok and len(responses) - len(ok) <= 1, responses[-2:]
  steps = [weights_step(r) for r in ok]
  assert len(steps) >= 3 and steps == sorted(steps) and steps[-1] > steps[0], steps
  logs = sorted((tmp_path / "workers").glob("island*.log"))
  assert logs
  for log in logs:  # no step or serving program copied an input into another sharding
    assert "copied" not in log.read_text(), log


def _gate_batches(monkeypatch, gates: dict) -> None:
  real = train._train_batches
  monkeypatch.setattr(train, "_train_batches", lambda *args: Gated(real(*args), gates))


def _gate_on_responses(monkeypatch, responses: list) -> None:
  """Step 3's batch waits for a response, and step 6's for 3 of them, the last of a later
  step's weights than the first."""

  def steps():
    return [weights_step(r) for r in responses if not isinstance(r, Exception)]

  gates = {2: lambda: len(steps()) >= 1, 5: lambda: len(s := steps()) >= 3 and s[-1] > s[0]}
  _gate_batches(monkeypatch, gates)


def _train_with_a_client(config, workdir, responses: list):
  """train.run of `config` (serve.enabled) in `workdir` while a client sends requests to its
  server all along (`_send_all_along`, into `responses`); the run's result."""
  done = threading.Event()
  client = threading.Thread(target=_send_all_along, args=(config.serve.port, done, responses))
  client.start()
  try:
    return train.run(config, str(workdir), show_progress=False)
  finally:
    done.set()
    client.join()


def _send_all_along(port: int, done: threading.Event, responses: list) -> None:
  """Requests, one after another, until `done`: greedy, sampled and streamed in turn."""
  url = f"http://127.0.0.1:{port}"
  while not done.is_set():  # until the run's server is up
    try:
      if httpx.get(f"{url}/health").status_code == 200:
        break
    except httpx.HTTPError:
      time.sleep(0.02)
  kinds = itertools.cycle(
    [{"temperature": 0}, {"temperature": 0.8, "seed": 3, "n": 2}, {"stream": True}]
  )
  with httpx.Client(base_url=url, timeout=60) as http:
    while not done.is_set():
      body = {"prompt": "def ", "max_tokens": 8, **next(kinds)}
      try:
        if body.get("stream"):
          got = _streamed(http, body)
        else:
          response = http.post("/v1/completions", json=body)
          response.raise_for_status()
          got = response.json()
        responses.append(got)
      except (httpx.HTTPError, StreamError) as e:
        responses.append(e)
        return


def _streamed(http, body) -> dict:
  """A streamed completion as one response: its last chunk's fingerprint, its runs of steps."""
  runs, fingerprint = [], None
  for chunk in streamed_chunks(http, body):
    fingerprint, step = chunk["system_fingerprint"], weights_step(chunk)
    if not runs or runs[-1]["step"] != step:
      runs.append({"step": step, "tokens": 0})
    runs[-1]["tokens"] += 1
  return {"system_fingerprint": fingerprint, "choices": [{"weights": runs}]}


def _checkpoints(workdir) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"serve.max_batch": 0}, "serve.max_batch=0 must be a positive integer"),
    ({"serve.max_len": 1}, "serve.max_len=1 must be >= 2"),
    ({"serve.port": 70000}, "serve.port=70000 must be a port number"),
    ({"serve.share": 0.0}, "serve.share=0.0 must be in (0, 1]"),
    ({"serve.host": ""}, "serve.host='' must be an address"),
    ({"serve.token_file": "/no/such/token"}, "serve.token_file='/no/such/token' is not a file"),
    ({"serve.enabled": True, "backend.mode": "distributed"}, "(embedded or remote mode)"),
  ],
)
def test_bad_serve_settings_are_one_line(overrides, message):
  from pwtrain import config as config_lib
  from pwtrain.errors import ConfigError

  with pytest.raises(ConfigError) as error:
    config_lib.validate(small_config(**overrides))
  assert message in str(error.value) and "\n" not in str(error.value)


def test_a_port_in_use_is_one_line():
  from pwtrain.errors import ConfigError

  config = small_config(**{"serve.port": 0})
  with serve.listening(config) as taken:
    port = taken.getsockname()[1]
    with pytest.raises(ConfigError, match=f"serve.port={port}: cannot listen there"):
      with serve.listening(config, port=port):
        pass


# -- pieces without a server ----------------------------------------------------------------


def test_a_stream_of_text_holds_back_what_a_later_token_may_change():
  """Bytes of a character not yet complete, and a tail that may begin a stop string, wait; a
  stop string ends the text before it."""
  tokenizer = ByteTokenizer()
  ids = lambda text: [int(i) for i in tokenizer.encode(text)]
  stream = TextStream(tokenizer, stop=("END",))
  sent = []
  for token in ids("a€bEN"):
    sent.append(stream.add(token))
  assert "".join(t for t, _ in sent) == "a€b" and not any(stopped for _, stopped in sent)
  assert sent[1] == ("", False)  # the euro sign's first byte alone is held back
  text, stopped = stream.add(ids("D")[0])
  assert stopped and text == ""
  other = TextStream(tokenizer, stop=("END",))
  for token in ids("xE"):
    other.add(token)
  assert other.add(ids("x")[0]) == ("Ex", False)
  assert other.finish() == ""


def test_pick_applies_each_row_s_own_settings():
  """sampling.pick with per-row settings and keys picks, for every row, what next_token picks
  for that row alone with its settings and key."""
  logits = jax.random.normal(jax.random.key(0), (3, 50)) * 3
  settings = [Sampling(0), Sampling(0.8, top_k=5), Sampling(1.2, top_k=3, top_p=0.7)]
  keys = jax.random.split(jax.random.key(1), 3)
  picked = jax.jit(pick, static_argnums=5)(
    logits, keys, np.asarray([s.temperature for s in settings], np.float32),
    np.asarray([s.top_k for s in settings], np.int32),
    np.asarray([s.top_p for s in settings], np.float32), 40,
  )  # fmt: skip
  alone = jax.jit(next_token, static_argnums=(2, 3))
  for row, s in enumerate(settings):
    assert int(picked[row]) == int(alone(logits[row][None], keys[row], s, 40)[0]), row


def test_outputs_deleted_with_a_lost_island_after_they_ran_read_as_its_loss():
  """A serving program that ran on an island lost before its outputs were read: the read is
  that island's IslandLost, which the engine recovers from (a pod lost while serving from it),
  not an error that fails every request; outputs of islands still live read as ever."""
  from pwtrain.backend import Cluster, Controller, Node, Program
  from pwtrain.backend.faults import IslandLost
  from pwtrain.serve.flights import fetch

  with Controller(Cluster.local([4, 4])) as controller:
    nodes = []
    for island in ("island0", "island1"):
      sharding = jax.sharding.SingleDeviceSharding(controller.cluster[island].devices[0])
      arg = jax.ShapeDtypeStruct((2,), np.int32, sharding=sharding)
      exe = controller.compile(f"plus_{island}", lambda x: x + 1, island, (arg,))
      nodes.append(Node(island, exe, ("x",)))
    program = Program(tuple(nodes), {"a": ("island0", 0), "b": ("island1", 0)})
    outputs = controller.run(program, {"x": np.arange(2, dtype=np.int32)})
    jax.block_until_ready([f.result() for f in outputs.values()])
    controller.lose("island1", "a drill")
    with pytest.raises(IslandLost, match="island island1 lost: a drill"):
      fetch(outputs, controller)
    np.testing.assert_array_equal(fetch({"a": outputs["a"]}, controller)["a"], [1, 2])


# -- the command -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.processes
def test_the_command_serves_and_reloads_a_newer_checkpoint(trained, tmp_path):
  """`python -m pwtrain.serve` serves the run's checkpoint (config.json, --port=0); when the run
  goes on and writes a newer checkpoint, responses come from it (serve.reload); Ctrl-C ends it
  with status 0 and no traceback. A bad serve.* setting is one line."""
  config, workdir, _ = trained
  run = tmp_path / "run"
  subprocess.run(["cp", "-r", str(workdir), str(run)], check=True)
  (run / "config.json").write_text(json.dumps(config.to_dict()))
  command = [sys.executable, "-m", "pwtrain.serve", f"--workdir={run}"]
  bad = subprocess.run([*command, "--config.serve.share=0"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
  assert bad.returncode != 0
  assert bad.stderr.strip().splitlines()[-1].startswith("pwtrain.serve: serve.share=0.0 must be")
  process = subprocess.Popen(
    [*command, "--port=0", "--config.serve.reload_poll_s=0.2"], cwd=REPO, text=True,
    stderr=subprocess.PIPE,
  )  # fmt: skip
  lines: list[str] = []
  try:
    url = _served_url(process, lines)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
    first = client.completions.create(model="m", prompt="def ", max_tokens=3, temperature=0)
    assert first.system_fingerprint == f"pwtrain-step-{STEPS}"
    more = small_config(**{"train.num_steps": STEPS + 2, "train.checkpoint_every": STEPS + 2})
    train.run(more, str(run), show_progress=False)
    _wait(lambda: client.completions.create(model="m", prompt="def ", max_tokens=1)
          .system_fingerprint == f"pwtrain-step-{STEPS + 2}")  # fmt: skip
    process.send_signal(signal.SIGINT)  # Ctrl-C: a clean exit
    assert process.wait(timeout=60) == 0
    assert "Traceback" not in "".join(lines), "".join(lines)[-3000:]
  finally:
    process.kill()
    process.wait(timeout=60)


def _served_url(process, lines: list) -> str:

  def read():
    for line in process.stderr:
      lines.append(line)

  threading.Thread(target=read, daemon=True).start()
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    for line in lines:
      if found := re.search(r"serving the model at (http://\S+)/v1", line):
        return found.group(1)
    assert process.poll() is None, "".join(lines)[-3000:]
    time.sleep(0.05)
  raise AssertionError("".join(lines)[-3000:])

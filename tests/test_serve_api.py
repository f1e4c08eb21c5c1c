"""The API clients expect, on a live server of an imported Llama (tests/hf_models.py) whose
tokenizer adds a BOS and has a chat template: greedy completions equal `pwtrain.sample`'s (one
prompt-encoding rule), chat completions streamed and not (the template rendered as transformers
renders it), token-id prompts, GET /v1/models/{id}, each choice's token ids, the usage chunk's
fingerprint, and the Authorization scheme in any case. OpenAI's own client throughout.
"""

import json

import httpx
import openai
import pytest
from helpers import openai_client, standalone_server
from hf_models import make_hf, transformers

from pwtrain import inference, sample
from pwtrain.convert import importer
from pwtrain.models.sampling import Sampling

TOKEN = "api-token"
PROMPT = "def main(): return"
TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """An imported tiny Llama's run (its tokenizer with a chat template, written where
  transformers 5 writes it)."""
  root = tmp_path_factory.mktemp("llama")
  make_hf("llama", root / "hf")
  (root / "hf" / "chat_template.jinja").write_text(TEMPLATE)
  importer.from_hf(str(root / "hf"), str(root / "run"))
  return root / "run"


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
  config = inference.load_config(None, str(run))
  sizes = dict(max_len=64, max_batch=4, prefill_chunk=8)
  with standalone_server(config, run, tmp_path_factory.mktemp("token"), TOKEN, **sizes) as running:
    yield running


def _client(server) -> openai.OpenAI:
  return openai_client(server, TOKEN)


def test_greedy_completions_are_pwtrain_sample_s_with_the_family_s_bos(server, run):
  """The server encodes a prompt as pwtrain.sample does (BOS first, as transformers encodes it,
  no end-of-document token in front), so their greedy tokens are the same; each choice lists
  its token ids."""
  config = inference.load_config(None, str(run))
  (want,) = sample.sample(config, str(run), [PROMPT], sampling=Sampling(temperature=0),
                          max_new_tokens=12, num_samples=1, seed=0)  # fmt: skip
  out = _client(server).completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0)
  choice = out.choices[0]
  assert tuple(choice.model_extra["token_ids"]) == want.ids
  assert PROMPT + choice.text == want.text
  tok = transformers.AutoTokenizer.from_pretrained(run / "tokenizer")
  assert out.usage.prompt_tokens == len(tok(PROMPT).input_ids)  # its BOS included


def test_token_id_prompts_are_the_prompt_as_given(server, run):
  """A prompt as a list of token ids (or a list of such lists) is those ids: the same tokens
  as the text it encodes."""
  tok = transformers.AutoTokenizer.from_pretrained(run / "tokenizer")
  ids = tok(PROMPT).input_ids
  client = _client(server)
  text = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0)
  one = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0)
  two = client.completions.create(model="m", prompt=[ids, ids[:3]], max_tokens=6, temperature=0)
  assert one.choices[0].text == text.choices[0].text == two.choices[0].text
  assert len(two.choices) == 2 and one.usage.prompt_tokens == len(ids)
  bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": [10**6]},
                   headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_chat_completions_render_the_template_as_transformers_does(server, run):
  """/v1/chat/completions, whole and streamed: the messages rendered by the tokenizer's chat
  template give what transformers' apply_chat_template gives, and the reply is the greedy
  completion of that text's tokens."""
  tok = transformers.AutoTokenizer.from_pretrained(run / "tokenizer")
  rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
  ids = tok(rendered, add_special_tokens=False).input_ids
  client = _client(server)
  plain = client.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0)
  chat = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0)
  assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
  assert chat.choices[0].message.content == plain.choices[0].text
  assert chat.usage.prompt_tokens == len(ids)
  chunks = list(
    client.chat.completions.create(
      model="m", messages=MESSAGES, max_completion_tokens=8, temperature=0, stream=True,
      stream_options={"include_usage": True},
    )
  )  # fmt: skip
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == plain.choices[0].text
  usage = chunks[-1]
  assert usage.usage.completion_tokens == chat.usage.completion_tokens
  assert usage.system_fingerprint == chat.system_fingerprint  # the usage chunk's, too


def test_models_by_id_and_the_authorization_scheme_in_any_case(server, run):
  client = _client(server)
  assert client.models.retrieve(run.name).id == run.name
  with pytest.raises(openai.NotFoundError):
    client.models.retrieve("another")
  for scheme in ("bearer", "BEARER", "Bearer"):
    response = httpx.get(f"{server.url}/v1/models",
                         headers={"Authorization": f"{scheme} {TOKEN}"})  # fmt: skip
    assert response.status_code == 200, scheme
  wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Basic {TOKEN}"})
  assert wrong.status_code == 401 and json.loads(wrong.text)["error"]["type"]


def test_echo_gives_the_prompt_tokens_log_probs_as_openai_s_legacy_completions(server, run):
  """`echo` with `logprobs` (how lm-eval-harness's local-completions scores likelihood): the
  text starts with the prompt, and the log-probs with the prompt tokens' (the first null),
  each the model's own (transformers' on the same weights), over several prefill chunks;
  max_tokens=0 gives the prompt's alone."""
  import torch

  tok = transformers.AutoTokenizer.from_pretrained(run / "tokenizer")
  ids = tok(" ".join([PROMPT] * 4)).input_ids  # several prefill chunks of 8
  model = transformers.AutoModelForCausalLM.from_pretrained(run.parent / "hf")
  with torch.no_grad():
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
  theirs = [float(logprobs[t, ids[t + 1]]) for t in range(len(ids) - 1)]
  client = _client(server)
  alone = client.completions.create(model="m", prompt=ids, max_tokens=0, echo=True, logprobs=1)
  lp = alone.choices[0].logprobs
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  assert len(lp.tokens) == len(ids) and alone.usage.completion_tokens == 0
  assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], theirs, strict=True)) < 1e-4
  assert alone.choices[0].text == tok.decode(ids, skip_special_tokens=True)
  assert alone.choices[0].finish_reason == "length"
  one = client.completions.create(model="m", prompt=PROMPT, max_tokens=1, echo=True, logprobs=2,
                                  temperature=0)  # fmt: skip
  choice = one.choices[0]
  n = len(tok(PROMPT).input_ids)
  assert len(choice.logprobs.tokens) == n + 1 and choice.text.startswith(PROMPT)
  assert choice.logprobs.token_logprobs[1:n] == lp.token_logprobs[1:n]
  assert choice.logprobs.text_offset[-1] == len(choice.text) - len(choice.logprobs.tokens[-1])

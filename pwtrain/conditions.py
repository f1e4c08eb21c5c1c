"""When a config key takes effect: no setting is silently ignored.

Many keys are read only under another setting (`data.files` only when `data.dataset` is
"files", the MoE keys only with experts, `fault.inject` only with elastic pods, ...). `RULES` lists
each such key with the condition under which pwtrain reads it; `check(config)` refuses a key
that is set away from its default (`pwtrain/defaults.py`) while its condition does not hold, in
one line naming both settings, so that a run never trains as if the key were not there.

A key at its default is never refused, so a config that leaves a key alone passes whatever the
other settings are. Keys in no rule take effect under every setting (or are refused by
`pwtrain.config.validate` where a combination cannot work).
"""

import dataclasses
from collections.abc import Callable

from pwtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Rule:
  """`keys` are read only when `holds(config)`; `needs` says so in words, naming the settings
  and values it asks for, and `now(config)` gives those settings' current values."""

  keys: tuple[str, ...]
  needs: str  # e.g. "data.dataset='files'"
  holds: Callable
  now: Callable  # config -> "data.dataset='pystdlib'"


# A condition is (needs, holds, now), as in Rule; `_rule` gives it its keys.


def _is(key: str, *values) -> tuple:
  """The condition: `key` is one of `values`."""
  section, name = key.split(".")
  shown = " or ".join(repr(v) for v in values)
  return (
    f"{key}={shown}",
    lambda c: c[section][name] in values,
    lambda c: f"{key}={c[section][name]!r}",
  )


def _rule(keys, condition) -> Rule:
  needs, holds, now = condition
  return Rule(tuple(keys), needs, holds, now)


def _is_not(key: str, value) -> tuple:
  """The condition: `key` is not `value`."""
  section, name = key.split(".")
  return (
    f"{key} other than {value!r}",
    lambda c: c[section][name] != value,
    lambda c: f"{key}={c[section][name]!r}",
  )


def _schedule(config) -> str:
  """optim.schedule as optim.schedule_for resolves "auto": cosine for AdamW, else rsqrt."""
  o = config.optim
  if o.schedule != "auto":
    return o.schedule
  return "cosine" if o.name == "adamw" else "rsqrt"


def _schedule_is(*names) -> tuple:
  return (
    f'optim.schedule={" or ".join(repr(n) for n in names)} ("auto" is cosine for adamw, '
    "else rsqrt)",
    lambda c: _schedule(c) in names,
    lambda c: f"optim.schedule={c.optim.schedule!r} (here {_schedule(c)!r})",
  )


def _at_least(key: str, minimum: int) -> tuple:
  section, name = key.split(".")
  return (
    f"{key} >= {minimum}",
    lambda c: c[section][name] >= minimum,
    lambda c: f"{key}={c[section][name]!r}",
  )


def _all(*conditions) -> tuple:
  return (
    " and ".join(c[0] for c in conditions),
    lambda config: all(c[1](config) for c in conditions),
    lambda config: ", ".join(c[2](config) for c in conditions if not c[1](config)),
  )


def _any(*conditions) -> tuple:
  return (
    " or ".join(f"({c[0]})" for c in conditions),
    lambda config: any(c[1](config) for c in conditions),
    lambda config: ", ".join(c[2](config) for c in conditions),
  )


_PODS = _at_least("parallel.pods", 2)
_STAGES = _at_least("parallel.stages", 2)

RULES = (
  # data
  _rule(("data.files", "data.jsonl_field", "data.skip_bad_records"), _is("data.dataset", "files")),
  _rule(("data.max_files",), _is("data.dataset", "pystdlib")),
  _rule(("data.tokenizer_path",), _is("data.tokenizer", "sentencepiece", "huggingface")),
  _rule(
    ("data.eos_token", "data.add_special_tokens", "data.stop_tokens"),
    _is("data.tokenizer", "huggingface"),
  ),
  _rule(
    ("data.sp_vocab_size",),
    _all(_is("data.tokenizer", "sentencepiece"), _is("data.tokenizer_path", "")),
  ),
  _rule(("data.eval_split", "train.eval_batches"), _at_least("train.eval_every", 1)),
  # training
  _rule(
    ("train.rollback_skip_batches", "train.max_rollbacks"), _at_least("train.rollback_after", 1)
  ),
  _rule(("train.compile_cache_max_bytes",), _is_not("train.compile_cache_dir", "off")),
  _rule(
    ("rl.temperature", "rl.top_k", "rl.top_p", "rl.clip_low", "rl.clip_high", "rl.kl_coef"),
    _is("train.objective", "grpo"),
  ),
  _rule(
    (
      "rl.task",
      "rl.prompts",
      "rl.reward",
      "rl.group_size",
      "rl.max_tokens",
      "rl.stop_at_eos",
      "rl.normalize_std",
      "rl.max_staleness",
      "rl.init_from",
    ),
    _is("train.objective", "grpo"),
  ),  # fmt: skip
  _rule(("rl.prompt_field",), _all(_is("train.objective", "grpo"), _is("rl.task", ""))),
  # the optimizer and its schedule
  _rule(("optim.b2",), _is("optim.name", "adamw")),
  _rule(("optim.decay_rate",), _is("optim.name", "adafactor")),
  _rule(("optim.weight_decay",), _is("optim.name", "adafactor", "adamw")),
  _rule(("optim.constant_steps",), _schedule_is("rsqrt")),
  _rule(("optim.end_lr_fraction",), _schedule_is("cosine", "linear", "wsd")),
  _rule(("optim.decay_fraction",), _schedule_is("wsd")),
  # layouts
  _rule(("parallel.schedule", "parallel.stage_boundaries"), _STAGES),
  _rule(("parallel.stage_remat",), _any(_STAGES, _all(_PODS, _is("exchange.mode", "overlapped")))),
  _rule(
    (
      "exchange.mode",
      "exchange.compression",
      "exchange.error_feedback",
      "exchange.buckets",
      "exchange.inner_steps",
      "exchange.outer_lr",
      "exchange.outer_momentum",
    ),
    _PODS,
  ),
  _rule(
    ("exchange.buckets",),
    _all(_is("exchange.mode", "overlapped"), _is("parallel.stages", 1)),
  ),
  _rule(
    ("exchange.inner_steps", "exchange.outer_lr", "exchange.outer_momentum"),
    _is("exchange.mode", "diloco"),
  ),
  # Mixture of Experts
  _rule(
    (
      "moe.every",
      "moe.top_k",
      "moe.d_ff",
      "moe.capacity_factor",
      "moe.eval_capacity_factor",
      "moe.dropless",
      "moe.jitter",
      "moe.aux_loss_weight",
      "moe.router_z_loss_weight",
    ),
    _at_least("moe.num_experts", 1),
  ),
  _rule(("moe.capacity_factor", "moe.eval_capacity_factor"), _is("moe.dropless", False)),
  # model families (models/family.py)
  _rule(
    ("model.tie_embeddings", "model.qkv_bias", "model.qk_norm", "model.rope_scaling"),
    _is("model.family", "llama"),
  ),
  _rule(
    (
      "model.rope_factor",
      "model.rope_low_freq_factor",
      "model.rope_high_freq_factor",
      "model.rope_original_max_len",
    ),
    _is("model.rope_scaling", "llama3"),
  ),
  _rule(("model.sliding_window",), _is("model.family", "llama", "gemma")),
  _rule(("model.sliding_window_pattern",), _at_least("model.sliding_window", 1)),
  _rule(
    (
      "model.query_pre_attn_scalar",
      "model.attn_softcap",
      "model.final_softcap",
      "model.post_norms",
    ),
    _is("model.family", "gemma"),
  ),
  # run modes
  _rule(
    (
      "backend.token_file",
      "backend.token_env",
      "backend.tls_ca",
      "backend.rpc_timeout_s",
    ),
    _is("backend.mode", "remote"),
  ),
  _rule(("fault.progress_timeout_s",), _is("backend.mode", "remote", "distributed")),
  _rule(
    (
      "backend.coordinator",
      "backend.num_processes",
      "backend.process_id",
      "backend.connect_timeout_s",
      "backend.pull_timeout_s",
    ),
    _is("backend.mode", "distributed"),
  ),
  _rule(("fault.max_restarts",), _is("backend.mode", "remote", "distributed")),
  _rule(("backend.launch_window",), _is("backend.mode", "embedded", "distributed")),
  _rule(
    ("fault.heartbeat_s",),
    _any(_is("backend.mode", "remote", "distributed"), _is("fault.elastic", True)),
  ),
  _rule(
    ("fault.keep_global_batch", "fault.min_pods", "fault.host_lost_pods", "fault.inject"),
    _is("fault.elastic", True),
  ),
  # Remote workers place serving programs ahead of queued steps without a share: none to keep.
  _rule(("serve.share",), _all(_is("serve.enabled", True), _is("backend.mode", "embedded"))),
  _rule(
    ("metrics.wandb_entity",),
    (
      "metrics.wandb_project set",
      lambda c: bool(c.metrics.wandb_project),
      lambda c: f"metrics.wandb_project={c.metrics.wandb_project!r}",
    ),
  ),  # fmt: skip
)


def _value(config, key: str):
  node = config
  for part in key.split("."):
    node = node[part]
  return node


def check(config, default, rules=RULES) -> None:
  """Raises ConfigError for the first key of `rules` that is set away from its value in
  `default` (the defaults' config) while its rule does not hold: `data.files='my/*.txt' has no
  effect: it is read only with data.dataset='files' (now data.dataset='pystdlib'); set that, or
  leave data.files at its default ('')`."""
  for rule in rules:
    if rule.holds(config):
      continue
    for key in rule.keys:
      value = _value(config, key)
      if _normal(value) != _normal(_value(default, key)):
        raise ConfigError(
          f"{key}={value!r} has no effect: it is read only with {rule.needs} (now "
          f"{rule.now(config)}); set that, or leave {key} at its default "
          f"({_value(default, key)!r})"
        )


def _normal(value):
  """Values as a config file or the command line gives them: a tuple and a list alike."""
  return tuple(value) if isinstance(value, list | tuple) else value

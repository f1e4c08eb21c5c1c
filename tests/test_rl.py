"""The RL loop (pwtrain/rl/): the toy task and its vocabulary, JSONL prompts, reward functions,
group advantages and the batch; rollouts sampled from the live weights by the serving engine,
whose log-probs equal the trainer's recomputation; an RL run's one-line errors."""

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_config, metrics_rows

from pwtrain import harness as harness_lib
from pwtrain import objectives, rl, train
from pwtrain import step as step_lib
from pwtrain.backend import Controller
from pwtrain.errors import DataError, UserError
from pwtrain.harness import Harness
from pwtrain.parallel import plan as plan_lib
from pwtrain.rl import advantages, prompts, rewards, tasks

# grpo_toy, smaller: 4 prompts x 4 completions a step, the model's vocabulary padded past the
# task's 10 ids to 16, as an imported model's may be (the trainer cuts the ids the sampler does).
SMALL = {
  "train.global_batch": 16,
  "rl.group_size": 4,
  "train.num_steps": 4,
  "train.log_every": 1,
  "train.checkpoint_every": 2,
  "model.vocab_size": 16,
}
LEARN_STEPS, LEARNED = 50, 0.35  # the slow test: steps, and the last 10 steps' mean reward


def toy_config(**overrides):
  return load_config("grpo_toy", {**SMALL, **overrides})


# -- the task ------------------------------------------------------------------------------------


def test_the_shift_task_s_answers_rewards_and_vocabulary():
  assert tasks.answer("abch") == "bcda"  # cyclic
  assert tasks.shift_reward("abcdef=", "bcdefg", answer="bcdefg") == 1.0
  assert tasks.shift_reward("abcdef=", "bcd", answer="bcdefg") == 0.5  # missing letters wrong
  assert tasks.shift_reward("abcdef=", "hhhhhhhh", answer="bcdefg") == 0.0
  tok = tasks.ShiftTokenizer()
  ids = tok.prompt("abh=")
  assert ids.tolist() == [tok.eos_id, 1, 2, 8, 9] and tok.vocab_size == 10
  assert tok.decode([1, 2, 0, 9, 12]) == "ab="  # EOS and ids past the vocabulary dropped
  with pytest.raises(ValueError, match="outside"):
    tok.encode("xyz")


def test_task_prompts_are_a_function_of_seed_and_position_and_resume():
  a = tasks.ShiftPrompts(seed=3)
  first = a.take(5)
  state = a.get_state()
  more = a.take(3)
  b = tasks.ShiftPrompts(seed=3)
  b.set_state(state)
  assert b.take(3) == more
  assert [r for _, r in tasks.ShiftPrompts(seed=3).take(5)] == [r for _, r in first]
  assert tasks.ShiftPrompts(seed=4).take(5) != first
  for _, row in first:
    letters = row["prompt"][:-1]
    assert len(letters) == tasks.LENGTH and row["prompt"][-1] == "="
    assert row["answer"] == tasks.answer(letters)


# -- prompts ---------------------------------------------------------------------------------------


def _jsonl(path, lines):
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


def test_prompt_files_are_read_in_order_in_epochs_and_resume(tmp_path):
  path = _jsonl(tmp_path / "p.jsonl", ['{"prompt": "a", "answer": 1}', "", '{"prompt": "b"}'])
  source = prompts.PromptFile(path)
  assert source.take(3) == [(0, {"prompt": "a", "answer": 1}), (1, {"prompt": "b"}),
                            (2, {"prompt": "a", "answer": 1})]  # fmt: skip
  assert source.line_of(1) == 3 and source.line_of(2) == 1
  again = prompts.PromptFile(path)
  again.set_state(source.get_state())
  assert again.take(1) == [(3, {"prompt": "b"})]


@pytest.mark.parametrize(
  "lines, message",
  [
    (None, r"rl.prompts='.*missing.jsonl' is not a file; set rl.prompts"),
    ([], r"rl.prompts='.*' has no prompts; write one JSON object per line"),
    (["", "  "], r"has no prompts"),
    (['{"prompt": "a"}', "{oops"], r"line 2 is not JSON \(.*\); make every line one JSON object"),
    (['["a"]'], r"line 1 is a JSON list, not an object"),
    (['{"prompt": "a"}', '{"question": "b"}'],
     r"line 2: the prompt field 'prompt' is missing \(fields: question\); add it, or set "
     r"rl.prompt_field"),
    (['{"prompt": 3}'], r"line 1: the prompt field 'prompt' is not a string"),
  ],
)  # fmt: skip
def test_a_bad_prompt_file_is_one_line_naming_file_line_and_fix(tmp_path, lines, message):
  path = str(tmp_path / "missing.jsonl") if lines is None else _jsonl(tmp_path / "p.jsonl", lines)
  with pytest.raises(DataError, match=message) as raised:
    prompts.PromptFile(path)
  assert "\n" not in str(raised.value)


# -- rewards ---------------------------------------------------------------------------------------


def raises(prompt, completion, **fields):
  raise ZeroDivisionError("division by zero\nsecond line")


def says_yes(prompt, completion, **fields):
  return "yes"


def nan(prompt, completion, **fields):
  return math.nan


def hashed(prompt, completion, **fields):
  return float(sum(map(ord, completion)) % 3)


def length(prompt, completion, bonus=0, **fields):
  return len(completion) + bonus


def test_built_in_and_named_reward_functions():
  assert rewards.exact_match("q", " 42 \n", answer="42") == 1.0
  assert rewards.exact_match("q", "4", answer="42") == 0.0
  assert rewards.last_number("q", "so 3 + 4 = 1,234.0", answer="1234") == 1.0
  assert rewards.last_number("q", "12 then 13", answer=12) == 0.0
  assert rewards.last_number("q", "no number", answer=1) == 0.0
  reward = rewards.Reward("test_rl:length")
  assert reward("p", "abc", {"bonus": 2}, "row 0") == 5.0
  assert rewards.Reward("exact_match")("p", "x", {"answer": "x"}, "row 0") == 1.0


@pytest.mark.parametrize(
  "spec, message",
  [
    ("test_rl:raises", r"rl.reward='test_rl:raises' raised ZeroDivisionError: division by zero on "
                       r"line 7 of rl.prompts='p.jsonl' \(prompt 'p', completion 'c'\); fix"),
    ("test_rl:says_yes", r"rl.reward='test_rl:says_yes' returned 'yes' \(str\), not a number, on "
                         r"line 7 .*; return an int or a float"),
    ("test_rl:nan", r"rl.reward='test_rl:nan' returned nan on line 7 .*; return a finite number"),
  ],
)  # fmt: skip
def test_a_bad_reward_is_one_line_naming_the_function_and_the_row(spec, message):
  with pytest.raises(rewards.RewardError, match=message) as raised:
    rewards.Reward(spec)("p", "c", {}, "line 7 of rl.prompts='p.jsonl'")
  assert "\n" not in str(raised.value) and isinstance(raised.value, UserError)


@pytest.mark.parametrize(
  "spec, message",
  [
    ("nope", r"rl.reward='nope' is neither a built-in \(exact_match, last_number, shift\) nor"),
    ("no_such_module:f", r"module 'no_such_module' cannot be imported"),
    ("test_rl:missing", r"test_rl has no function 'missing'"),
  ],
)
def test_a_reward_that_cannot_be_loaded_is_one_line(spec, message):
  with pytest.raises(UserError, match=message):
    rewards.Reward(spec)


# -- advantages and the batch --------------------------------------------------------------------


def test_group_advantages_normalise_each_group_and_zero_variance_groups_carry_nothing():
  r = np.asarray([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.25, 0.5, 0.25]])
  adv = advantages.group_advantages(r)
  np.testing.assert_allclose(adv.values[0], [1, -1, -1, 1], atol=1e-5)
  expected = (r[2] - r[2].mean()) / (r[2].std() + advantages.EPS)
  np.testing.assert_allclose(adv.values[2], expected, rtol=1e-6)
  assert adv.zero_variance.tolist() == [False, True, False]
  assert (adv.values[1] == 0).all()
  raw = advantages.group_advantages(r, normalize_std=False)
  np.testing.assert_allclose(raw.values[2], r[2] - r[2].mean(), rtol=1e-6)


def test_the_batch_is_prompt_then_completion_left_aligned_with_targets_on_the_completion():
  prompt = np.asarray([0, 5, 6], np.int32)
  rows = [
    advantages.Rollout(prompt, np.asarray([7, 0], np.int32), np.asarray([-0.5, -0.25], np.float32)),
    advantages.Rollout(prompt, np.asarray([8], np.int32), np.asarray([-1.0], np.float32)),
  ]
  batch = advantages.assemble(rows, np.asarray([2.0, -3.0]), np.asarray([False, True]), 6, 0)
  assert batch["inputs"].tolist() == [[0, 5, 6, 7, 0, 0], [0, 5, 6, 0, 0, 0]]
  assert batch["targets"].tolist() == [[-1, -1, 7, 0, -1, -1], [-1] * 6]  # row 1 masked
  assert batch["advantages"].tolist() == [[0, 0, 2, 2, 0, 0], [0] * 6]
  assert batch["behavior_logprobs"].tolist() == [[0, 0, -0.5, -0.25, 0, 0], [0] * 6]
  with pytest.raises(UserError, match="more than data.seq_len=3; raise data.seq_len or lower"):
    advantages.assemble(rows, np.zeros(2), np.zeros(2, bool), 3, 0)


# -- rollouts from the live weights ----------------------------------------------------------------


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
  """Two batches sampled from the initial weights of grpo_toy (small) by the serving engine, the
  config and the params; rewarded by a completion's hash, so that groups vary (at random
  initialisation the task's reward is mostly 0 in every group, and such groups are masked); the
  model's vocabulary padded to 16 ids (SMALL)."""
  config = toy_config(**{"rl.reward": "test_rl:hashed", "rl.temperature": 1.5})
  batches = rl.rollout_batches(config, str(tmp_path_factory.mktemp("rollouts")))
  # As train.run derives it: the trainer's log-probs cut the ids past the tokenizer's.
  objective = objectives.make(config, num_tokens=batches.tokenizer.vocab_size)
  harness = Harness.build(config, objective=objective)
  with harness:
    state = harness.step_program.init()
    with rl.running(batches, harness, state, 0):
      made = [(next(batches), dict(batches.metrics)) for _ in range(2)]
    params = harness.step_program.to_checkpoint(state)["params"]
    yield config, made, params, harness.objective


def test_rollout_log_probs_equal_the_trainer_s_recomputation(rollouts):
  """The engine's log-prob of each sampled token (KV-cache decode, recorded as generated)
  against the trainer's (objectives.GRPO.logprobs of a full forward pass over the batch's rows,
  jitted as the trainer's, the ids past the task's vocabulary cut as the sampler cuts them):
  bitwise equal in float32, since grpo_toy's model.attention="invariant" makes the decode's
  attention round as the forward's (layers.attend; with "einsum" they differ by float rounding,
  by about 1e-6 on these batches)."""
  config, made, params, objective = rollouts
  assert config.model.vocab_size > objective.num_tokens == tasks.ShiftTokenizer.vocab_size
  assert config.model.attention == "invariant"
  fns = step_lib.model_fns(config.model, config.moe)
  recompute = jax.jit(lambda p, x, t: objective.logprobs(fns.module(p)(x), t))
  for batch, _ in made:
    targets = batch["targets"]
    mine = np.asarray(recompute(params, jnp.asarray(batch["inputs"]), jnp.asarray(targets)))
    completion = targets >= 0
    assert completion.any()
    np.testing.assert_array_equal(mine[completion], batch["behavior_logprobs"][completion])


def test_the_training_step_s_log_probs_equal_a_forward_pass_s_bitwise(rollouts):
  """The log-probs GRPO computes inside the training step's gradient program equal those of a
  forward pass of the same params compiled alone, bitwise: the step's logprob_mismatch_max is 0
  against them. Holds because XLA:CPU computes each operation one way in every program
  (platforms.CPU_NUMERICS_FLAG; without it a LayerNorm's rsqrt is YNNPACK's in the forward pass
  and XLA's in the gradient program, and logits differ by float rounding)."""
  config, made, params, objective = rollouts
  fns = step_lib.model_fns(config.model, config.moe)
  batch = dict(made[0][0])
  targets = jnp.asarray(batch["targets"])
  forward = jax.jit(lambda p, x, t: objective.logprobs(fns.module(p)(x), t))
  batch["behavior_logprobs"] = np.asarray(forward(params, jnp.asarray(batch["inputs"]), targets))
  grads = jax.jit(step_lib.loss_and_grads(fns, objective=objective))
  _, stats = grads(params, {k: jnp.asarray(batch[k]) for k in objective.columns})
  assert float(stats["tokens"]) > 0
  assert float(stats["mismatch_max"]) == 0.0


def test_the_objective_s_ids_are_part_of_what_a_saved_build_is_keyed_by():
  """The ids the trainer's log-probs keep (objectives.make's num_tokens, from the run's tokenizer,
  not a config key) change the step's program, so a saved build of one is not loaded for
  another (harness.build_key)."""
  config = toy_config()
  plan = plan_lib.build(config, plan_lib.make_cluster(config))
  keys = {n: harness_lib.build_key(config, plan, objectives.make(config, n)) for n in (10, 16)}
  assert keys[10] != keys[16]
  assert keys[10] == harness_lib.build_key(config, plan, objectives.make(config, 10))


def test_rollouts_are_groups_of_completions_with_their_metrics(rollouts):
  config, made, _, _ = rollouts
  tok = tasks.ShiftTokenizer()
  batch, metrics = made[0]
  first_prompt = tok.prompt(tasks.ShiftPrompts(config.seed).row(0)["prompt"])
  group = config.rl.group_size
  for r in range(group):  # the first prompt's group: its rows start with it
    assert batch["inputs"][r, : len(first_prompt)].tolist() == first_prompt.tolist()
  assert 0 <= metrics["reward_mean"] <= 2 and metrics["generation_s"] > 0
  assert 1 <= metrics["response_length"] <= config.rl.max_tokens
  assert metrics["weights_step"] == 0 and metrics["weights_step_behind"] == 0
  assert made[1][1]["weights_step_behind"] == 1  # no step between them: the same weights
  assert made[0][0]["inputs"].tolist() != made[1][0]["inputs"].tolist()  # the next prompts


# -- an RL run's one-line errors ----------------------------------------------------------------


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"rl.group_size": 3}, r"train.global_batch=16 is not a multiple of rl.group_size=3"),
    ({"rl.group_size": 1}, r"rl.group_size=1 must be an integer >= 2"),
    ({"rl.max_staleness": 2}, r"rl.max_staleness=2 must be 0 \(rollouts from the weights"),
    (
      {"rl.max_staleness": 1, "backend.mode": "remote", "backend.workers": ["127.0.0.1:1"]},
      r"rl.max_staleness=1 copies the weights",
    ),
    ({"rl.task": "reverse"}, r"rl.task='reverse' is not one of \('shift',\)"),
    ({"rl.task": "", "rl.prompts": "x.jsonl"}, r"rl.prompts='x.jsonl' needs rl.reward"),
    ({"rl.task": ""}, r"needs prompts: set rl.prompts"),
    ({"rl.max_tokens": 16}, r"rl.max_tokens=16 must be an integer in \[1, data.seq_len=16\)"),
    ({"fault.elastic": True}, r"fault.elastic=True cannot run train.objective='grpo'"),
    ({"rl.init_from": "/nonexistent"}, r"rl.init_from='/nonexistent' has no checkpoints"),
  ],
)
def test_bad_rl_settings_are_one_line(tmp_path, overrides, message):
  with pytest.raises(UserError, match=message):
    train.run(toy_config(**overrides), str(tmp_path / "w"), show_progress=False)
  assert not (tmp_path / "w").exists()


def test_a_missing_field_or_an_empty_prompt_file_stops_an_rl_run_in_one_line(tmp_path):
  for lines, message in [([], "has no prompts"), (['{"q": 1}'], "line 1: the prompt field")]:
    path = _jsonl(tmp_path / "p.jsonl", lines)
    config = toy_config(**{"rl.task": "", "rl.prompts": path, "rl.reward": "exact_match"})
    with pytest.raises(DataError, match=message):
      train.run(config, str(tmp_path / "w"), show_progress=False)


def boom_on_third_step(prompt, completion, step=0, **fields):
  if step >= 2:
    raise RuntimeError(f"no reward for step {step}")
  return float(len(completion) % 2)


@pytest.mark.slow
def test_a_reward_that_fails_mid_run_stops_it_in_one_line_keeping_the_checkpoint(tmp_path):
  """Steps 1-2 train and checkpoint; the reward raises on the rows of step 3: one line naming
  the function and the row, and the checkpoint of step 2 is the latest, intact."""
  rows = [json.dumps({"prompt": "abcdef=", "step": i // 4}) for i in range(16)]
  path = _jsonl(tmp_path / "p.jsonl", rows)
  reward = "test_rl:boom_on_third_step"
  config = toy_config(**{"rl.task": "", "rl.prompts": path, "rl.reward": reward})
  workdir = tmp_path / "w"
  with pytest.raises(rewards.RewardError) as raised:
    train.run(config, str(workdir), show_progress=False)
  message = str(raised.value)
  assert "\n" not in message
  assert (
    "rl.reward='test_rl:boom_on_third_step' raised RuntimeError: no reward for step 2" in message
  )
  assert f"on line 9 of rl.prompts={path!r}" in message
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
  rows = [r for r in metrics_rows(workdir) if "loss" in r]
  assert [r["step"] for r in rows] == [1, 2]
  assert all("reward_mean" in r and "generation_s" in r for r in rows)


# -- an RL run -----------------------------------------------------------------------------------

SAME = ("loss", "pg_loss", "reward_mean", "reward_std", "zero_variance_groups", "response_length",
        "weights_step", "weights_step_behind", "logprob_mismatch_max", "tokens")  # fmt: skip


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """grpo_toy (small) run 4 steps without a stop: (its workdir, its RunResult)."""
  workdir = tmp_path_factory.mktemp("straight")
  return workdir, train.run(toy_config(), str(workdir), show_progress=False)


def test_an_interrupted_rl_run_resumes_to_the_uninterrupted_one_exactly(straight, tmp_path):
  """4 steps straight against 2 steps, then a second start that resumes from the checkpoint of
  step 2 and runs 2 more: the same rollouts, rewards, losses and parameters, bitwise; every
  step's rollouts come from the weights after the step before it (weights_step_behind 0), and the
  sampler's log-probs equal the training step's bitwise (logprob_mismatch_max 0: grpo_toy's
  invariant attention; the run passes its tokenizer's ids to the objective, which cuts the
  padded vocabulary's others as the sampler does)."""
  workdir, uninterrupted = straight
  train.run(toy_config(**{"train.num_steps": 2}), str(tmp_path / "split"), show_progress=False)
  resumed = train.run(toy_config(), str(tmp_path / "split"), show_progress=False)
  assert resumed.start_step == 2 and resumed.final_step == 4
  rows = {
    name: {r["step"]: {k: r[k] for k in SAME} for r in metrics_rows(path) if "loss" in r}
    for name, path in (("straight", workdir), ("split", tmp_path / "split"))
  }
  assert rows["straight"] == rows["split"] and sorted(rows["split"]) == [1, 2, 3, 4]
  for step, row in rows["straight"].items():
    assert row["weights_step"] == step - 1 and row["weights_step_behind"] == 0
    assert row["logprob_mismatch_max"] == 0.0
  jax.tree.map(np.testing.assert_array_equal, uninterrupted.state, resumed.state)


@pytest.fixture(scope="module")
def stale(tmp_path_factory):
  """grpo_toy (small) with rl.max_staleness=1, run 4 steps without a stop, each island still
  busy with ordinary work (as with a training step still running) when a weight copy for the
  rollouts is queued behind it: the engine's programs, which go ahead of queued work, are then
  placed ahead of the copy, and must not read the copy before it."""
  workdir = tmp_path_factory.mktemp("stale")
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(Controller, "publish_copy", _busy_before(Controller.publish_copy))
    return workdir, train.run(toy_config(**STALE), str(workdir), show_progress=False)


def _busy_before(publish_copy, busy_s=0.2):
  """Controller.publish_copy that first queues on the island an ordinary item busy `busy_s`."""

  def busy_then_copy(controller, island, name, source):
    with controller._dispatch_lock:
      step, controller._step = controller._step, controller._step + 1
      controller._dispatcher._enqueue("busy", island, lambda: time.sleep(busy_s), [], step)
    return publish_copy(controller, island, name, source)

  return busy_then_copy


STALE = {"rl.max_staleness": 1}


def test_one_step_off_rollouts_come_from_the_weights_before_and_resume_exactly(
  straight, stale, tmp_path
):
  """rl.max_staleness=1: step 1's rollouts come from the initial weights, step N's (N >= 2)
  from the weights after step N-2 (weights_step_behind 1), so the trainer's log-probs differ
  from the behaviour ones (ratio_mean != 1) and the run leaves the on-policy one after step 1;
  2 steps then a resume for 2 more give the same rows and parameters, bitwise."""
  (on_dir, on_policy), (workdir, uninterrupted) = straight, stale
  train.run(toy_config(**STALE, **{"train.num_steps": 2}), str(tmp_path / "s"), show_progress=False)
  resumed = train.run(toy_config(**STALE), str(tmp_path / "s"), show_progress=False)
  assert resumed.start_step == 2 and resumed.final_step == 4
  keys = (*SAME, "ratio_mean")
  rows = {
    name: {r["step"]: {k: r[k] for k in keys} for r in metrics_rows(path) if "loss" in r}
    for name, path in (("on", on_dir), ("straight", workdir), ("split", tmp_path / "s"))
  }
  differ = [(step, k, row[k], rows["split"].get(step, {}).get(k))
            for step, row in rows["straight"].items() for k in keys
            if row[k] != rows["split"].get(step, {}).get(k)]  # fmt: skip
  assert not differ and sorted(rows["split"]) == [1, 2, 3, 4], differ
  jax.tree.map(np.testing.assert_array_equal, uninterrupted.state, resumed.state)
  for step, row in rows["straight"].items():
    assert row["weights_step_behind"] == (step > 1) and row["weights_step"] == max(step - 2, 0)
  assert rows["straight"][1] == rows["on"][1]  # the same rollouts of the same weights
  trained = [r for r in rows["straight"].values() if r["tokens"] > 0]  # groups not all masked
  assert any(abs(r["ratio_mean"] - 1) > 1e-4 for r in trained)
  assert any(r["logprob_mismatch_max"] > 1e-3 for r in trained)
  assert all(abs(r["ratio_mean"] - 1) < 1e-5 for r in rows["on"].values() if r["tokens"] > 0)
  differ = jax.tree.map(lambda a, b: not np.array_equal(a, b), on_policy.state, uninterrupted.state)
  assert any(jax.tree.leaves(differ["params"]))


def test_init_from_starts_from_another_run_s_latest_params(straight):
  """rl.init_from=<the straight run>: the initial state's params are that run's last ones,
  exactly; a run of another model shape is refused in one line."""
  workdir, done = straight
  config = toy_config(**{"rl.init_from": str(workdir)})
  with Harness.build(config) as harness:
    state = rl.initial_state(config, harness.step_program)
    params = harness.step_program.to_checkpoint(state)["params"]
  jax.tree.map(np.testing.assert_array_equal, done.state["params"], params)
  other = toy_config(**{"rl.init_from": str(workdir), "model.d_ff": 128})
  with pytest.raises(UserError, match=r"was trained with another model \(model.d_ff differ\)"):
    rl.initial_state(other, None)


@pytest.mark.slow
@pytest.mark.processes
def test_the_toy_task_learns_from_random_initialisation(tmp_path):
  """The shipped command (`python -m pwtrain.main --config=grpo_toy`) for LEARN_STEPS steps, in
  a process of its own with XLA's default flags (one CPU device, optimised code: the suite's 8
  devices at optimisation level 0 make it 5x slower): the last 10 steps' mean reward is well
  above chance (1/8), and the first step's is near it."""
  import subprocess
  import sys

  from helpers import REPO

  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  cmd = [sys.executable, "-m", "pwtrain.main", "--config=configs/grpo_toy.py",
         f"--workdir={tmp_path}", f"--config.train.num_steps={LEARN_STEPS}"]  # fmt: skip
  done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-2000:]
  rewards = [r["reward_mean"] for r in metrics_rows(tmp_path) if "reward_mean" in r]
  assert len(rewards) == LEARN_STEPS and rewards[0] < 0.1
  assert np.mean(rewards[-10:]) >= LEARNED, rewards


@pytest.mark.slow
def test_attached_serving_answers_beside_an_rl_run_in_the_task_s_vocabulary(tmp_path):
  """serve.enabled beside GRPO: the HTTP server and the rollouts are two engines on the run's
  controller reading the same published weights; a request during the run is answered, in the
  task's vocabulary, and the run trains every step."""
  import threading

  import httpx

  port = 8000 + np.random.default_rng().integers(1000, 9000)
  config = toy_config(**{"train.num_steps": 12, "serve.enabled": True, "serve.port": int(port),
                         "serve.max_len": 16})  # fmt: skip
  answers = []

  def ask():
    body = {"prompt": "abcdef=", "max_tokens": 6, "temperature": 0}
    while not answers:
      try:
        answers.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body).json())
      except httpx.TransportError:
        threading.Event().wait(0.2)

  client = threading.Thread(target=ask, daemon=True)
  client.start()
  result = train.run(config, str(tmp_path / "w"), show_progress=False)
  client.join(timeout=30)
  assert result.final_step == 12
  text = answers[0]["choices"][0]["text"]
  assert len(text) == 6 and set(text) <= set(tasks.ShiftTokenizer.chars)


@pytest.mark.slow
@pytest.mark.parametrize(
  "layout",
  [
    {"parallel.pods": 2, "parallel.islands": 2},
    {"parallel.stages": 2, "parallel.islands": 2, "train.num_microbatches": 2},
  ],
  ids=["pods", "pipeline"],
)
def test_an_rl_run_samples_from_the_live_weights_of_pods_and_pipelines(tmp_path, layout):
  """grpo_toy (small) on 2 pods and on a 2-stage pipeline: the engine serves the pod's cells in
  place (a pipeline's decode through its stage islands), every step's rollouts come from the
  weights after the step before it, and the sampler's log-probs match the trainer's."""
  result = train.run(toy_config(**{"train.num_steps": 3, **layout}), str(tmp_path / "w"),
                     show_progress=False)  # fmt: skip
  rows = [r for r in result.history if "reward_mean" in r]
  assert [r["weights_step"] for r in rows] == [0, 1, 2]
  assert all(r["weights_step_behind"] == 0 and r["logprob_mismatch_max"] <= 1e-5 for r in rows)

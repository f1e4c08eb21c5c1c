"""Model families (models/family.py) on every kind of layout, at the parity tolerance against one
device; an imported Hugging Face model fine-tuned on 2 stages x 2 pods from its step-0
checkpoint, against its one-device run; the dry run's counts of the published models.

Each family is set with every option it has on (llama: GQA, q/k/v biases, q/k norms, Llama 3.1
rope scaling, a sliding window on every layer, an untied output layer; gemma: GQA, local and
global layers, both soft caps, post-norms, the query scale, a tied output layer), and runs 2
SGD steps (test_parity's reasons: an update linear in the gradient) one way per kind of layout
rather than the cross product: FSDP x tensor x data on one island (K/V heads split over tensor),
2 stages x 2 pods with a schedule (GPipe for gemma; for llama, 1F1B with the imported model,
whose output layer is untied), and scanned layers. With MoE layers (the family's gated experts),
each family over data x expert x tensor against its own one-device run.
"""

import os

import jax
import pytest
from helpers import (
  SGD,
  assert_close,
  assert_trees_close,
  random_batches,
  step_through,
  tiny_test_config,
)

from pwtrain import dryrun
from pwtrain.checkpoint import Checkpointer
from pwtrain.harness import Harness

NUM_STEPS = 2
FAMILIES = {
  "llama": {
    "model.family": "llama",
    "model.num_kv_heads": 2,
    "model.qkv_bias": True,
    "model.qk_norm": True,
    "model.rope_scaling": "llama3",
    "model.rope_original_max_len": 16,
    "model.sliding_window": 8,
    "model.norm_eps": 1e-5,
  },
  "gemma": {
    "model.family": "gemma",
    "model.num_kv_heads": 2,
    "model.sliding_window": 8,
    "model.sliding_window_pattern": 2,
    "model.attn_softcap": 20.0,
    "model.final_softcap": 10.0,
    "model.post_norms": True,
    "model.query_pre_attn_scalar": 12,
  },
}
PIPELINE = {"parallel.islands": 4, "parallel.stages": 2, "parallel.pods": 2}
LAYOUTS = {
  "fsdp2_tp2_dp2": {"parallel.data": 2, "parallel.fsdp": 2, "parallel.tensor": 2},
  "2stages_2pods": {**PIPELINE, "train.num_microbatches": 2},
  "scanned_tp2": {"model.scan_layers": True, "parallel.tensor": 2, "parallel.data": 4},
}
MOE = {"moe.num_experts": 4, "moe.top_k": 2, "moe.every": 2}
EXPERT_PARALLEL = {"parallel.data": 2, "parallel.expert": 2, "parallel.tensor": 2}
SCHEDULES = {
  "llama": {"parallel.schedule": "1f1b"},
  "gemma": {"parallel.schedule": "gpipe"},
}


def family_config(family: str, **overrides):
  return tiny_test_config(**SGD, **FAMILIES[family], **{"model.num_layers": 4}, **overrides)


def run(config, batches, devices=None, workdir=None):
  """(host metrics, final whole-model host state) of NUM_STEPS steps of `config`, from its init
  or, with `workdir`, from that run's latest checkpoint (as train.run resumes)."""
  with Harness.build(config, devices) as harness:
    program = harness.step_program
    if workdir is None:
      state = harness.init()
    else:
      reader = Checkpointer(os.path.join(workdir, "checkpoints"), keep=1, every=1, read_only=True)
      _, whole, _ = reader.restore_latest(program.abstract_state)
      reader.close()
      state = program.from_checkpoint(whole)
    metrics, state = step_through(harness, state, batches)
    return metrics, jax.device_get(program.to_checkpoint(state))


def assert_same_run(got, want):
  for a, b in zip(got[0], want[0], strict=True):
    for key in ("loss", "ce_loss", "grad_norm", "param_norm", "update_norm", "tokens"):
      assert_close(a[key], b[key], key)
  state = got[1]["pods"][0] if "pods" in got[1] else got[1]
  assert_trees_close(state["params"], want[1]["params"], "params")


@pytest.fixture(scope="module")
def references():
  out = {}
  for family in FAMILIES:
    config = family_config(family)
    batches = random_batches(config, NUM_STEPS)
    out[family] = batches, run(config, batches, jax.devices()[:1])
  return out


# Llama's pipeline is the imported model's (below): its untied output layer across stages.
CASES = [(f, layout) for f in sorted(FAMILIES) for layout in sorted(LAYOUTS)]
CASES.remove(("llama", "2stages_2pods"))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), CASES)
def test_family_layouts_match_one_device(references, family, layout):
  batches, reference = references[family]
  overrides = dict(LAYOUTS[layout])
  if "parallel.stages" in overrides:
    overrides.update(SCHEDULES[family])
  assert_same_run(run(family_config(family, **overrides), batches), reference)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_moe_with_expert_parallelism_matches_one_device(family):
  """The family's MoE layers (GeGLU experts for gemma, SwiGLU for llama) over data x expert x
  tensor, as one device runs them, dropped tokens included."""
  config = family_config(family, **MOE)
  batches = random_batches(config, NUM_STEPS)
  reference = run(config, batches, jax.devices()[:1])
  assert reference[0][0]["moe_dropped_fraction"] > 0  # the drop decisions must agree too
  assert_same_run(run(family_config(family, **MOE, **EXPERT_PARALLEL), batches), reference)


@pytest.mark.slow
def test_an_imported_model_fine_tunes_on_2_stages_x_2_pods_as_on_one_device(tmp_path):
  """From the step-0 checkpoint `pwtrain.convert from_hf` wrote (with SGD as its optimizer), 2
  stages x 2 pods (1F1B, 2 microbatches) train as one device does."""
  from hf_models import make_hf

  from pwtrain import config as config_lib
  from pwtrain.convert import importer

  make_hf("llama", tmp_path / "hf")
  config_file = importer.from_hf(str(tmp_path / "hf"), str(tmp_path / "run"), dict(SGD))
  workdir = str(tmp_path / "run")
  small = {"data.seq_len": 32, "train.global_batch": 16}
  one = config_lib.load(config_file, small)
  batches = random_batches(one, NUM_STEPS)
  reference = run(one, batches, jax.devices()[:1], workdir)
  layout = {**PIPELINE, "train.num_microbatches": 2, "parallel.schedule": "1f1b"}
  pipelined = config_lib.load(config_file, {**small, **layout})
  assert_same_run(run(pipelined, batches, None, workdir), reference)


@pytest.mark.parametrize(
  ("name", "count"), [("llama3_8b", "8.03B parameters"), ("gemma2_2b", "2.61B parameters")]
)
def test_the_dry_run_counts_the_published_parameters(name, count):
  from helpers import load_config

  text = dryrun.report(load_config(name))
  assert text.startswith(f"Dry run: {count}"), text.splitlines()[0]
  assert "tpu_v4 devices" in text and "(fits)" in text

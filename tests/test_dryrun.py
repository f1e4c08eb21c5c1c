"""The dry-run planner: PaLM 540B on its two TPU v4 pods, planned from abstract shapes only."""

import math
import re

import jax
import numpy as np
import pytest
from helpers import load_config, tiny_test_config
from jax.sharding import Mesh, NamedSharding

from pwtrain import dryrun, optim
from pwtrain import step as step_lib
from pwtrain.models import arithmetic
from pwtrain.parallel import exchange, spmd

GB = 1e9


@pytest.fixture(scope="module")
def palm540b():
  config = load_config("palm_540b")
  return config, dryrun.estimate(config)


def test_palm_540b_parameters_and_cluster(palm540b):
  _, e = palm540b
  # PaLM Table 1: 540.35B parameters (embedding shared with the output layer).
  assert abs(e["params"] / 540.35e9 - 1) < 1e-3
  assert e["mesh_shape"] == {"data": 1, "fsdp": 256, "expert": 1, "tensor": 12}
  assert (e["num_pods"], e["num_stages"], e["num_islands"]) == (2, 1, 2)
  assert (e["devices_per_island"], e["hosts_per_island"], e["num_devices"]) == (3072, 768, 6144)
  # The config pads PaLM's 256000 ids to a multiple of tensor=12 itself (a sharded dimension
  # must divide evenly), so the planner has nothing left to pad.
  assert e["vocab_size"] == e["padded_vocab_size"] == 256_008


def test_palm_540b_bytes_per_device(palm540b):
  _, e = palm540b
  (island,) = e["islands"]
  # float32 parameters split over fsdp x tensor = 3072 chips; only the K/V projections (one
  # MQA head, replicated over tensor), the LayerNorm scales and the vocab padding are not,
  # which costs a few percent.
  ideal = e["params"] * 4 / 3072
  assert ideal <= island["param_bytes"] < 1.05 * ideal
  # Adafactor without factorisation: second moments and the momentum, both param-shaped.
  assert island["optimizer_bytes"] == pytest.approx(2 * island["param_bytes"], rel=1e-3)
  # As configured: model.remat="dots", train.num_microbatches=4, so a chip holds 4 sequences /
  # 4 microbatches x 2048 = 2048 tokens per microbatch. Per token, bf16 (2 bytes), tensor=12:
  # dots keeps the block input and q, k, v, gate, up: 2 (18432 + 48 x 256/12 + 2 x 256 + 2 x
  # 73728/12) = 64512 bytes per layer; one layer's whole set is live in its backward, 2 (2 x
  # 18432 + 2 x 1024 + 2 x 256 + 3 x 6144) + (4 + 2) x 4 x 2048 = 164864; the head's float32
  # logits and gradient over 256008/12 = 21334 vocabulary rows, and its input: 8 x 21334 + 2 x
  # 18432 = 207536.
  assert (e["remat"], e["num_microbatches"], e["tokens_per_device"]) == ("dots", 4, 2048)
  assert e["kept_bytes_per_token"]["dots"] == 64512
  assert e["layer_activation_bytes_per_token"] == 164864
  assert island["activation_bytes"] == 2048 * (118 * 64512 + 164864 + 207536)
  # FSDP gathers a block's weights for its pass and holds its unreduced gradient before the
  # reduce-scatter; the output layer needs the whole embedding matrix, likewise. In bf16, split
  # 12 ways: a block's attention 18432 x 256 x (2 x 48 + 2) = 462422016 and SwiGLU 3 x 18432 x
  # 73728 = 4076863488 parameters, the embedding 256008 x 18432 = 4718739456.
  assert island["gathered_bytes"] == 2 * 2 * (462422016 + 4076863488 + 4718739456) / 12
  assert island["bytes"] == (
    island["state_bytes"] + island["gathered_bytes"] + island["activation_bytes"]
  )
  # It fits 32 GiB with room to spare (23.1 GB of 34.4 GB), by the configured settings.
  assert island["fits"] and island["bytes"] <= 32 * 2**30 and island["to_fit"] is None
  assert 23.0 * GB < island["bytes"] < 23.2 * GB


def test_palm_540b_does_not_fit_with_fewer_microbatches_or_no_remat():
  """The configured remat and microbatches are what make it fit: one fewer halving, or saving
  every activation (unrolled, remat "none"), does not (and the hint names the configured plan
  back). Scanned at "none", each block keeps only its matmul outputs (remat.scanned_policy):
  more than "dots" keeps, less than every activation."""
  two = dryrun.estimate(load_config("palm_540b", {"train.num_microbatches": 2}))
  (island,) = two["islands"]
  assert island["fits"] is False and island["bytes"] > 32 * 2**30
  assert island["to_fit"] == {"remat": "dots", "num_microbatches": 4, "stage_remat": "full"}
  every = {"model.remat": "none", "model.scan_layers": False}
  (none,) = dryrun.estimate(load_config("palm_540b", every))["islands"]
  assert none["fits"] is False
  assert none["activation_bytes"] == none["activation_bytes_by_remat"]["none"]
  # "none" fits at no microbatching
  assert none["to_fit"] == {"remat": "dots", "num_microbatches": 4, "stage_remat": "full"}
  (scanned,) = dryrun.estimate(load_config("palm_540b", {"model.remat": "none"}))["islands"]
  dots = island["activation_bytes_by_remat"]["dots"] / 2  # at 4 microbatches, not 2
  assert dots < scanned["activation_bytes"] < none["activation_bytes"]


def test_palm_1b_fits_one_h100_with_dots_not_without_remat():
  """configs/palm_1b.py, the MFU config: ~1B parameters on one 80 GB H100, which remat "dots"
  makes fit in one pass and unrolled remat "none" does not (its docstring's numbers)."""
  e = dryrun.estimate(load_config("palm_1b"))
  assert abs(e["params"] / 0.949e9 - 1) < 1e-3
  (island,) = e["islands"]
  assert island["fits"] is True and 40 * GB < island["bytes"] < 50 * GB
  every = {"model.remat": "none", "model.scan_layers": False}
  (none,) = dryrun.estimate(load_config("palm_1b", every))["islands"]
  assert none["fits"] is False and none["bytes"] > 80 * GB


def test_palm_540b_cross_pod_bytes_per_host_pair(palm540b):
  _, e = palm540b
  x = e["exchange"]
  assert x["bytes_per_pod_pair"] == e["params"] * 2  # bf16 gradients, each pod to the other
  # PaLM (section 4): "each host exchanging approximately 1.3 GB with its counterparts". The
  # model predicts 540.36e9 x 2 bytes / 768 hosts = 1.407e9 bytes (1.31 GiB). Tolerance 10%:
  # the paper gives one rounded figure whose GB may be 1e9 or 2^30 bytes (a 7% difference),
  # while the mistakes this guards against (float32 gradients, chips instead of hosts) are off
  # by 2x or more.
  assert abs(x["bytes_per_host_pair"] / (1.3 * GB) - 1) < 0.1


def test_palm_540b_step_is_predicted_from_the_assumed_efficiency(palm540b):
  _, e = palm540b
  # 6N + 12LHQT with N excluding the embedding (plan.flops_per_token).
  n = e["params"] - 256_008 * 18432
  assert e["flops_per_token"] == pytest.approx(6 * n + 12 * 118 * 48 * 256 * 2048)
  # The island executes the blocks' matmuls and the output layer's (6 V d per token, which 6N
  # leaves out with the embedding; the 119 LayerNorm scales that 6N counts are no matmul), plus
  # what remat=dots recomputes: attention's scores and weighted sum, 4 H K T = 4 x 48 x 256 x
  # 2048 FLOPs per token and layer, nothing else.
  (island,) = e["islands"]
  matmuls = e["flops_per_token"] + 6 * 256_008 * 18432 - 6 * 119 * 18432
  assert island["flops_per_token"] == pytest.approx(matmuls, rel=1e-12)
  executed = island["flops_per_token"] + 118 * 4 * 48 * 256 * 2048
  assert island["executed_flops_per_token"] == pytest.approx(executed)
  assert e["recompute_factor"] == pytest.approx(executed / island["flops_per_token"])
  # Compute = executed FLOPs / (devices x peak x the assumed 50%), per pod (one stage: no bubble).
  assert e["hardware"]["efficiency"] == 0.5
  assert e["compute_s"] == pytest.approx(executed * 2048 * 2048 / 2 / (3072 * 275e12 * 0.5))
  x = e["exchange"]
  assert 0 < x["exposed_s"] == x["transfer_s"] < 0.05 * e["step_s"]  # sync: all exposed
  assert e["step_s"] == pytest.approx(e["compute_s"] + x["exposed_s"])
  # MFU counts 6N + 12LHKT per token (PaLM's, no output layer) against the step's time.
  mfu = e["flops_per_token"] / executed * 0.5 * e["compute_s"] / e["step_s"]
  assert e["mfu"] == pytest.approx(mfu)
  assert e["ici_s"] < e["compute_s"]
  # A prediction, compared with (not fitted to) PaLM's measured 238.3k tokens/s (46.2% MFU) at
  # batch 2048: 253k tokens/s, 48.8% MFU. 15%: what the assumed efficiency's round number can
  # be off by while the arithmetic is right (a 2x mistake in FLOPs or devices is far outside).
  assert abs(e["tokens_per_s"] / 238.3e3 - 1) < 0.15
  assert 0.48 < e["mfu"] < 0.49


def test_compute_time_follows_the_hardware_efficiency():
  """Step compute is executed FLOPs / (peak x hardware.efficiency): halving the efficiency
  doubles it, and MFU at zero exposed transfer halves with it."""
  config = load_config("palm_540b")
  base = dryrun.estimate(config)
  config.hardware.efficiency = 0.25
  half = dryrun.estimate(config)
  assert half["compute_s"] == pytest.approx(2 * base["compute_s"])
  assert half["step_s"] - half["exchange"]["exposed_s"] == pytest.approx(2 * base["compute_s"])
  assert half["recompute_factor"] == base["recompute_factor"]


def test_palm_540b_report_has_the_key_lines(palm540b):
  config, _ = palm540b
  text = dryrun.report(config)
  for line in (
    "Dry run: 540.36B parameters",
    "2 pod(s) x 1 stage(s) = 2 island(s) of 3072 tpu_v4 devices",
    "Mesh per island: data=1 x fsdp=256 x tensor=12",
    "  parameters       728.",
    "  optimizer state  1.46 GB",
    "  activations      16.35 GB (model.remat=dots, train.num_microbatches=4; other policies: "
    "none 20.81 GB, outputs 13.14 GB, full 9.67 GB)",
    "  gathered weights 3.09 GB (FSDP: the largest block's and the embedding's, with their "
    "unreduced gradients)",
    "  total            23.08 GB (fits) in 34.36 GB (32 GiB)",
    "Activations per token a layer keeps, by model.remat: none 82.94 kB, dots 64.51 kB, "
    "outputs 51.20 kB, full 36.86 kB; tokens per device and microbatch: 2,048",
    "assumed 50.0% of peak FLOP/s (275 TFLOP/s per device) on the executed FLOPs, x1.004 the "
    "model's (recomputed by remat=dots)",
    "FLOPs per token: 3.249e+12 (6N + 12LHQT)",
    "tokens per step: 4,194,304 (2048 x 2048)",
    "Cross-pod exchange (sync, compression bf16): 1.08 TB per pod pair per step, 1.41 GB per "
    "host pair",
    "MFU 48.8% (predicted from the assumed 50% of peak)",
  ):
    assert line in text, f"{line!r} not in\n{text}"
  assert "to fit" not in text
  # The config pads the vocabulary itself; one that does not is planned padded, and says so.
  unpadded = dryrun.report(load_config("palm_540b", {"model.vocab_size": 256_000}))
  assert "Vocabulary: 256,000 padded to 256,008 for tensor=12 sharding" in unpadded


def test_hardware_overrides_change_the_estimate():
  config = load_config("palm_540b")
  base = dryrun.estimate(config)["exchange"]["transfer_s"]
  config.hardware.dcn_bytes_per_s /= 2
  assert dryrun.estimate(config)["exchange"]["transfer_s"] == pytest.approx(2 * base)
  config.hardware.name = "tpu_v9"
  with pytest.raises(ValueError, match=re.escape("hardware.name='tpu_v9' is not a known")):
    dryrun.estimate(config)


def test_fast_model_fns_match_the_model():
  """dryrun.model_fns copies block 0 to every layer: same trees as building every block."""
  config = tiny_test_config(**{"model.num_layers": 3})
  full, fast = step_lib.model_fns(config.model), dryrun.model_fns(config.model)
  assert jax.tree.structure(full.abstract_params) == jax.tree.structure(fast.abstract_params)
  assert jax.tree.leaves(full.abstract_params) == jax.tree.leaves(fast.abstract_params)
  assert full.logical_axes == fast.logical_axes


def test_shard_bytes_match_jax_on_a_real_mesh():
  """The arithmetic shard sizes equal NamedSharding.shard_shape on 8 CPU devices."""
  config = tiny_test_config(**{"parallel.data": 1, "parallel.fsdp": 4, "parallel.tensor": 2})
  shape = {"data": 1, "fsdp": 4, "tensor": 2}
  mesh = Mesh(np.asarray(jax.devices()).reshape(1, 4, 2), tuple(shape))
  fns = dryrun.model_fns(config.model)
  tx, _ = optim.build(config.optim, 10)
  state = dryrun.abstract_state(fns, tx, config.seed, exchange.make(config))
  shardings = spmd.state_shardings(fns, mesh, state)

  def real(a, s: NamedSharding):
    return int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize

  expected = jax.tree.map(real, state, shardings)
  got = jax.tree.map(lambda a, s: dryrun.shard_bytes(a, s, shape), state, shardings)
  assert jax.tree.leaves(got) == jax.tree.leaves(expected)
  island = dryrun.estimate(config)["islands"][0]
  assert island["param_bytes"] == sum(jax.tree.leaves(expected["params"]))


def test_tiny_config_dry_runs_on_the_local_devices():
  config = load_config("palm_tiny")
  e = dryrun.estimate(config)
  assert e["devices_per_island"] == len(jax.devices()) == 8
  assert e["mesh_shape"] == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
  assert e["padded_vocab_size"] == e["vocab_size"] == 512
  (island,) = e["islands"]
  assert island["param_bytes"] == e["params"] * 4  # data parallel only: replicated
  assert e["exchange"]["bytes_per_step"] == 0
  assert e["step_s"] is None  # CPU: no peak FLOP/s to estimate from
  text = dryrun.report(config)
  assert "Mesh per island: data=8 x fsdp=1 x tensor=1" in text
  assert "Cross-pod exchange: none (one pod)" in text


@pytest.mark.parametrize("name", ["palm_tiny_2pods", "palm_tiny_pipeline"])
def test_tiny_pods_and_pipelines_dry_run_on_an_abstract_cluster(name):
  config = load_config(name)
  with config.unlocked():
    config.hardware = "tpu_v4"
  e = dryrun.estimate(config)
  assert len(e["islands"]) == config.parallel.stages
  assert sum(r["params"] for r in e["islands"]) >= e["params"]  # pipelines: embedding twice
  assert e["step_s"] > 0 and 0 < e["mfu"] < 1
  if config.parallel.pods > 1:
    # The step program's exchange_bytes: each pod sends its float32 gradients once.
    assert e["exchange"]["bytes_per_step"] == e["params"] * 4


def test_error_feedback_residual_is_counted():
  """exchange.error_feedback keeps a float32 residual the size of the gradients per pod: on a
  data-parallel island (parameters replicated) that is params x 4 bytes more per device."""
  config = load_config("palm_tiny_2pods")
  config.exchange.compression = "int8"
  base = dryrun.estimate(config)
  config.exchange.error_feedback = True
  e = dryrun.estimate(config)
  (plain,), (fed,) = base["islands"], e["islands"]
  residual = e["params"] * 4
  assert fed["exchange_state_bytes"] - plain["exchange_state_bytes"] == residual
  assert fed["state_bytes"] - plain["state_bytes"] == residual
  assert fed["bytes"] - plain["bytes"] == residual
  assert e["exchange"] == base["exchange"]  # what crosses pods is unchanged


# -- per remat policy: what a block keeps and what its backward recomputes ----------------------

# A small bf16 block, every dim distinct: d=64, H=4 heads of K=16, g=1 K/V head, F=96, T=32.
REMAT_SMALL = {
  "model.d_model": 64,
  "model.num_heads": 4,
  "model.head_dim": 16,
  "model.num_kv_heads": 1,
  "model.d_ff": 96,
  "model.dtype": "bfloat16",
  "data.seq_len": 32,
}
# By hand, bytes per token (B = 2), unsplit (tensor=1):
#   none     B (2d + 2HK + 2gK + 3F) + (4 + B) H T = 2 (128 + 128 + 32 + 288) + 6 x 4 x 32
#   dots     B (d + HK + 2gK + 2F) = 2 (64 + 64 + 32 + 192)
#   outputs  B (d + HK + F) = 2 (64 + 64 + 96)
#   full     B d
KEPT = {"none": 1920, "dots": 704, "outputs": 448, "full": 128}
# By hand, recomputed matmul FLOPs per token and layer (qkv = d K (H + 2g) = 6144 weights,
# gate and up = 2 d F = 12288, attention's scores = 2 H K T = 4096, weighted sum the same):
#   none 0; full 2 (6144 + 12288) + 2 x 4096; dots 2 x 4096; outputs 2 (6144 + 12288) + 4096
RECOMPUTED = {"none": 0, "full": 45056, "dots": 8192, "outputs": 40960}


def test_kept_bytes_and_recomputed_flops_per_remat_policy_by_hand():
  m = load_config("palm_tiny", REMAT_SMALL).model
  for remat in dryrun.REMAT_BY_MEMORY:
    assert arithmetic.remat_kept_bytes(m, 1, 32, remat) == KEPT[remat], remat
    assert arithmetic.remat_recompute_flops(m, None, 32, remat, 0) == RECOMPUTED[remat], remat
  # Split 2 ways over tensor: the heads' and the MLP's shares halve; d and the K/V head do not.
  assert arithmetic.remat_kept_bytes(m, 2, 32, "dots") == 2 * (64 + 32 + 32 + 96)
  assert arithmetic.remat_kept_bytes(m, 2, 32, "outputs") == 2 * (64 + 32 + 48)


def _dot_flops(jaxpr) -> int:
  """dot_general FLOPs of a jaxpr and its sub-jaxprs (remat, pjit, custom rules)."""
  from jax.extend import core

  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contracting, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contracting)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, core.ClosedJaxpr):
          total += _dot_flops(sub.jaxpr)
        elif isinstance(sub, core.Jaxpr):
          total += _dot_flops(sub)
  return total


def _per_layer(remat: str, scanned: bool = False) -> tuple[float, float]:
  """(activation bytes jax.vjp keeps, dot FLOPs of the loss's gradient) per token of one layer:
  a 2-layer model's minus a 1-layer model's, batch 5 x 32 tokens (160 rows: no parameter's
  leading dimension, since the params are leaves of the vjp too). A scanned model's residuals
  are stacked: [layers, batch, ...]."""
  import jax.numpy as jnp

  from pwtrain.models import lm_loss

  batch, out = 5, []
  for layers in (1, 2):
    config = load_config(
      "palm_tiny",
      {
        **REMAT_SMALL,
        "model.remat": remat,
        "model.num_layers": layers,
        "model.scan_layers": scanned,
      },
    )
    fns = step_lib.model_fns(config.model, config.moe)
    params, tokens = fns.init(jax.random.key(0)), jnp.zeros((batch, 32), jnp.int32)

    def loss(p, fns=fns, tokens=tokens):
      return lm_loss(fns.module(p)(tokens), tokens)[0]

    _, backward = jax.vjp(loss, params)  # its leaves: the residuals (and the params)
    # Activations lead with the batch, or with batch * length (SwiGLU multiplies token rows).
    rows = {(batch,), (batch * 32,)}
    leading = (lambda x: x.shape[1:2]) if scanned else (lambda x: x.shape[:1])
    kept = sum(x.nbytes for x in jax.tree.leaves(backward) if leading(x) in rows)
    out.append((kept, _dot_flops(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)))
  (kept1, flops1), (kept2, flops2) = out
  return (kept2 - kept1) / (batch * 32), (flops2 - flops1) / (batch * 32)


@pytest.mark.parametrize("remat", ["none", "dots", "outputs", "full"])
@pytest.mark.slow
def test_per_policy_arithmetic_is_what_jax_keeps_and_executes(remat):
  """The dry run's per-token figures against the model itself: the residuals jax.vjp keeps
  (exactly, for every remat policy; "none" is an estimate of what survives XLA's fusion: the
  jaxpr keeps more float32 temporaries, never less) and the extra dot_general FLOPs in the
  jaxpr of the gradient (exactly, for every policy)."""
  config = load_config("palm_tiny", REMAT_SMALL)
  m, moe = config.model, config.moe
  kept, flops = _per_layer(remat)
  model = arithmetic.remat_kept_bytes(m, 1, 32, remat)
  if remat == "none":
    assert kept >= model
  else:
    assert kept == model
  block, _, _ = arithmetic.layer_costs(m, moe, 32)
  assert flops == block[0] + arithmetic.remat_recompute_flops(m, moe, 32, remat, 0)


@pytest.mark.slow
def test_scanned_model_at_remat_none_keeps_its_matmul_outputs():
  """A scanned model at remat "none" keeps what remat.scanned_policy keeps: exactly the
  residuals jax.vjp stacks per layer, less than the unrolled model, more than "dots"; its
  backward recomputes no matmul (a 1-layer scan's gradient, whose body runs once, has the
  unrolled model's dot FLOPs)."""
  import jax.numpy as jnp

  from pwtrain.models import lm_loss

  config = load_config("palm_tiny", {**REMAT_SMALL, "model.scan_layers": True})
  kept, _ = _per_layer("none", scanned=True)
  # B (d + 2HK + 2gK + 2F + HT) = 2 (64 + 128 + 32 + 192 + 128)
  assert arithmetic.remat_kept_bytes(config.model, 1, 32, "none") == kept == 1088
  assert KEPT["dots"] < kept < KEPT["none"]
  flops = []
  for scanned in (False, True):
    c = load_config(
      "palm_tiny", {**REMAT_SMALL, "model.scan_layers": scanned, "model.num_layers": 1}
    )
    fns = step_lib.model_fns(c.model, c.moe)
    params, tokens = fns.init(jax.random.key(0)), jnp.zeros((5, 32), jnp.int32)
    grad = jax.grad(lambda p, fns=fns, tokens=tokens: lm_loss(fns.module(p)(tokens), tokens)[0])
    flops.append(_dot_flops(jax.make_jaxpr(grad)(params).jaxpr))
  assert flops[0] == flops[1] > 0


def test_recompute_follows_remat_and_pipeline_stages():
  """Executed FLOPs = the model's + remat's recomputation in every block + a pipeline stage's
  forward again in its backward (every stage but the last, whose FB piece does not recompute)."""
  base = load_config("palm_540b")
  block = arithmetic.layer_costs(base.model, base.moe, 2048)[0][0]
  scores = 2 * 48 * 256 * 2048
  projections = 2 * 18432 * 256 * (48 + 2) + 2 * 2 * 18432 * 73728
  extra = {"none": 0, "dots": 2 * scores, "outputs": projections + scores}
  extra["full"] = projections + 2 * scores
  assert extra["full"] < block / 3  # wo and w_down are never recomputed
  for remat, per_layer in extra.items():
    e = dryrun.estimate(load_config("palm_540b", {"model.remat": remat}))
    (island,) = e["islands"]
    assert island["executed_flops_per_token"] == pytest.approx(
      island["flops_per_token"] + 118 * per_layer
    ), remat
  config = load_config("palm_tiny_pipeline")
  with config.unlocked():
    config.hardware = "tpu_v4"
  rows = dryrun.estimate(config)["islands"]
  for row in rows[:-1]:
    assert row["executed_flops_per_token"] == pytest.approx(4 / 3 * row["flops_per_token"])
  assert rows[-1]["executed_flops_per_token"] == rows[-1]["flops_per_token"]
  config.model.remat = "full"
  full = dryrun.estimate(config)["islands"]
  m = config.model
  recomputed = arithmetic.remat_recompute_flops(m, config.moe, config.data.seq_len, "full", 0)
  for row, plain in zip(full, rows, strict=True):  # one layer per stage
    assert row["executed_flops_per_token"] == pytest.approx(
      plain["executed_flops_per_token"] + recomputed
    )
  # Stages that keep their residuals (parallel.stage_remat="none") recompute nothing, and hold
  # what their blocks keep per microbatch in flight on top of their inputs.
  config.model.remat, config.parallel.stage_remat = "none", "none"
  kept = dryrun.estimate(config)["islands"]
  for row, plain in zip(kept, rows, strict=True):
    assert row["executed_flops_per_token"] == row["flops_per_token"]
    assert row["activation_bytes"] >= plain["activation_bytes"]
  assert config.parallel.schedule == "1f1b" and config.train.num_microbatches == 8
  tokens = 16 // 8 // 2 * 128  # a microbatch's tokens on one of an island's 2 devices
  block = arithmetic.layer_activation_bytes(m, 1, config.data.seq_len)
  extra = kept[0]["activation_bytes"] - rows[0]["activation_bytes"]
  # Stage 0 of 4 under 1F1B: 4 microbatches in flight, each with its one layer's whole set; at
  # "full" the one in its backward had it.
  assert extra == pytest.approx(tokens * (4 - 1) * block)
  # Stage 1: 3 in flight, each holding its layer's set, whose block input is the stage's input
  # (held at "full" too); at "full" the one in its backward had the whole set.
  extra = kept[1]["activation_bytes"] - rows[1]["activation_bytes"]
  stage_input = arithmetic.layer_input_bytes(m)
  assert extra == pytest.approx(tokens * (3 * (block - stage_input) - block))
  # Where no remat policy makes the residuals fit and the stages' recomputation does, the hint
  # says so: at remat "full" a microbatch's residuals are its blocks' inputs, which stage 0
  # holds for each one in flight, and at stage_remat "full" for one at a time.
  config.model.remat, config.parallel.stage_remat = "full", "full"
  memory = dryrun.estimate(config)["islands"][0]["bytes"]
  config.parallel.stage_remat = "none"
  with config.unlocked():
    del config["hardware"]
    config.hardware = {"name": "tpu_v4", "memory_bytes": int(memory)}
  (first, *_) = dryrun.estimate(config)["islands"]
  assert first["fits"] is False
  assert first["to_fit"] == {"remat": "full", "num_microbatches": 8, "stage_remat": "full"}


def test_zero_bubble_counts_its_recompute_memory_and_bubble():
  """zero_bubble at stage_remat="full": W takes B's residuals, so the stages recompute what
  1F1B's do (every stage's forward but the last's, once); a stage after the first holds the
  residuals of the microbatches between its B and W; and the step's bubble (counted from the
  schedule) is below 1F1B's (M + S - 1) / M; the report says."""
  config = load_config("palm_tiny_pipeline")
  with config.unlocked():
    config.hardware = "tpu_v4"
  one_f = dryrun.estimate(config)
  config.parallel.schedule = "zero_bubble"
  zb = dryrun.estimate(config)
  assert one_f["bubble"] == pytest.approx((8 + 4 - 1) / 8)
  assert 1.0 < zb["bubble"] < one_f["bubble"]
  flops = [row["executed_flops_per_token"] / row["flops_per_token"] for row in zb["islands"]]
  assert flops == pytest.approx([4 / 3, 4 / 3, 4 / 3, 1])
  one_f_flops = [r["executed_flops_per_token"] / r["flops_per_token"] for r in one_f["islands"]]
  assert flops == one_f_flops
  held = [
    z["activation_bytes"] - o["activation_bytes"]
    for z, o in zip(zb["islands"], one_f["islands"], strict=True)
  ]
  assert held[0] == 0 and all(h > 0 for h in held[1:])
  assert zb["compute_s"] == pytest.approx(
    one_f["compute_s"] * zb["bubble"] / one_f["bubble"] * max(flops) / (4 / 3), rel=0.2
  )
  assert "parallel.schedule=zero_bubble, 4 stages, 8 microbatches" in dryrun.report(config)


def test_bad_cluster_is_refused_by_the_plan():
  config = tiny_test_config(**{"parallel.islands": 2, "parallel.pods": 1})
  with pytest.raises(ValueError, match=re.escape("parallel.islands=2 must equal")):
    dryrun.estimate(config)


@pytest.mark.processes
def test_main_dry_run_plans_palm_540b_and_writes_nothing(tmp_path):
  import subprocess
  import sys

  from helpers import REPO

  result = subprocess.run(
    [sys.executable, "-m", "pwtrain.main", "--config=configs/palm_540b.py", "--dry_run",
     f"--workdir={tmp_path / 'run'}"],
    cwd=REPO, capture_output=True, text=True, timeout=180,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-2000:]
  assert "540.36B parameters" in result.stdout and "per host pair" in result.stdout
  assert not (tmp_path / "run").exists()

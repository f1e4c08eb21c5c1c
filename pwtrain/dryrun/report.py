"""The dry run's printout: `report(config)` is `estimate(config)` as lines of text.

Sizes are in decimal units (1 GB = 1e9 bytes); per-device figures are pod 0's islands, which
stand for every pod's. Sections, top to bottom: the cluster and mesh, each island's memory per
device with the configured model.remat and train.num_microbatches (whether it fits, and how to
make it fit), the step's compute at the assumed hardware efficiency and collectives, the
cross-pod exchange, and the step time and MFU the assumption predicts.
"""

from pwtrain.dryrun.estimate import estimate


def size_text(n: float) -> str:
  for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def _seconds(x) -> str:
  return "n/a" if x is None else f"{x:.3g} s"


def fits_text(value) -> str:
  return {None: "capacity unknown", True: "fits", False: "does NOT fit"}[value]


def cluster_lines(e: dict) -> list[str]:
  """Parameters, pods, stages, islands and devices; the mesh; the vocabulary's padding."""
  hw = e["hardware"]
  # The expert axis is shown only where it splits something (an MoE model's experts).
  axes = {a: n for a, n in e["mesh_shape"].items() if a != "expert" or n > 1}
  mesh = " x ".join(f"{a}={n}" for a, n in axes.items())
  count = f"{e['params'] / 1e9:,.2f}B" if e["params"] >= 1e9 else f"{e['params'] / 1e6:,.2f}M"
  lines = [
    f"Dry run: {count} parameters ({e['params']:,}, {e['param_dtype']}), "
    f"{e['num_pods']} pod(s) x {e['num_stages']} stage(s) = {e['num_islands']} island(s) of "
    f"{e['devices_per_island']} {hw['name']} devices ({e['num_devices']} devices, "
    f"{e['hosts_per_island']} host(s) per island)",
    f"Mesh per island: {mesh}",
  ]
  if e["padded_vocab_size"] != e["vocab_size"]:
    lines.append(
      f"Vocabulary: {e['vocab_size']:,} padded to {e['padded_vocab_size']:,} for "
      f"tensor={e['mesh_shape']['tensor']} sharding"
    )
  return lines


def _cells(r: dict, num_stages: int, tied: bool) -> str:
  """The island's cells: pipeline stages, or (one stage cut by the exchange) chunks; `tied`:
  the output layer is the embedding."""
  kind = "stage" if len(r["stages"]) == 1 or num_stages > 1 else "chunk"
  parts = []
  for index, start, stop, first, last in r["stages"]:
    part = f"{kind} {index}: layers {start}-{stop - 1}"
    part += " + embedding" if first else ""
    part += " + head" if last and not first else (" + head (tied)" if last and tied else "")
    part += " + head" if last and first and not tied else ""
    parts.append(part)
  return "; ".join(parts)


def island_lines(r: dict, e: dict) -> list[str]:
  """One island's memory per device with the configured remat and microbatches (the other
  policies' activations for comparison), and what would make it fit."""
  num_stages, memory = e["num_stages"], e["hardware"]["memory_bytes"]
  remat, micro = e["remat"], e["num_microbatches"]
  capacity = "unknown" if memory is None else f"{size_text(memory)} ({memory / 2**30:.3g} GiB)"
  lines = [
    f"{r['island']} ({_cells(r, num_stages, e['tied_output'])}; every pod alike), per device:",
    f"  parameters       {size_text(r['param_bytes'])} ({r['params'] / 1e9:,.3f}B params)",
    f"  optimizer state  {size_text(r['optimizer_bytes'])}",
    f"  gradients        {size_text(r['gradient_buffer_bytes'])} (running sums)",
  ]
  if r["exchange_state_bytes"]:
    lines.append(f"  exchange state   {size_text(r['exchange_state_bytes'])}")
  if r["exchange_buffer_bytes"]:
    lines.append(f"  exchange buffers {size_text(r['exchange_buffer_bytes'])} (pods' gradients)")
  others = ", ".join(
    f"{policy} {size_text(n)}"
    for policy, n in r["activation_bytes_by_remat"].items()
    if policy != remat
  )
  if r["gathered_bytes"]:
    lines.append(
      f"  gathered weights {size_text(r['gathered_bytes'])} (FSDP: the largest block's and the "
      "embedding's, with their unreduced gradients)"
    )
  stages = ""
  if num_stages > 1:
    stages = f", parallel.stage_remat={e['stage_remat']}"
    if r["residuals_lower_bound"]:
      stages += " (a lower bound: stages keep the forward's whole residual set)"
  lines += [
    f"  activations      {size_text(r['activation_bytes'])} (model.remat={remat}{stages}, "
    f"train.num_microbatches={micro}; other policies: {others})",
    f"  total            {size_text(r['bytes'])} ({fits_text(r['fits'])}) in {capacity}",
  ]
  if r["fits"] is False:
    hint = r["to_fit"]
    lines.append(
      "  to fit           "
      + (
        f"model.remat={hint['remat']} and train.num_microbatches={hint['num_microbatches']}"
        + (
          f" and parallel.stage_remat={hint['stage_remat']}"
          if hint["stage_remat"] != e["stage_remat"]
          else ""
        )
        if hint
        else "more devices (no remat policy and microbatching fits)"
      )
    )
  return lines


def compute_lines(e: dict, config) -> list[str]:
  """Activations and FLOPs per token, the step's compute time, and in-island collectives."""
  hw = e["hardware"]
  if e["compute_s"] is None:
    compute = f"Compute: n/a (no peak FLOP/s known for {hw['name']})"
  else:
    compute = (
      f"Compute: {e['compute_s']:.3g} s per step, assumed {hw['efficiency']:.1%} of peak FLOP/s "
      f"({hw['peak_flops'] / 1e12:g} TFLOP/s per device) on the executed FLOPs, "
      f"x{e['recompute_factor']:.4g} the model's (recomputed by remat={e['remat']}"
      + (" and the stages' backward)" if e["stages_recompute"] else ")")
    )
  hidden = e["ici_s"] and e["compute_s"] and e["ici_s"] > e["compute_s"]
  pipeline = []
  if e["num_stages"] > 1:
    pipeline = [
      f"Pipeline: parallel.schedule={e['schedule']}, {e['num_stages']} stages, "
      f"{e['num_microbatches']} microbatches: the step is x{e['bubble']:.3f} a stage's work "
      "(counted from the schedule with F, B, W = 1, 2, 1; bubble included in Compute)"
    ]
  kept = ", ".join(f"{p} {size_text(n)}" for p, n in e["kept_bytes_per_token"].items())
  return [
    f"Activations per token a layer keeps, by model.remat: {kept}; tokens per device and "
    f"microbatch: {e['tokens_per_device']:,}",
    f"FLOPs per token: {e['flops_per_token']:.4g} (6N + 12LHQT); tokens per step: "
    f"{e['tokens_per_step']:,} ({config.train.global_batch} x {config.data.seq_len})",
    *pipeline,
    compute,
    f"In-island collectives: {size_text(e['ici_bytes'])} per device per step, "
    f"{_seconds(e['ici_s'])} at ICI bandwidth (assumed hidden under compute"
    + (": NOT hideable)" if hidden else ")"),
  ]


def exchange_lines(e: dict) -> list[str]:
  """What crosses pods per step, per pod pair and per host pair, and how long it takes."""
  x, dcn = e["exchange"], e["hardware"]["dcn_bytes_per_s"]
  if x["mode"] is None:
    return ["Cross-pod exchange: none (one pod)"]
  return [
    f"Cross-pod exchange ({x['mode']}, compression {x['compression']}): "
    f"{size_text(x['bytes_per_pod_pair'])} per pod pair per step, "
    f"{size_text(x['bytes_per_host_pair'])} per host pair",
    f"  transfer {_seconds(x['transfer_s'])} at "
    f"{'n/a' if dcn is None else size_text(dcn) + '/s'} per host; "
    f"exposed {_seconds(x['exposed_s'])}",
  ]


def step_line(e: dict) -> str:
  if e["step_s"] is None:
    return "Step: n/a (no peak FLOP/s or network bandwidth known for this hardware)"
  return (
    f"Step: {e['step_s']:.3g} s; MFU {e['mfu']:.1%} (predicted from the assumed "
    f"{e['hardware']['efficiency']:.0%} of peak); {e['tokens_per_s']:,.0f} tokens/s"
  )


def report(config) -> str:
  """`estimate(config)` as printable lines."""
  e = estimate(config)
  lines = cluster_lines(e)
  for r in e["islands"]:
    lines += island_lines(r, e)
  lines += compute_lines(e, config) + exchange_lines(e) + [step_line(e)]
  return "\n".join(lines)

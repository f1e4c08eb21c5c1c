"""Peak host memory of `python -m pwtrain.convert` both ways, on a synthetic checkpoint of
several GB.

  python experiments/bench_convert.py --dir=/tmp/bench_convert

1. Writes a Llama-architecture Hugging Face directory (config.json, safetensors shards with
   their index, a tokenizer) of random float32 weights, one tensor at a time (the exporter's
   own writer), default d_model 2048, 16 layers, vocabulary 32000: 852M parameters, 3.41 GB.
2. Runs `from_hf` into a workdir (SGD as the run's optimizer: its state is one momentum per
   parameter) and `to_hf` back out, each as its own process, and reads each process's peak
   resident set size (the kernel's ru_maxrss of the finished child), beside a process that
   only starts JAX and imports the converter (the floor every command pays).
3. Checks the export is bitwise the input (tensor by tensor, reading both lazily).

On this CPU machine the devices are the host: an import's train state lives in host memory
(the parameters and their optimizer state, `state_bytes`), so its peak is reported with that
figure beside it, and its own overhead is the rest. The export holds one tensor at a time.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

from common import REPO, force_host_devices

force_host_devices(8)

import numpy as np  # noqa: E402

from pwtrain.convert import safetensors_io  # noqa: E402

SHAPE = {"d": 2048, "layers": 16, "heads": 16, "kv_heads": 4, "head_dim": 128, "ff": 5632}


def hf_dir(path: str, vocab: int, shard_size: int) -> int:
  """The synthetic checkpoint; returns its bytes."""
  s = SHAPE
  d, h, g, k, f = s["d"], s["heads"], s["kv_heads"], s["head_dim"], s["ff"]
  tensors = [("model.embed_tokens.weight", (vocab, d), "float32")]
  for i in range(s["layers"]):
    p = f"model.layers.{i}"
    tensors += [
      (f"{p}.input_layernorm.weight", (d,), "float32"),
      (f"{p}.self_attn.q_proj.weight", (h * k, d), "float32"),
      (f"{p}.self_attn.k_proj.weight", (g * k, d), "float32"),
      (f"{p}.self_attn.v_proj.weight", (g * k, d), "float32"),
      (f"{p}.self_attn.o_proj.weight", (d, h * k), "float32"),
      (f"{p}.post_attention_layernorm.weight", (d,), "float32"),
      (f"{p}.mlp.gate_proj.weight", (f, d), "float32"),
      (f"{p}.mlp.up_proj.weight", (f, d), "float32"),
      (f"{p}.mlp.down_proj.weight", (d, f), "float32"),
    ]
  tensors += [("model.norm.weight", (d,), "float32"), ("lm_head.weight", (vocab, d), "float32")]
  rng = np.random.default_rng(0)
  shapes = {name: shape for name, shape, _ in tensors}
  os.makedirs(path, exist_ok=True)
  safetensors_io.write_shards(
    path, tensors, lambda n: rng.standard_normal(shapes[n], np.float32) * 0.02, shard_size
  )
  config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": vocab,
    "hidden_size": d,
    "intermediate_size": f,
    "num_hidden_layers": s["layers"],
    "num_attention_heads": h,
    "num_key_value_heads": g,
    "head_dim": k,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
  }
  with open(os.path.join(path, "config.json"), "w") as out:
    json.dump(config, out, indent=2)
  _tokenizer(path)
  return sum(int(np.prod(shape)) * 4 for _, shape, _ in tensors)


def _tokenizer(path: str) -> None:
  from tokenizers import Tokenizer, models, pre_tokenizers

  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as out:
    json.dump({"eos_token": "</s>", "bos_token": "<s>"}, out)


# Run in a fresh wrapper process, so that earlier children do not mask the peak: the command's
# ru_maxrss (all resident pages, a file's mapped pages included), and the peak of its anonymous
# resident memory (RssAnon: what it holds, not the page cache of the files it maps), sampled
# every 50 ms from /proc.
_WRAPPER = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
anon = 0
while p.poll() is None:
  try:
    with open(f"/proc/{p.pid}/status") as f:
      for line in f:
        if line.startswith("RssAnon:"):
          anon = max(anon, int(line.split()[1]) * 1024)
  except OSError:
    pass
  time.sleep(0.05)
err = p.stderr.read()
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"rc": p.returncode, "err": err[-2000:], "rss": rss, "anon": anon,
                  "s": time.perf_counter() - t}))
"""


def child_peak(command: list[str]) -> tuple[float, float, float]:
  """(peak RSS, peak anonymous RSS, seconds) of `command`."""
  proc = subprocess.run(
    [sys.executable, "-c", _WRAPPER, *command], cwd=REPO, capture_output=True, text=True
  )
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  if out["rc"]:
    raise SystemExit(f"{' '.join(command)} failed:\n{out['err']}")
  return float(out["rss"]), float(out["anon"]), out["s"]


def same_tensors(a: str, b: str) -> bool:
  ra, rb = safetensors_io.Reader(a), safetensors_io.Reader(b)
  if ra.names != rb.names:
    return False
  for name in ra.names:
    full = tuple(slice(0, n) for n in ra.shape(name))
    if ra.read(name, full).tobytes() != rb.read(name, full).tobytes():
      return False
  return True


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--dir", default="/tmp/bench_convert")
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--shard_size", default="1GB")
  parser.add_argument("--keep", action="store_true", help="keep the files afterwards")
  args = parser.parse_args()
  shutil.rmtree(args.dir, ignore_errors=True)
  source, run, out = (os.path.join(args.dir, n) for n in ("hf", "run", "out"))
  size = hf_dir(source, args.vocab, 10**9)
  python = [sys.executable]
  floor = python + [
    "-c",
    "from pwtrain import platforms; platforms.prepare(); import jax; "
    "jax.devices(); import pwtrain.convert.importer, pwtrain.convert.exporter",
  ]
  convert = python + ["-m", "pwtrain.convert"]
  sgd = ["--config.optim.name=sgd"]
  rows = {
    "floor": child_peak(floor),
    "from_hf": child_peak(convert + ["from_hf", source, f"--workdir={run}", *sgd]),
    "to_hf": child_peak(
      convert + ["to_hf", f"--workdir={run}", out, f"--shard_size={args.shard_size}"]
    ),
  }
  params = size // 4
  state_bytes = 2 * size  # parameters and SGD's momentum, float32, on the CPU devices
  result = {
    "checkpoint_bytes": size,
    "params": params,
    "state_bytes": state_bytes,
    **{f"{k}_peak_rss_bytes": v[0] for k, v in rows.items()},
    **{f"{k}_peak_anon_rss_bytes": v[1] for k, v in rows.items()},
    **{f"{k}_seconds": v[2] for k, v in rows.items()},
    "bitwise_round_trip": same_tensors(source, out),
  }
  print(json.dumps(result, indent=2))
  gb = lambda b: f"{b / 1e9:.2f} GB"
  for name, (rss, anon, seconds) in rows.items():
    print(f"{name}: peak RSS {gb(rss)}, peak anonymous RSS {gb(anon)}, {seconds:.0f} s")
  print(
    f"checkpoint {gb(size)} ({params / 1e6:.0f}M float32 parameters); the import's train state "
    f"on the CPU devices {gb(state_bytes)}; round trip bitwise: {result['bitwise_round_trip']}"
  )
  if not args.keep:
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
  main()

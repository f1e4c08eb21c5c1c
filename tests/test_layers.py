"""The package's shape: imports only point down the layers, no module imports itself in a
circle, and no hand-written module grows past FILE_LINES lines (docs/architecture.md).

Imports are read with `ast` from the source, function-level (lazy) imports included, so a
circle hidden behind a lazy import is still one.
"""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pwtrain"
GENERATED = ("protocol_pb2.py", "protocol_pb2_grpc.py")  # grpc_tools.protoc output
FILE_LINES = 400

# Lowest first. A component may import its own modules and those of lower layers only; the
# components of one layer do not import each other.
LAYERS = (
  # What a distributed run's processes say to each other on the host; the errors a user fixes.
  (
    "processes",
    "errors",
    "goodput",
    "platforms",
    "console",
    "console_lines",
    "watch",
    "liveness",
    "events",
    "exits",
  ),
  # Foundations: jax, orbax and the standard library only.
  (
    "sharding",
    "defaults",
    "conditions",
    "drills",
    "preemption",
    "workdir",
    "profiling",
    "optim",
    "guard",
    "metrics",
    "wandb_run",
    "process_logs",
  ),
  ("checkpoint",),  # the checkpoint store: Orbax saves, parts, integrity (remote workers use it)
  # The model, the runtime and the data: independent of each other.
  ("models", "backend", "data"),
  ("objectives",),  # what the step minimises: a loss of the logits and its statistics
  ("step",),  # the train step as pure functions of a model
  ("parallel",),  # the plan, exchange strategies, step programs over islands
  ("config",),  # validation and loading (reads the exchange modes)
  ("configs",),  # the shipped configs: files that start from the defaults or from each other
  # config -> a ready step; a run's latest checkpoint read back; the run's compilation cache
  ("harness", "restore", "compile_cache"),
  ("inference",),  # a trained run's model for inference (config, tokenizer, weights)
  # config -> a plan on paper (and the step compiled for a TPU topology: dryrun/compile.py);
  # steps over the live pods: a lost pod dropped, a returning one rejoined; serving over HTTP.
  ("dryrun", "elastic", "serve"),
  ("rl",),  # the RL loop: prompts, rewards, rollouts from the live weights (serving's engine)
  ("train",),  # the training loop
  # entry points: training and the dry run; sampling; launcher; Hugging Face conversion
  ("main", "sample", "launch", "convert"),
)
LAYER = {component: i for i, layer in enumerate(LAYERS) for component in layer}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path, modules) -> set[str]:
  """The pwtrain modules `path` imports (`from a import b` is module a.b when that exists)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("pwtrain"))
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pwtrain"):
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        found.add(sub if sub in modules else node.module)
  return found


def _component(module: str) -> str:
  return module.split(".")[1] if "." in module else module


def _graph() -> dict[str, set[str]]:
  sources = _sources()
  return {m: _imports(p, sources) - {m} for m, p in sources.items()}


def test_every_component_has_a_layer():
  missing = sorted({_component(m) for m in _graph() if m != "pwtrain"} - set(LAYER))
  assert not missing, f"add {missing} to LAYERS (and to docs/architecture.md)"


def test_imports_point_down():
  upward = []
  for module, imports in _graph().items():
    if module == "pwtrain":
      continue
    own = _component(module)
    for target in imports:
      other = _component(target)
      if other != own and LAYER[other] >= LAYER[own]:
        upward.append(f"{module} -> {target}")
  assert not upward, "imports that do not point to a lower layer:\n" + "\n".join(sorted(upward))


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    state[node] = 2
    path.pop()
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def test_no_import_circle():
  cycle = _find_cycle(_graph())
  assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_circle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _find_cycle(graph) == ["a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_modules_stay_small():
  long = {
    str(p.relative_to(REPO)): n
    for p in PACKAGE.rglob("*.py")
    if p.name not in GENERATED and (n := len(p.read_text().splitlines())) > FILE_LINES
  }
  assert not long, f"modules over {FILE_LINES} lines (split them by concept): {long}"

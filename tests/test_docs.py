"""The docs agree with the code: README.md and docs/*.md.

- docs/config.md documents every key of `pwtrain.defaults.get_config()`, and no other, each with
  its actual default;
- every `python -m pwtrain...` command in them parses: its module exists, every `--flag` is one
  the module defines, `--config=` names a config file of the repository, and every
  `--config.<key>=` override names a key of that config;
- the README stays a front page (at most README_LINES lines) that shows the CI's test command,
  relative links point to files that exist, and nothing mentions `../shared`;
- the measured figures of README's Faults section and of docs/reliability.md's table of faults by
  mode are docs/benchmarks.md's: each is followed by a link to a benchmarks.md section that gives
  it, so a figure copied by hand and left stale fails; every cell of that table gives a measured
  cost or says it is not measured.

Nothing here trains or touches a device: commands are read, not run.
"""

import ast
import functools
import pathlib
import re
import shlex

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = (README, *sorted((REPO / "docs").glob("*.md")))
README_LINES = 250
# Shell operators that end a command (`a && b`, `worker ... &`, `a | b`).
OPERATORS = {"&&", "||", "&", ";", "|", ";;"}
# absl.app's help flags, defined only once app.run starts.
ABSL_HELP = {"help", "helpfull", "helpshort", "helpxml", "?"}


def _text(path) -> str:
  return path.read_text(encoding="utf-8")


def _name(path) -> str:
  return str(path.relative_to(REPO))


# -- docs/config.md against pwtrain/defaults.py -------------------------------------------------


def _flatten(tree: dict, prefix: str = "") -> dict:
  """{"section.key": value} of a nested dict (a ConfigDict's to_dict()); top-level keys as is."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def _cells(line: str) -> list[str]:
  """The cells of a Markdown table row (`\\|` is a pipe inside a cell)."""
  body = line.strip()
  body = body[1:] if body.startswith("|") else body
  body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
  return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", body)]


def _code(cell: str) -> str | None:
  """The text of a cell that is one code span, else None."""
  match = re.fullmatch(r"`([^`]*)`", cell)
  return match.group(1) if match else None


def config_tables(text: str) -> list[tuple[str, str, int]]:
  """(key, default text, line number) of every row of the tables whose header is
  `key | default | meaning`."""
  rows = []
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    if lines[i].lstrip().startswith("|") and _cells(lines[i]) == ["key", "default", "meaning"]:
      i += 2  # the header and its --- row
      while i < len(lines) and lines[i].lstrip().startswith("|"):
        cells = _cells(lines[i])
        assert len(cells) == 3, f"docs/config.md:{i + 1}: a row of 3 cells: {lines[i]!r}"
        key, default = _code(cells[0]), _code(cells[1])
        assert key is not None and default is not None, (
          f"docs/config.md:{i + 1}: key and default must each be one `code span`: {lines[i]!r}"
        )
        rows.append((key, default, i + 1))
        i += 1
    else:
      i += 1
  return rows


def same_default(text: str, value) -> bool:
  """Whether a documented default `text` stands for `value`: equal as a Python literal and of
  the same type (`1` is not `1.0`), placeholders (unset keys) written `None`; text that is no
  literal must be the value's repr."""
  try:
    literal = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text == repr(value)
  return type(literal) is type(value) and literal == value


def test_config_md_lists_every_default_key_with_its_default():
  from pwtrain.defaults import get_config

  defaults = _flatten(get_config().to_dict())
  rows = config_tables(_text(REPO / "docs" / "config.md"))
  keys = [key for key, _, _ in rows]
  duplicates = sorted({k for k in keys if keys.count(k) > 1})
  assert not duplicates, f"docs/config.md documents these keys twice: {duplicates}"
  missing, extra = sorted(set(defaults) - set(keys)), sorted(set(keys) - set(defaults))
  assert not missing and not extra, (
    f"docs/config.md and pwtrain/defaults.py disagree: undocumented keys {missing}; documented "
    f"keys that are not defaults {extra}"
  )
  wrong = [
    f"docs/config.md:{line}: `{key}` is documented as `{text}`, its default is {defaults[key]!r}"
    for key, text, line in rows
    if not same_default(text, defaults[key])
  ]
  assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
  "text, value, same",
  [
    ("300", 300, True),
    ("300.0", 300, False),
    ("0.0001", 1e-4, True),
    ("'pystdlib'", "pystdlib", True),
    ('"pystdlib"', "pystdlib", True),
    ("()", (), True),
    ("None", None, True),
    ("''", None, False),
    ("True", 1, False),
  ],
)
def test_same_default(text, value, same):
  assert same_default(text, value) is same


def test_config_tables_parse_rows_and_escaped_pipes():
  text = "| key | default | meaning |\n| --- | --- | --- |\n| `a.b` | `'x'` | y `<\\|z\\|>` |\n\nok"
  assert config_tables(text) == [("a.b", "'x'", 3)]


# -- commands -------------------------------------------------------------------------------------


def _logical_lines(block: str) -> list[str]:
  """A code block's lines with backslash continuations joined."""
  lines, current = [], ""
  for line in block.splitlines():
    if line.rstrip().endswith("\\"):
      current += line.rstrip()[:-1] + " "
    else:
      lines.append(current + line)
      current = ""
  if current:
    lines.append(current)
  return lines


def commands(text: str) -> list[str]:
  """Every `python -m pwtrain...` command in fenced code blocks and in inline code spans, from
  `python` on (an environment or `srun` prefix dropped).

  None is skipped: placeholders such as `<bucket>` or `<project>` stand only where a value goes
  (a path, a string key's value), and those are checked for their key, not their text."""
  found = []
  fences = re.compile(r"^\s*```[^\n]*\n(.*?)^\s*```[ \t]*$", re.M | re.S)
  for block in fences.findall(text):
    for line in _logical_lines(block):
      if "python -m pwtrain" in line:
        found.append(line[line.index("python -m pwtrain") :])
  prose = fences.sub("", text)
  for span in re.findall(r"`([^`]+)`", prose):
    span = " ".join(span.split())
    if "python -m pwtrain" in span:
      found.append(span[span.index("python -m pwtrain") :])
  return found


def _tokens(command: str) -> list[str]:
  """The command's words up to the first shell operator, as the shell would split them."""
  # Only the operators as punctuation: `<bucket>` in `--workdir=gs://<bucket>/run` is text.
  lexer = shlex.shlex(command, posix=True, punctuation_chars="&|;")
  lexer.whitespace_split = True
  words = []
  for word in lexer:
    if word in OPERATORS:
      break
    words.append(word)
  return words


def _module_file(module: str):
  """The file `python -m <module>` runs: <module>.py, or a package's __main__.py."""
  path = REPO.joinpath(*module.split("."))
  for candidate in (path.with_suffix(".py"), path / "__main__.py"):
    if candidate.is_file():
      return candidate
  return None


@functools.cache
def module_flags(module: str) -> frozenset[str]:
  """The flags `python -m <module>` accepts: its absl DEFINE_* calls (bools also as --no<name>,
  plus absl's own flags) and its argparse add_argument("--name") calls, read from the source."""
  tree = ast.parse(_module_file(module).read_text())
  names, absl_used = set(), False
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    func = node.func
    attr = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    strings = [a.value for a in node.args if isinstance(a, ast.Constant)]
    strings = [s for s in strings if isinstance(s, str)]
    if attr.startswith("DEFINE") and strings:
      absl_used = True
      names.add(strings[0])
      if attr in ("DEFINE_bool", "DEFINE_boolean"):
        names.add(f"no{strings[0]}")
    elif attr == "add_argument":
      names.update(s[2:] for s in strings if s.startswith("--"))
  if absl_used:
    from absl import app, flags
    from absl import logging as absl_logging

    del app, absl_logging  # imported for the flags they define
    for owner, defined in flags.FLAGS.flags_by_module_dict().items():
      if owner.startswith("absl."):
        for flag in defined:
          names.update({flag.name, f"no{flag.name}"} if flag.boolean else {flag.name})
    names |= ABSL_HELP
  return frozenset(names)


@functools.cache
def load_config(spec: str):
  """The config `--config=<spec>` loads (a path relative to the repository root)."""
  from pwtrain import config as config_lib

  return config_lib.load(in_repo(spec))


def in_repo(spec: str) -> str:
  """`--config=<spec>` as pwtrain.main run at the repository root reads it: a shipped config's
  name as it is (pwtrain.config.resolve), a path relative to the root."""
  file, sep, arg = spec.partition(":")
  return spec if is_name(file) else f"{REPO / file}{sep}{arg}"


def is_name(file: str) -> bool:
  return "/" not in file and not file.endswith(".py")


def _has_key(config, key: str) -> bool:
  node = config
  for part in key.split("."):
    if not hasattr(node, "keys") or part not in node:
      return False
    node = node[part]
  return True


def _value(config, key: str, text: str):
  """`text` as `--config.<key>=<text>` sets it: as is for a key of type str (placeholders
  included), else as a Python literal (a bare word stays a string, for the config to refuse if
  it must)."""
  *parents, name = key.split(".")
  node = config
  for part in parents:
    node = node[part]
  if node.get_ref(name).get_type() is str:
    return text
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def check_overrides(spec: str, overrides: dict[str, str]) -> str | None:
  """Why the overrides {key: text} cannot be set on config `spec` (an unknown key, a value of
  the wrong type), or None. Placeholders such as `<project>` are strings like any other."""
  from pwtrain import config as config_lib
  from pwtrain.errors import ConfigError

  config = load_config(spec)
  unknown = [key for key in overrides if not _has_key(config, key)]
  if unknown:
    return f"{spec.partition(':')[0]} has no key {unknown[0]}"
  values = {key: _value(config, key, text) for key, text in overrides.items()}
  try:
    config_lib.load(in_repo(spec), values)
  except ConfigError as e:
    return str(e)
  return None


def check_command(words: list[str], where: str) -> list[str]:
  """What is wrong with the command `words` (python -m <module> <args>)."""
  if words[:2] != ["python", "-m"] or len(words) < 3:
    return [f"{where}: not `python -m <module> ...`: {' '.join(words)}"]
  module, args = words[2], words[3:]
  if _module_file(module) is None:
    return [f"{where}: no module {module} (pwtrain/...)"]
  problems = []
  if module == "pwtrain.launch":
    if "--" not in args:
      return [f"{where}: pwtrain.launch needs `-- <pwtrain.main flags>`"]
    cut = args.index("--")
    args, main_args = args[:cut], args[cut + 1 :]
    problems += check_command(["python", "-m", "pwtrain.main", *main_args], f"{where} (after --)")
  flags = module_flags(module)
  config_spec, overrides = None, {}
  for arg in args:
    if not arg.startswith("--"):
      continue  # a flag's value, or a positional argument
    name, _, value = arg[2:].partition("=")
    if name == "config":
      config_spec = value
    elif name.startswith("config.") and "config" in flags:
      overrides[name.removeprefix("config.")] = value
    elif name not in flags:
      problems.append(f"{where}: {module} has no flag --{name}")
  if module in ("pwtrain.main", "pwtrain.convert") and config_spec is None:
    config_spec = "palm_tiny"  # main's default; the defaults convert's from_hf starts from
  if config_spec is not None and "<" in config_spec:
    config_spec = None  # a file of the user's (`--config=<run>/config.py`): not in the repository
    overrides = {}
  if config_spec is not None:
    from pwtrain import config as config_lib

    file = config_spec.partition(":")[0]
    if is_name(file) and file not in config_lib.shipped():
      return [*problems, f"{where}: --config={config_spec}: no shipped config {file}"]
    if not is_name(file) and not (REPO / file).is_file():
      return [*problems, f"{where}: --config={config_spec}: no file {file} in the repository"]
    wrong = check_overrides(config_spec, overrides)
    if wrong:
      problems.append(f"{where}: --config.* overrides: {wrong}")
  elif module == "pwtrain.serve":  # serve.* overrides apply to the run's config.json too
    from pwtrain.defaults import get_config

    unknown = [k for k in overrides if not k.startswith("serve.") or not _has_key(get_config(), k)]
    if unknown:
      problems.append(f"{where}: --config.{unknown[0]}: only serve.* keys without --config")
  elif overrides:
    problems.append(f"{where}: --config.{next(iter(overrides))} without --config=<file>")
  return problems


def _all_commands() -> list[tuple[str, str]]:
  return [(_name(path), command) for path in DOCS for command in commands(_text(path))]


def test_docs_show_commands():
  found = _all_commands()
  assert len(found) >= 20, f"only {len(found)} commands found: is the extraction broken?"
  modules = {_tokens(command)[2] for _, command in found}
  assert {"pwtrain.main", "pwtrain.launch", "pwtrain.sample"} <= modules, modules


def test_every_command_in_the_docs_parses():
  problems = []
  for where, command in _all_commands():
    problems += check_command(_tokens(command), f"{where}: `{command}`")
  assert not problems, "\n".join(problems)


def test_command_extraction_and_checks():
  text = (
    "Run `python -m pwtrain.main --config=configs/palm_tiny.py --dry_run`.\n\n"
    "```bash\n"
    "X=1 python -m pwtrain.main --config=configs/palm_tiny.py \\\n"
    "  --config.train.num_steps=5 --workdir=/tmp/x & # a comment\n"
    "python -m pwtrain.launch --nproc=2 -- --config=configs/palm_tiny.py --bogus\n"
    "```\n"
  )
  found = commands(text)
  assert len(found) == 3
  assert _tokens(found[0])[-1] == "--workdir=/tmp/x"
  assert check_command(_tokens(found[0]), "a") == []
  assert check_command(_tokens(found[2]), "b") == []
  assert check_command(_tokens(found[1]), "c") == ["c (after --): pwtrain.main has no flag --bogus"]
  wrong = "python -m pwtrain.main --config=configs/palm_tiny.py --config.train.nope=1 --dryrun"
  assert len(check_command(_tokens(wrong), "d")) == 2
  typed = "python -m pwtrain.main --config=configs/palm_tiny.py --config.train.num_steps=lots"
  assert "num_steps" in check_command(_tokens(typed), "f")[0]
  tuples = (
    "python -m pwtrain.main --config=configs/palm_tiny.py --config.train.profile_steps='(1, 2)' "
    "--config.data.files=x.txt --config.model.scan_layers=True "
    "--config.parallel.stage_boundaries='(0, 1, 3, 4)' --config.data.data_dir=<dir>"
  )
  assert _tokens(tuples)[-1] == "--config.data.data_dir=<dir>"
  assert check_command(_tokens(tuples), "g") == []
  missing = "python -m pwtrain.main --config=configs/nothing.py"
  assert "no file" in check_command(_tokens(missing), "e")[0]
  assert check_command(_tokens("python -m pwtrain.main --config=palm_tiny --dry_run"), "h") == []
  unknown = "python -m pwtrain.main --config=palm_nothing --dry_run"
  assert "no shipped config" in check_command(_tokens(unknown), "i")[0]


# -- the front page and links ---------------------------------------------------------------------


def test_readme_is_a_front_page():
  lines = _text(README).splitlines()
  assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; at most {README_LINES}"


def test_readme_shows_the_ci_test_command():
  ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
  blocks = re.findall(r"^```(?:bash|sh|shell)?\n(.*?)^```", _text(README), re.M | re.S)
  assert any(ci in block.splitlines() for block in blocks), f"README.md must show `{ci}`"


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_nothing_mentions_shared(path):
  assert "../shared" not in _text(path)


def anchors(text: str) -> set[str]:
  """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped,
  spaces as hyphens (code blocks hold no headings)."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
  found = set()
  for heading in re.findall(r"^#+ (.+)$", text, re.M):
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    found.add(slug)
  return found


def test_anchors_follow_github():
  assert anchors("# Pipelines: stages on separate islands\n## hardware (dry run only)\n") == {
    "pipelines-stages-on-separate-islands",
    "hardware-dry-run-only",
  }
  assert "compiling-for-the-real-target---dry_run---compile" in anchors(
    "## Compiling for the real target: --dry_run --compile"
  )


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_relative_links_exist(path):
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", _text(path)):
    if re.match(r"[a-z]+:", target):
      continue
    file, _, anchor = target.partition("#")
    linked = (path.parent / file) if file else path
    if not linked.exists():
      broken.append(target)
    elif anchor and linked.suffix == ".md" and anchor not in anchors(_text(linked)):
      broken.append(target)
  assert not broken, f"{_name(path)}: links to missing files or headings: {broken}"


def test_architecture_layers_match_test_layers():
  """docs/architecture.md's layer table lists tests/test_layers.py's LAYERS, in order."""
  from test_layers import LAYERS

  text = _text(REPO / "docs" / "architecture.md")
  table = text[text.index("| layer | modules | owns |") :].split("\n\n")[0].splitlines()[2:]
  documented = tuple(
    tuple(name.rstrip("/") for name in re.findall(r"`([^`]+)`", _cells(row)[1])) for row in table
  )
  assert documented == tuple(tuple(layer) for layer in LAYERS), (
    "docs/architecture.md's layer table differs from tests/test_layers.py's LAYERS"
  )


# -- measured figures come from docs/benchmarks.md ---------------------------------------------

BENCHMARKS = REPO / "docs" / "benchmarks.md"
# A figure is a number with a decimal point (counts and settings in these texts are whole).
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?!\d)")
SOURCE = re.compile(r"\]\([^)\s]*benchmarks\.md#([^)\s]+)\)")
FAULTS = ("killed", "stopped", "wedged", "disk full", "peer lost mid-transfer")
MODES = (
  "embedded",
  "remote",
  "distributed, under `pwtrain.launch`",
  "distributed, started by hand",
)


def _no_code(text: str) -> str:
  return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def section(text: str, anchor: str) -> str:
  """The text under the heading whose GitHub anchor is `anchor`, up to the next heading of its
  level or above (its subsections included); '' if there is none."""
  lines, found, level, inside = text.splitlines(), None, 0, False
  for i, line in enumerate(lines):
    inside = inside != line.startswith("```")
    heading = None if inside else re.match(r"(#+) (.+)$", line)
    if heading and found is not None and len(heading.group(1)) <= level:
      return "\n".join(lines[found:i])
    if heading and found is None and anchors(line) == {anchor}:
      found, level = i + 1, len(heading.group(1))
  return "\n".join(lines[found:]) if found is not None else ""


def chunks(text: str) -> list[str]:
  """Paragraphs of `text`, with each cell of a table row a chunk of its own; code left out."""
  out = []
  for paragraph in re.split(r"\n\s*\n", _no_code(text)):
    if paragraph.lstrip().startswith("|"):
      out.extend(cell for row in paragraph.splitlines() for cell in _cells(row))
    else:
      out.append(paragraph)
  return out


def sourced_figures(text: str) -> list[tuple[str, str | None]]:
  """(figure, anchor) for every figure of `text`: the anchor of the first link to a section of
  docs/benchmarks.md that follows it in its paragraph or table cell, or None if none does."""
  out = []
  for chunk in chunks(text):
    links = [(m.start(), m.group(1)) for m in SOURCE.finditer(chunk)]
    for figure in FIGURE.finditer(chunk):
      after = [anchor for start, anchor in links if start > figure.start()]
      out.append((figure.group(), after[0] if after else None))
  return out


def unsourced(text: str, benchmarks: str) -> list[str]:
  """The figures of `text` that no following link to a benchmarks.md section gives."""
  wrong = []
  for figure, anchor in sourced_figures(text):
    if anchor is None:
      wrong.append(f"{figure}: no link to the benchmarks.md section that gives it follows it")
      continue
    given = section(benchmarks, anchor)
    if not re.search(rf"(?<![\w.]){re.escape(figure)}(?!\d)", given):
      wrong.append(f"{figure}: not in benchmarks.md#{anchor}, which its link names")
  return wrong


def _section_of(path, heading: str) -> str:
  text = section(_text(path), next(iter(anchors(heading))))
  assert text, f"{_name(path)} has no section {heading!r}"
  return text


@pytest.mark.parametrize(
  ("path", "heading"),
  [(README, "## Faults"), (REPO / "docs" / "reliability.md", "## Faults by mode")],
  ids=lambda x: _name(x) if isinstance(x, pathlib.Path) else x,
)
def test_fault_figures_are_those_of_benchmarks_md(path, heading):
  text = _section_of(path, heading)
  assert len(sourced_figures(text)) >= 8, f"{_name(path)} {heading!r} gives the measured figures"
  wrong = unsourced(text, _text(BENCHMARKS))
  assert not wrong, f"{_name(path)} {heading!r}: " + "; ".join(wrong)


def test_the_fault_table_gives_every_fault_by_mode_measured_or_not():
  text = _section_of(REPO / "docs" / "reliability.md", "## Faults by mode")
  rows = [_cells(line) for line in text.splitlines() if line.startswith("|")]
  header, body = rows[0], rows[2:]
  assert header[0] == "fault" and all(
    cell.startswith(mode) for cell, mode in zip(header[1:], MODES, strict=True)
  ), header
  assert [row[0].split(" (")[0] for row in body] == list(FAULTS), [row[0] for row in body]
  vague = [
    f"{row[0]!r} / {mode!r}"
    for row in body
    for mode, cell in zip(MODES, row[1:], strict=True)
    if "benchmarks.md#" not in cell and "not measured" not in cell.lower()
  ]
  assert not vague, f"cells with neither a measured cost nor 'not measured': {vague}"


def test_a_stale_or_unlinked_figure_is_found():
  benchmarks = (
    "# B\n\n## Faults\n\n| a | 0.19 s |\n\n```\n## 7.25 in code\n```\n\n## Other\n\n3.5 s\n"
  )
  assert section(benchmarks, "faults").strip().startswith("| a | 0.19 s |")
  assert "3.5" not in section(benchmarks, "faults")
  link = "([b](docs/benchmarks.md#faults))"
  assert unsourced(f"cost 0.19 s {link}", benchmarks) == []
  assert unsourced(f"| 0.19 s {link} | 0.19 s |", benchmarks) == [
    "0.19: no link to the benchmarks.md section that gives it follows it"
  ]
  assert unsourced(f"cost 0.20 s {link}", benchmarks) == [
    "0.20: not in benchmarks.md#faults, which its link names"
  ]
  assert unsourced(f"cost 3.5 s {link}", benchmarks)  # in another section
  assert unsourced(f"cost 0.19 s\n\nthe link later {link}", benchmarks)  # another paragraph
  assert unsourced(f"cost 10.19 s {link}", benchmarks)  # a number is matched whole

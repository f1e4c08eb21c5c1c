"""The configs that ship with pwtrain, one file each: `--config=<name>` names one by its file's
name without `.py` (`--config=palm_tiny`), from an installed pwtrain as from the repository,
whose top-level `configs/` links here. Each file's `get_config(arg)` returns its config and its
docstring gives the command that runs it. pwtrain.config.resolve reads the names.
"""

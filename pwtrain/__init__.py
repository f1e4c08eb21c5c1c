"""pwtrain: a config-driven PaLM trainer on a Pathways-style single-controller backend."""

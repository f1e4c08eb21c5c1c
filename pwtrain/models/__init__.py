"""PaLM-style models. They name logical axes only; pwtrain.parallel maps them to meshes."""

from pwtrain.models.palm import PaLM, lm_loss

__all__ = ["PaLM", "lm_loss"]

"""A checkpoint written unrolled restores into a scanned model (`model.scan_layers=True`), and
the other way, under every optimizer (optim.OPTIMIZERS): checkpoints hold the layers unrolled,
and the conversion covers what each optimizer keeps per parameter (Adafactor's shared (1,)
placeholders beside its per-layer statistics; AdamW's moments; SGD's momentum trace)."""

import jax
import numpy as np
import pytest
from helpers import assert_close, random_batches, tiny_test_config

from pwtrain import optim, restore
from pwtrain.checkpoint import Checkpointer
from pwtrain.harness import Harness


def _step(harness, state, batch, step):
  """(loss, state after) of one step."""
  out = harness.step(state, batch, step)
  return out.metrics.result()["loss"], {k: v.result() for k, v in out.state.items()}


def _equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", optim.OPTIMIZERS)
def test_a_checkpoint_restores_scanned_or_unrolled_whichever_wrote_it(optimizer, tmp_path):
  """Step 1 unrolled, saved; restored scanned, the same state (bitwise, in the checkpoint's
  layout) and step 2 the unrolled run's; saved scanned, restored unrolled alike for step 3.
  The unrolled checkpoint is read back for a scanned model as sampling reads it too."""
  configs = {
    scan: tiny_test_config(**{"optim.name": optimizer, "model.scan_layers": scan})
    for scan in (False, True)
  }
  batches = random_batches(configs[False], 3)
  device = jax.devices()[:1]
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=3, every=1, async_save=False)
  with Harness.build(configs[False], device) as u, Harness.build(configs[True], device) as s:
    _, state = _step(u, u.init(), batches[0], 0)
    restored = _saved_and_restored(ckpt, 1, u, state, s)
    mesh = restore.reading_mesh(configs[True], device)  # as pwtrain.sample reads it
    assert restore.latest(configs[True], str(tmp_path), mesh)[0] == 1
    want, _ = _step(u, state, batches[1], 1)
    got, state = _step(s, restored, batches[1], 1)
    assert_close(got, want, "loss of step 2, scanned after an unrolled checkpoint")
    restored = _saved_and_restored(ckpt, 2, s, state, u)
    want, _ = _step(s, state, batches[2], 2)
    got, _ = _step(u, restored, batches[2], 2)
    assert_close(got, want, "loss of step 3, unrolled after a scanned checkpoint")
  ckpt.close()


def _saved_and_restored(ckpt, step, writer, state, reader):
  """`state` of `writer` saved as `step` and restored by `reader`: the same checkpoint state."""
  whole = writer.step_program.to_checkpoint(state)
  ckpt.save(step, whole, {"step": step})
  ckpt.wait()
  program = reader.step_program
  restored = program.from_checkpoint(ckpt.restore(step, program.abstract_state)[0])
  _equal(program.to_checkpoint(restored), whole)
  return restored

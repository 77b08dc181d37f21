"""--loss-chunks N in a training run against the plain loss (train/step.lm_loss, the reference): the chunked loss is
the fused linear + cross-entropy of models/fused_loss.py, whose loss, gradients and memory tests/train/
test_fused_loss.py checks op by op."""

from __future__ import annotations

from paratrain.config import TrainConfig
from paratrain.train.runtime import init_runtime
from paratrain.train.trainer import Trainer


def test_trainer_with_loss_chunks_matches_the_plain_loss():
    rt = init_runtime("cpu", 60.0)
    losses = {}
    for chunks in (1, 4):
        cfg = TrainConfig(model="gpt2-tiny", strategy="single", nproc=1, device="cpu", steps=3, seq_len=32,
                          global_batch=4, loss_chunks=chunks, metrics=False, resume="never")
        trainer = Trainer(cfg, rt, quiet=True)
        assert (trainer.step_runner.fused_loss is not None) == (chunks > 1)  # the model's head takes the loss
        losses[chunks] = [trainer.train_step(trainer.source.next_step())["loss"] for _ in range(3)]
    assert losses[1][0] != losses[1][-1]  # the optimizer stepped
    for a, b in zip(losses[1], losses[4]):
        assert abs(a - b) <= 1e-5 * abs(a)

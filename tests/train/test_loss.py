"""The chunked cross-entropy (--loss-chunks N) against the plain loss (train/step.lm_loss, the reference): equal
loss and gradients, and fp32 logits that never exist for every token x the whole vocabulary at once."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from paratrain.config import TrainConfig
from paratrain.train.runtime import init_runtime
from paratrain.train.step import chunked_lm_loss, lm_loss
from paratrain.train.trainer import Trainer

VOCAB = 1000


class LargestFp32(TorchDispatchMode):
    """The element count of the largest fp32 tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.numel = max(self.numel, t.numel())
        return out


def loss_grad_and_largest(loss_fn, logits: torch.Tensor, targets: torch.Tensor):
    logits = logits.detach().requires_grad_()
    with LargestFp32() as mode:
        loss = loss_fn(logits, targets)
        loss.backward()
    return loss.detach(), logits.grad, mode.numel


def test_chunked_loss_equals_plain_loss_and_never_holds_whole_fp32_logits():
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, VOCAB, (4, 32), generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(4, 32, VOCAB, generator=gen) * 3).to(dtype)
        ref_loss, ref_grad, ref_largest = loss_grad_and_largest(lm_loss, logits, targets)
        loss, grad, largest = loss_grad_and_largest(lambda a, b: chunked_lm_loss(a, b, chunks=8), logits, targets)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-7)
        if dtype == torch.bfloat16:
            # the plain loss makes an fp32 copy of all 128 x 1000 logits (the fault this guards against) ...
            assert ref_largest == 4 * 32 * VOCAB
            # ... the chunked one an fp32 copy of one chunk of 16 tokens at a time, forward and backward
            assert largest == 4 * 32 * VOCAB // 8


def test_trainer_with_loss_chunks_matches_the_plain_loss():
    rt = init_runtime("cpu", 60.0)
    losses = {}
    for chunks in (1, 4):
        cfg = TrainConfig(model="gpt2-tiny", strategy="single", nproc=1, device="cpu", steps=3, seq_len=32,
                          global_batch=4, loss_chunks=chunks, metrics=False, resume="never")
        trainer = Trainer(cfg, rt, quiet=True)
        losses[chunks] = [trainer.train_step(trainer.source.next_step())["loss"] for _ in range(3)]
    assert losses[1][0] != losses[1][-1]  # the optimizer stepped
    for a, b in zip(losses[1], losses[4]):
        assert abs(a - b) <= 1e-5 * abs(a)

"""--fused-loss (and --loss-chunks N, the same loss): the output head's linear and the cross-entropy fused over token
chunks (models/fused_loss.py), against the plain loss of the head's logits (train/step.lm_loss, the reference).

Tolerances: the loss 1e-6 relative; in fp32 each gradient 1e-6 of its largest element (the fused pass sums the
head weight's gradient over chunks and scales by the loss's grad_output after the GEMMs: fp32 rounding, measured
at 5e-7); under bf16 autocast each gradient within verify's FLOOR_MULTIPLE (4) of bf16's own noise floor, the
plain bf16 gradient against the fp32 one (the logits' gradient is rounded to bf16 before the loss weighting scales
it, where the plain backward rounds it after: measured up to 2.2 floors)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from groups import verified
from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.models.fused_loss import CHUNK_LOGITS_BYTES, loss_chunks_for
from paratrain.models.presets import build_model, get_preset
from paratrain.train.custom import CustomModel, check_custom_run
from paratrain.train.data.indexed_sets import Batch
from paratrain.train.evaluate import evaluate
from paratrain.train.loss_choice import FusedLoss
from paratrain.train.runtime import init_runtime
from paratrain.train.step import PlainStep, head_loss, lm_loss
from paratrain.train.trainer import Trainer
from paratrain.train.validate import validate_run
from paratrain.verify.compare import FLOOR_MULTIPLE

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("tiny", "gpt2-tiny")  # llama (its own head), gpt2 (the head tied to the token table)


def live_bytes_meter():
    """benchmarks/cp_memory.py's LiveBytes: the peak bytes of the storages ops create (the memory check's meter)."""
    spec = importlib.util.spec_from_file_location("cp_memory", ROOT / "benchmarks" / "cp_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LiveBytes()


def tokens_and_targets(vocab: int, rows: int = 4, seq: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose targets include -100 (a document boundary, padding) in two rows."""
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    targets = tokens[:, 1:].clone()
    targets[0, :7] = -100
    targets[rows - 1, seq // 2:] = -100
    return tokens[:, :-1], targets


def loss_and_grads(args, fused: bool, chunks: int | None, bf16: bool, meter=None):
    model = build_model(args, seed=1)
    inputs, targets = tokens_and_targets(args.vocab_size)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with meter or contextlib.nullcontext(), autocast:
        loss = model(inputs, targets=targets, loss_chunks=chunks) if fused else lm_loss(model(inputs), targets)
        (loss * 0.37).backward()  # a loss weighting's factor: the fused backward scales its stored gradients
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("preset", FAMILIES)
def test_fused_loss_and_every_gradient_equal_the_plain_loss(preset, chunks, bf16):
    args = get_preset(preset)
    ref_loss, ref_grads = loss_and_grads(args, False, None, bf16)
    loss, grads = loss_and_grads(args, True, chunks, bf16)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    fp32_grads = loss_and_grads(args, False, None, False)[1] if bf16 else None
    for name, g in grads.items():
        assert g is not None, name
        ref = ref_grads[name]
        # bf16: within verify's multiple of bf16's own noise floor (the plain bf16 gradient against the fp32 one)
        bound = FLOOR_MULTIPLE * float((ref - fp32_grads[name]).abs().max()) if bf16 else 1e-6 * float(ref.abs().max())
        torch.testing.assert_close(g, ref, rtol=0, atol=bound, msg=lambda m, name=name: f"{name}: {m}")


class LargestFp32(TorchDispatchMode):
    """The element count of the largest fp32 tensor any op writes."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.numel = max(self.numel, t.numel())
        return out


def saved_numels(args, fused: bool, chunks: int | None) -> list[int]:
    """The element counts of the tensors one forward saves for its backward."""
    model = build_model(args, seed=1)
    inputs, targets = tokens_and_targets(args.vocab_size)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs, targets=targets, loss_chunks=chunks) if fused else lm_loss(model(inputs), targets)
    return saved


@pytest.mark.parametrize("preset", FAMILIES)
def test_fused_loss_writes_one_chunk_of_fp32_logits_keeps_none_and_peaks_lower(preset):
    """A vocabulary large against the model (4096 x dim 64) so that the logits are what the step's memory is made
    of; 4 x 64 tokens. Reference: the plain loss's peak of live tensor bytes over forward + backward."""
    args = dataclasses.replace(get_preset(preset), vocab_size=4096)
    tokens = 4 * 64
    logits = tokens * args.vocab_size  # elements of the full logits
    for fused, chunks, largest in ((False, None, logits), (True, 2, logits // 2)):
        with LargestFp32() as mode:
            loss_and_grads(args, fused, chunks, bf16=True)
        assert mode.numel == largest, (fused, chunks)  # the plain loss's fp32 copy of every logit; one chunk's
    # no logits (nor log-probabilities) kept for the backward: the plain loss keeps its log-softmax's
    assert max(saved_numels(args, False, None)) == logits
    assert max(saved_numels(args, True, 2)) < logits // 2
    for bf16, chunk_counts in ((False, (1, 2)), (True, (2, 4))):
        meter = live_bytes_meter()
        loss_and_grads(args, False, None, bf16, meter)
        plain_peak = meter.peak
        for chunks in chunk_counts:
            meter = live_bytes_meter()
            loss_and_grads(args, True, chunks, bf16, meter)
            assert plain_peak - meter.peak >= logits * 4, (bf16, chunks, plain_peak, meter.peak)


def test_the_chunk_count_keeps_one_chunks_fp32_logits_under_the_budget():
    assert CHUNK_LOGITS_BYTES == 256 * 2**20
    assert loss_chunks_for(2 * 256, 50304) == 1  # gpt2-124m, micro-batch 2 x 256: 98 MiB of fp32 logits
    assert loss_chunks_for(16 * 1024, 50304) == 13  # micro-batch 16 x 1024: 3.1 GiB in 13 chunks
    for tokens, vocab in ((16 * 1024, 50304), (8 * 4096, 128256), (1, 8)):
        chunks = loss_chunks_for(tokens, vocab)
        assert -(-tokens // chunks) * vocab * 4 <= CHUNK_LOGITS_BYTES or chunks >= tokens
        assert chunks == 1 or -(-tokens // (chunks - 1)) * vocab * 4 > CHUNK_LOGITS_BYTES * 0.9


def document_micro_batches(vocab: int) -> list[Batch]:
    """Three micro-batches of document data: boundaries and padding as -100, one with no real target at all."""
    gen = torch.Generator().manual_seed(3)
    batches = []
    for rows_padded in ((0,), (1,), (0, 1)):
        tokens = torch.randint(0, vocab, (2, 33), generator=gen)
        targets = tokens[:, 1:].clone()
        targets[:, 10] = -100
        for row in rows_padded:
            targets[row, 20:] = -100
        if rows_padded == (0, 1):
            targets[:] = -100
        batches.append(Batch(tokens[:, :-1], targets))
    real = sum(int((b.targets != -100).sum()) for b in batches)
    return [dataclasses.replace(b, global_tokens=real) for b in batches]


@pytest.mark.parametrize("preset", FAMILIES)
def test_a_step_over_document_targets_weights_the_fused_loss_as_the_plain_one(preset):
    """The step runner's real-token weighting (parallel/loss_weighting.py): each micro-batch's term is its summed
    loss / the global batch's real targets, and a micro-batch with none adds a zero loss and zero gradients."""
    args = get_preset(preset)
    results = []
    for fused in (None, FusedLoss(2)):
        model = build_model(args, seed=1)
        runner = PlainStep(model, torch.device("cpu"), "fp32", False, loss_fn=head_loss if fused else lm_loss,
                           fused_loss=fused)
        total = runner.forward_backward(document_micro_batches(args.vocab_size))
        results.append((total, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (ref, ref_grads), (total, grads) = results
    torch.testing.assert_close(total, ref, rtol=1e-6, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-6 * float(ref_grads[name].abs().max()))


@pytest.mark.timeout(200)
def test_trainer_with_fused_loss_trains_and_validates_as_the_plain_loss(tmp_path):
    np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    rt = init_runtime("cpu", 60.0)
    results = {}
    for fused in (False, True):
        cfg = TrainConfig(model="gpt2-tiny", strategy="single", nproc=1, device="cpu", steps=3, seq_len=32,
                          global_batch=4, micro_batch=2, data=str(tmp_path / "t.bin"), val_fraction=0.1,
                          eval_every=3, fused_loss=fused, metrics=False, resume="never")
        trainer = Trainer(cfg, rt, quiet=True)
        assert (trainer.step_runner.fused_loss is not None) == fused
        losses = [trainer.train_step(trainer.source.next_step())["loss"] for _ in range(3)]
        results[fused] = losses, evaluate(trainer)
    (ref_losses, ref_val), (losses, val) = results[False], results[True]
    assert ref_losses[0] != ref_losses[-1]  # the optimizer stepped: the later losses test the gradients
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0)
    assert val == pytest.approx(ref_val, rel=1e-5, abs=0)


def run_config(**overrides) -> TrainConfig:
    return TrainConfig(**{"device": "cpu", "steps": 2, "global_batch": 4, "seq_len": 32, **overrides})


@pytest.mark.parametrize(("overrides", "words"), [
    ({"strategy": "tp", "nproc": 2}, "tensor parallelism (tp=2)"),
    ({"strategy": "pp", "nproc": 2, "microbatches": 2}, "pipeline parallelism (pp=2)"),
    ({"strategy": "single", "nproc": 1, "dtype": "fp16"}, "fp16"),
])
def test_where_the_fused_loss_cannot_run_it_is_refused_in_one_line(overrides, words):
    for flag, field in (("--fused-loss", {"fused_loss": True}), ("--loss-chunks 4", {"loss_chunks": 4})):
        cfg = run_config(**overrides, **field)
        with pytest.raises(UserError) as err:
            validate_run(cfg, cfg.nproc)
        message = str(err.value)
        assert "\n" not in message and flag in message and words in message, message
    validate_run(run_config(**overrides), run_config(**overrides).nproc)  # the same run without it passes


def test_hf_and_custom_models_are_refused_in_one_line(tmp_path, cli_inproc):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}))
    with pytest.raises(UserError, match=r"--fused-loss is not supported for --model hf: models"):
        validate_run(run_config(model=f"hf:{tmp_path}", strategy="single", fused_loss=True), 1)
    custom = CustomModel(lambda: torch.nn.Linear(4, 4), name="mine")
    with pytest.raises(UserError, match=r"--loss-chunks 2 takes the loss inside a paratrain model's output head"):
        check_custom_run(run_config(strategy="single", loss_chunks=2), 1, custom)
    res = cli_inproc("train", "--fused-loss", "--strategy", "tp", "--nproc", "2", "--steps", "2")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "--fused-loss" in res.stderr, res.stderr


@pytest.mark.timeout(500)
def test_fused_loss_passes_verify_on_two_ranks(two_ranks):
    # GPT-2's tied head under ZeRO-3: the loss is taken inside the head's FSDP unit, where its weight is whole
    report = verified(two_ranks, "speed-fused-loss-gpt2-zero3")
    assert report["passed"] is True, report
    assert report["world_size"] == 2

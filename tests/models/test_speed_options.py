"""The models' build-time speed options (models/speed.py ModelSpeed): --fused-qkv against the unfused model (the
reference), --bf16-residual against the fp32-residual model under the same bf16 autocast, and their refusals."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from groups import verified
from paratrain.errors import UserError
from paratrain.models.plans import tp_plan_for
from paratrain.models.presets import build_model, get_preset
from paratrain.models.speed import ModelSpeed, model_speed_for
from paratrain.parallel.pp.pipeline_split import StageSpec, carve_stage
from paratrain.parallel.tp.tp_technique import check_tp_speed
from paratrain.train.recovery.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
from paratrain.train.step import lm_loss
from paratrain.verify.compare import FLOOR_MULTIPLE

# gpt2-tiny: biases (a frozen key bias); tiny: grouped-query attention (2 kv heads for 4 heads)
FAMILIES = ("gpt2-tiny", "tiny")
FUSED, BF16_RESIDUAL = ModelSpeed(fused_qkv=True), ModelSpeed(bf16_residual=True)


def batch(vocab: int, seed: int, rows: int = 4, seq: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(tokens[:, :-1]), tokens[:, 1:])


class CountLinears(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is F.linear
        return func(*args, **(kwargs or {}))


def loss_grads_and_gemms(preset: str, speed: ModelSpeed):
    model = build_model(get_preset(preset), seed=1, speed=speed)
    with CountLinears() as count:
        loss = loss_of(model, batch(model.args.vocab_size, seed=0))
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, count.calls


@pytest.mark.parametrize("preset", FAMILIES)
def test_fused_qkv_is_one_gemm_with_the_same_parameters_loss_and_gradients(preset):
    """Reference: the unfused model (three projections). The forward's elements are the same dot products (the
    loss came out bit-identical here), but the input's gradient sums the q, k and v parts in one GEMM and the
    weights' gradients come from one GEMM, in another order: fp32 rounding, held to 1e-6 of each tensor's scale."""
    ref, ref_loss, ref_grads, ref_gemms = loss_grads_and_gemms(preset, ModelSpeed())
    fused, loss, grads, gemms = loss_grads_and_gemms(preset, FUSED)
    layers = ref.args.n_layers
    assert gemms == ref_gemms - 2 * layers  # q, k and v: one F.linear a block instead of three
    assert {k: (v.shape, v.dtype) for k, v in fused.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in ref.state_dict().items()}
    assert [(n, p.requires_grad) for n, p in fused.named_parameters()] == \
        [(n, p.requires_grad) for n, p in ref.named_parameters()]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-6 * float(ref_grads[name].abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("preset", FAMILIES)
def test_a_checkpoint_saved_without_fused_qkv_loads_with_it(preset, tmp_path):
    args = get_preset(preset)
    saved = build_model(args, seed=7)
    dcp.save({"model": saved.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    fused = build_model(args, seed=8, speed=FUSED)
    state = {"model": fused.state_dict()}
    dcp.load(state, storage_reader=SafeFileSystemReader(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    fused.load_state_dict(state["model"], strict=True)
    tokens = batch(args.vocab_size, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(loss_of(fused, tokens), loss_of(saved, tokens), rtol=1e-6, atol=0)


def block_dtypes(model, inputs: torch.Tensor) -> list[tuple[torch.dtype, torch.dtype]]:
    """(input, output) dtype of every block in one bf16-autocast forward, seen by forward hooks."""
    seen = []
    handles = [block.register_forward_hook(lambda _m, args, out: seen.append((args[0].dtype, out.dtype)))
               for block in model.layers.values()]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(inputs)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("preset", FAMILIES)
def test_bf16_residual_carries_the_stream_between_blocks_in_bf16(preset):
    args = get_preset(preset)
    tokens = batch(args.vocab_size, seed=0)[:, :-1]
    bf16, fp32 = torch.bfloat16, torch.float32
    assert block_dtypes(build_model(args, seed=1), tokens) == [(fp32, fp32)] * args.n_layers
    model = build_model(args, seed=1, speed=BF16_RESIDUAL)
    assert block_dtypes(model, tokens) == [(bf16, bf16)] * args.n_layers


@pytest.mark.parametrize("preset", FAMILIES)
def test_bf16_residual_runs_in_every_pipeline_stage(preset):
    """Reference: the whole model. Its stages (parallel/pp/pipeline_split.py) keep the option, carry bf16 inside
    and hand fp32 hidden states on (the message pipelining expects): an exact round trip, so the same logits."""
    model = build_model(get_preset(preset), seed=1, speed=BF16_RESIDUAL)
    first, last = (carve_stage(model, StageSpec(i, (str(i),), i == 0, i == 1, 1.0)) for i in (0, 1))
    tokens = batch(model.args.vocab_size, seed=0)[:, :-1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = first(tokens)
        assert hidden.dtype == torch.float32
        assert block_dtypes(last, hidden) == [(torch.bfloat16, torch.bfloat16)]
        assert torch.equal(last(hidden), model(tokens))


@pytest.mark.parametrize("preset", FAMILIES)
def test_bf16_residual_loss_is_within_verifys_bf16_bounds(preset):
    """verify's bf16 rule (verify/compare.py): at most FLOOR_MULTIPLE noise floors from the reference, the floor
    being bf16 autocast's own distance from fp32. Reference: the fp32-residual model under the same autocast.
    Averaged over 8 batches: one loss's floor can be near zero by chance (tiny-mha, one batch: 1.4e-6, where the
    bf16 stream moved the loss by 4e-5); over these 8 it measured 0.73x (gpt2-tiny) and 1.69x (tiny) the floor."""
    args = get_preset(preset)
    ref, fast = build_model(args, seed=1), build_model(args, seed=1, speed=BF16_RESIDUAL)
    floor, moved = [], []
    with torch.no_grad():
        for seed in range(8):
            tokens = batch(args.vocab_size, seed)
            exact = float(loss_of(ref, tokens))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast, streamed = float(loss_of(ref, tokens)), float(loss_of(fast, tokens))
            floor.append(abs(autocast - exact))
            moved.append(abs(streamed - autocast))
    assert statistics.mean(moved) <= FLOOR_MULTIPLE * statistics.mean(floor), (moved, floor)
    # the backward runs through the bf16 stream into every fp32 parameter
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_of(fast, batch(args.vocab_size, seed=9))
    loss.backward()
    for name, p in fast.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32 and bool(p.grad.isfinite().all()), name


def saved_activation_bytes(model, tokens: torch.Tensor) -> int:
    """Bytes of the tensors one bf16-autocast forward saves for its backward, each storage once, parameters not."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss_of(model, tokens)
    return sum(storages.values())


@pytest.mark.parametrize("preset", FAMILIES)
def test_bf16_residual_saves_half_the_bytes_of_every_norm_input(preset):
    """Each of the 2L+1 norms saves its input for the backward: the residual stream, 4 bytes an element in fp32
    and 2 in bf16. (More goes: a bf16 norm output is cast once where each of q, k, v cast the fp32 one.)"""
    args = get_preset(preset)
    rows, seq = 4, 64
    tokens = batch(args.vocab_size, seed=0, rows=rows, seq=seq)
    fp32_stream = saved_activation_bytes(build_model(args, seed=1), tokens)
    bf16_stream = saved_activation_bytes(build_model(args, seed=1, speed=BF16_RESIDUAL), tokens)
    assert fp32_stream - bf16_stream >= (2 * args.n_layers + 1) * rows * seq * args.dim * 2


@pytest.mark.parametrize("preset", FAMILIES)
def test_bf16_residual_changes_nothing_without_bf16_autocast(preset):
    """An fp32 run keeps the fp32 stream: loss and gradients bit-identical to the model built without the option."""
    args = get_preset(preset)
    tokens = batch(args.vocab_size, seed=0)
    results = []
    for speed in (ModelSpeed(), BF16_RESIDUAL):
        model = build_model(args, seed=1, speed=speed)
        loss = loss_of(model, tokens)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    (ref_loss, ref_grads), (loss, grads) = results
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_fused_qkv_with_tensor_parallel_is_refused_in_one_line():
    with pytest.raises(UserError) as err:
        check_tp_speed(ModelSpeed(fused_qkv=True), 2)
    message = str(err.value)
    assert "\n" not in message and "--fused-qkv" in message and "tp=2" in message
    check_tp_speed(ModelSpeed(fused_qkv=True), 1)
    check_tp_speed(ModelSpeed(bf16_residual=True), 2)
    # the run config's options, as train's validation reads them (a config without the fields: off)
    assert model_speed_for(SimpleNamespace(fused_qkv=True, bf16_residual=False)) == FUSED
    assert model_speed_for(SimpleNamespace()) == ModelSpeed()
    # and where the model is split: the family's TP plan refuses a model built fused, in the same words
    model = build_model(get_preset("tiny"), "meta", seed=None, speed=FUSED)
    with pytest.raises(UserError, match="--fused-qkv"):
        tp_plan_for(model, 2)
    assert tp_plan_for(build_model(get_preset("tiny"), "meta", seed=None), 2)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", ["speed-fused-qkv-zero3", "speed-gpt2-bf16-zero2"])
def test_speed_options_pass_verify_on_two_ranks(two_ranks, case):
    # --fused-qkv (fp32, llama, ZeRO-3) and both options under bf16 (gpt2, ZeRO-2) against one device
    report = verified(two_ranks, case)
    assert report["passed"] is True, report
    assert report["world_size"] == 2

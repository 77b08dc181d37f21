"""The fast path's CPU-runnable parts: activation checkpointing, torch.compile, bf16 autocast, memory snapshots,
and benchmarks/mfu.py's smoke mode. The GPU figures themselves are measured by benchmarks/mfu.py on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import REPO, cli_env
from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.models.presets import PRESETS, build_model
from paratrain.parallel.activation_checkpoint import ac_mode_of, apply_ac
from paratrain.parallel.compile import apply_compile, is_compiled
from paratrain.parallel.strategies import resolve_layout
from paratrain.train import memory_snapshot as ms
from paratrain.train.data.indexed_sets import BatchSource, SyntheticMarkov
from paratrain.train.optim import build_optimizer
from paratrain.train.runtime import Runtime
from paratrain.train.step import PlainStep, lm_loss
from paratrain.train.trainer import Trainer
from paratrain.verify.parity import clean_name

TINY = PRESETS["tiny"]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher (those SAC serves from its cache never do)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def grads_and_backward_ops(mode: str, tokens: torch.Tensor) -> tuple[dict, dict]:
    model = apply_ac(build_model(TINY, seed=0), mode)
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    counter = OpCounter()
    with counter:
        loss.backward()
    return {clean_name(n): p.grad for n, p in model.named_parameters()}, counter.counts


@pytest.mark.timeout(120)
def test_ac_matches_no_ac_and_recomputes_what_its_mode_says():
    """Reference: the same model without AC, fp32. Recomputation replays the same kernels: grads must agree
    to 1e-6 relative. Selective keeps matmul/SDPA outputs (no mm replayed, norms and SiLU are); full replays
    the block's matmuls too."""
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    ref, ref_ops = grads_and_backward_ops("none", tokens)
    for mode in ("selective", "full"):
        grads, ops = grads_and_backward_ops(mode, tokens)
        assert grads.keys() == ref.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[name], rtol=1e-6, atol=1e-8, msg=f"{mode}: {name}")
        assert ops.get("silu", 0) > 0, f"{mode} AC did not recompute the SiLU"
        if mode == "selective":
            assert ops.get("mm", 0) == ref_ops["mm"], "selective AC replayed a matmul"
            attention = [op for op in ops if "scaled_dot_product" in op and not op.endswith("_backward")]
            assert not attention, f"selective AC replayed attention: {attention}"
        else:
            assert ops["mm"] > ref_ops["mm"], "full AC did not replay the block's matmuls"


def test_ac_and_compile_wrap_every_block_and_keep_checkpoint_names():
    plain_names = sorted(build_model(TINY, seed=0).state_dict())
    selective = apply_compile(apply_ac(build_model(TINY, seed=0), "selective"))
    # selective: SAC inside the compiled region, where the compiler applies the policy
    assert all(is_compiled(b) and ac_mode_of(b._orig_mod) == "selective" for b in selective.layers.values())
    # full: the checkpoint stays outside and re-runs the compiled block (see parallel/compile.py)
    full = apply_compile(apply_ac(build_model(TINY, seed=0), "full"))
    assert all(ac_mode_of(b) == "full" and is_compiled(b) for b in full.layers.values())
    # DCP sees the plain model's names: checkpoints load across --ac / --compile settings
    assert sorted(get_model_state_dict(selective)) == plain_names == sorted(get_model_state_dict(full))
    with pytest.raises(UserError, match="activation checkpointing mode"):
        apply_ac(build_model(TINY, seed=0), "sometimes")


def run_steps(dtype: str, steps: int = 6) -> list[float]:
    model = build_model(TINY, seed=0)
    runner = PlainStep(model, torch.device("cpu"), dtype, use_autocast=dtype != "fp32")
    opt = build_optimizer(list(model.parameters()), 3e-3, (0.9, 0.95), 0.0, "cpu")
    source = BatchSource(SyntheticMarkov(TINY.vocab_size, 64, seed=0), 8, 0, 1, 8)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        losses.append(float(runner.forward_backward(source.next_step())))
        opt.step()
    return losses


def test_bf16_autocast_loss_close_to_fp32():
    """Reference: the fp32 run. bf16 autocast (fp32 master weights and loss) must stay within 1e-2 relative
    per step over 6 AdamW steps (measured: about 1e-4), and must differ at all (autocast really ran)."""
    fp32, bf16 = run_steps("fp32"), run_steps("bf16")
    rel = [abs(a - b) / a for a, b in zip(fp32, bf16)]
    assert max(rel) < 1e-2, rel
    assert max(rel) > 0, "bf16 gave bit-identical losses: autocast did not take effect"
    assert fp32[-1] < fp32[0] and bf16[-1] < bf16[0]


# `verify --ac full` under DDP (reference: one process, ac none) runs in tests/bench/test_verify.py's contract launch


@pytest.mark.timeout(420)
def test_verify_compiled_selective_ac_single(cli):
    """paratrain verify: reference = eager, no AC; strategy = one process with the whole model inductor-compiled
    (one device: embedding, blocks and head in one graph), the compiled loss and selective AC (fp32, verify's 1e-5
    tolerances). Cold compilation dominates the time."""
    res = cli("verify", "--strategy", "single", "--ac", "selective", "--compile", "--steps", "3", "--timeout-s", "120",
              "--json", timeout=400)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    assert doc["passed"], doc
    assert "applied selective activation checkpointing" in res.stderr
    assert "compiled the whole model with torch.compile" in res.stderr


# -- memory snapshots -------------------------------------------------------------------------------------------
@pytest.fixture
def fake_cuda_memory(monkeypatch):
    calls = []

    def record(enabled="all", **kwargs):
        calls.append(("record", enabled, kwargs))

    def dump(path):
        calls.append(("dump", path))
        with open(path, "wb") as f:
            f.write(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return calls


def test_memory_snapshot_records_then_dumps_once(tmp_path, fake_cuda_memory):
    snap = ms.MemorySnapshot.start(True, "cuda", tmp_path, rank=3)
    assert fake_cuda_memory == [("record", "all", {"max_entries": ms.MAX_ENTRIES})]
    path = snap.finish()
    assert path == tmp_path / "memory-snapshot-rank3.pickle" and path.read_bytes() == b"snapshot"
    assert fake_cuda_memory[-1] == ("record", None, {})
    assert snap.finish() is None  # idempotent
    with pytest.raises(UserError, match="--memory-snapshot records the CUDA"):
        ms.MemorySnapshot.start(True, "cpu", tmp_path, rank=0)


def one_process_trainer(**overrides) -> Trainer:
    cfg = TrainConfig(model="tiny", strategy="single", nproc=1, device="cpu", steps=2, metrics=False, **overrides)
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return Trainer(cfg, rt, quiet=True, layout=resolve_layout(cfg, 1))


def test_oom_dumps_a_snapshot_and_names_the_planner(tmp_path, fake_cuda_memory, monkeypatch):
    trainer = one_process_trainer(global_batch=8)
    # the allocator is CUDA's; pretend this rank has one so the dump path runs
    trainer.mem_snapshot = ms.MemorySnapshot(tmp_path, 0, "cuda", record=False)

    def out_of_memory(_micro):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(trainer, "train_step", out_of_memory)
    monkeypatch.setattr(trainer, "launch_step", out_of_memory)  # fit()'s step while its records are deferred
    with pytest.raises(UserError) as err:
        trainer.fit()
    msg = str(err.value)
    assert "\n" not in msg
    assert "CUDA out of memory on rank 0 in step 1" in msg
    assert f"{tmp_path / 'oom-snapshot-rank0.pickle'}" in msg and ms.VIEWER in msg
    assert "re-run with --memory-snapshot" in msg
    assert "paratrain plan --model tiny --gpu NAME --gpus 1 --seq-len 64 --global-batch 8 --dtype fp32" in msg
    assert "--ac full" in msg and "--micro-batch 4" in msg
    assert (tmp_path / "oom-snapshot-rank0.pickle").exists()


@pytest.mark.timeout(120)
def test_memory_snapshot_flag_on_cpu_is_one_clear_line(cli_inproc):
    res = cli_inproc("train", "--strategy", "single", "--device", "cpu", "--memory-snapshot", "--steps", "1")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert "--memory-snapshot records the CUDA caching allocator; this run is on cpu" in res.stderr


# -- benchmarks/mfu.py ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_mfu_benchmark_smoke_runs_and_refuses_without_gpu(tmp_path, monkeypatch, capsys):
    script = os.path.join(REPO, "benchmarks", "mfu.py")

    def run(*args):
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=150,
                              cwd=str(tmp_path), env=cli_env(), stdin=subprocess.DEVNULL)

    smoke = run("--smoke", "--json")
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    doc = json.loads(smoke.stdout)
    (row,) = doc["runs"]
    assert doc["smoke"] and row["paratrain"]["tokens_per_s"] > 0 and row["plain"]["tokens_per_s"] > 0
    assert row["ratio"] > 0 and row["paratrain"]["mfu"] is None  # no GPU peak is ever borrowed for a CPU
    if not torch.cuda.is_available():
        # a GPU benchmark on a machine without one: says so, measures nothing, exits 0 (its main(), in this process)
        monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
        import mfu

        capsys.readouterr()
        code = mfu.main(["--json"])
        skipped = capsys.readouterr()
        assert code == 0 and json.loads(skipped.out) == {"skipped": "no CUDA GPU", "runs": []}
        assert "no CUDA GPU" in skipped.err and "--smoke" in skipped.err


def test_mfu_benchmark_times_the_step_users_run(monkeypatch):
    # issue 47: mfu.py passed on_step to fit(), which reads each step's values on the host before the next launch,
    # so its paratrain figures timed the old synchronous step; it must call fit() as `paratrain train` does
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import mfu

    calls = []
    fit = Trainer.fit

    def spy(self, *args, **kwargs):
        calls.append((args, kwargs))
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "fit", spy)
    result = mfu.run_paratrain(mfu.parse_args(["--smoke"]), "cpu", 4, "fp32")
    assert calls == [((), {})]
    assert result["step_time_s"] > 0 and result["tokens_per_s"] > 0

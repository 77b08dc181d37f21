"""paratrain against its peers: a plain torchrun loop and Hugging Face Accelerate, on the same model, the same
initial weights, the same token windows and the same optimizer, on 2 CPU ranks (gloo).

    python benchmarks/peers.py                               # ddp and zero3, 3 rounds of 40 steps (a few minutes)
    python benchmarks/peers.py --steps 200 --rounds 7 --loss-every 1 --json

Per strategy it runs three programs:
    paratrain    `paratrain train --model hf:DIR` (its CLI, as a user runs it)
    torch        a plain torchrun loop: DistributedDataParallel, or fully_shard on each decoder layer then the root
    accelerate   torchrun + Accelerator(cpu=True) (DDP), or its FSDP2 plugin (fsdp_version=2); skipped in one line
                 when accelerate is not installed (`pip install accelerate`: only this benchmark uses it)
The model is a small Qwen2-style config made here with transformers' config classes, its weights drawn once
from a seed and saved as safetensors that every program loads. The windows are those paratrain's synthetic
data gives for the run's seed, drawn once here and saved; each peer rank reads its slice of every step's
global batch, as paratrain's BatchSource does. All three use AdamW (foreach) at a constant learning rate,
clipping at 1.0, cross-entropy on the logits, and report the loss averaged over the ranks.

It prints the loss agreement step by step (the largest |loss - paratrain's loss| and how many steps are
bit-identical) and the step-time ratio paratrain / peer: each run's median step time (its first 5 steps
left out), the ratio taken within each round, the median over rounds. The programs run interleaved, in a
rotated order each round, so drift in the machine's load hits them alike.

A note on `accelerate launch --cpu --num_processes 2`: `--cpu` always takes Accelerate's simple launcher, one
process whatever --num_processes says (only --mpirun_hostfile starts several CPU ranks, through mpirun), so
this benchmark starts its Accelerate script with torchrun, whose environment (WORLD_SIZE, RANK, MASTER_ADDR)
Accelerator(cpu=True) reads.
Accelerate's FSDP plugin is honoured only on accelerator devices: on CPU ranks the Accelerator keeps
MULTI_CPU (DDP), so the zero3 row applies Accelerate's FSDP2 preparation (fsdp2_prepare_model, the function
`accelerator.prepare` calls) to the model itself; that row says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
         "tie_word_embeddings": False, "use_sliding_window": False, "attention_dropout": 0.0}
RUN = {"seq_len": 128, "global_batch": 8, "lr": 1e-3, "seed": 0, "grad_clip": 1.0}
PEERS = ("paratrain", "torch", "accelerate")
STRATEGIES = ("ddp", "zero3")
SKIP_STEPS = 5  # warm-up: allocator, caches, the first collectives


# -- set-up (this process) ------------------------------------------------------------------------------------
def write_model(folder: Path) -> None:
    """config.json + model.safetensors: weights drawn once from the seed, loaded by every program."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(RUN["seed"])
    config = Qwen2Config(**{k: v for k, v in MODEL.items() if k != "model_type"})
    Qwen2ForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def run_config() -> dict:
    """The paratrain run config: constant learning rate (no warm-up, no decay), no weight decay."""
    return {**{k: v for k, v in RUN.items()}, "min_lr_ratio": 1.0, "warmup_steps": 0, "weight_decay": 0.0,
            "beta1": 0.9, "beta2": 0.95, "data": "synthetic", "val_fraction": 0.0}


def write_windows(path: Path, steps: int) -> None:
    """Every step's global batch of token windows (steps, global_batch, seq_len + 1), as paratrain draws them."""
    import numpy as np

    from paratrain.config import TrainConfig
    from paratrain.train.data.indexed_sets import make_dataset

    cfg = TrainConfig(**run_config())
    data = make_dataset(cfg.data, MODEL["vocab_size"], cfg.seq_len, cfg.seed, cfg.val_fraction)
    g = cfg.global_batch
    np.save(path, np.stack([data.samples(np.arange(s * g, (s + 1) * g, dtype=np.int64)) for s in range(steps)]))


def write_toml(path: Path) -> None:
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in run_config().items()))


# -- the programs -----------------------------------------------------------------------------------------------
def paratrain_cmd(work: Path, strategy: str, steps: int, out: Path) -> list[str]:
    exe = shutil.which("paratrain", path=str(Path(sys.executable).parent)) or "paratrain"
    return [exe, "train", "--config", str(work / "run.toml"), "--model", f"hf:{work / 'model'}", "--strategy",
            strategy, "--nproc", "2", "--device", "cpu", "--steps", str(steps), "--micro-batch",
            str(RUN["global_batch"] // 2), "--out", str(out), "--json"]


def peer_cmd(kind: str, work: Path, strategy: str, steps: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
            "--worker", kind, "--strategy", strategy, "--work", str(work), "--steps", str(steps), "--out", str(out)]


def read_paratrain(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [r["loss"] for r in rows], "step_times": [r["step_time_s"] for r in rows]}


def run_one(peer: str, work: Path, strategy: str, steps: int, index: int) -> dict:
    out = work / "runs" / f"{strategy}-{peer}-{index}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if peer == "paratrain":
        cmd = paratrain_cmd(work, strategy, steps, out)
    else:
        out.mkdir(parents=True)
        cmd = peer_cmd(peer, work, strategy, steps, out / "result.json")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    result = out / ("metrics.jsonl" if peer == "paratrain" else "result.json")
    if done.returncode != 0 and not result.exists():
        raise SystemExit(f"{peer} ({strategy}) failed:\n{done.stderr[-3000:]}")
    got = read_paratrain(out) if peer == "paratrain" else json.loads(result.read_text())
    if len(got["losses"]) != steps:
        raise SystemExit(f"{peer} ({strategy}) ran {len(got['losses'])} of {steps} steps:\n{done.stderr[-3000:]}")
    if done.returncode != 0:  # seen once in ~10 zero3 runs: gloo aborting a rank at teardown
        print(f"peers: {peer} ({strategy}) exited with {done.returncode} after all {steps} steps "
              f"(its results kept)", file=sys.stderr)
    return got


# -- a peer rank (under torchrun) -------------------------------------------------------------------------------
def peer_worker(kind: str, strategy: str, work: Path, steps: int, out: Path) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    accelerator = None
    if kind == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)  # reads torchrun's environment; sets up gloo
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    cfg = run_config()
    if kind == "accelerate" and strategy == "ddp":
        model, optimizer = accelerator.prepare(model, peer_optimizer(model.parameters()))
    elif strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = peer_optimizer(model.parameters())
    else:
        model = shard_model(model, accelerator)
        optimizer = peer_optimizer(model.parameters())
    params = list(model.parameters())
    windows = torch.from_numpy(np.load(work / "windows.npy")[:steps])
    local = windows.shape[1] // world
    losses, times = [], []
    for step in range(steps):
        # timed as paratrain times its steps: from taking the batch to the loss all-reduced (no barrier: a rank
        # that runs ahead waits for its peer inside the step, in paratrain's steps as here)
        t0 = time.perf_counter()
        rows = windows[step, rank * local:(rank + 1) * local]
        inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        losses.append(plain_step(model, optimizer, params, inputs, targets, cfg["grad_clip"], accelerator))
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.write_text(json.dumps({"losses": losses, "step_times": times}))
    dist.barrier()
    if accelerator is not None:
        accelerator.end_training()
    else:
        dist.destroy_process_group()


def peer_optimizer(params):
    """AdamW (foreach) as the run config sets it: paratrain's optimizer for this run."""
    import torch

    cfg = run_config()
    return torch.optim.AdamW(params, lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]),
                             weight_decay=cfg["weight_decay"], foreach=True)


def plain_step(model, optimizer, params, inputs, targets, grad_clip: float, accelerator=None) -> float:
    """One step of the peers' loop: forward, cross-entropy, backward, clip, AdamW; the loss averaged over the
    ranks (tests/parallel/dp_worker.py counts this step's collectives against paratrain's)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    accelerator.backward(loss) if accelerator is not None else loss.backward()
    clip_gradients(params, grad_clip)
    optimizer.step()
    reduced = loss.detach().clone()
    dist.all_reduce(reduced)
    return float(reduced / dist.get_world_size())


def shard_model(model, accelerator):
    """zero3: fully_shard each decoder layer, then the root. With an Accelerator, its own FSDP2 preparation
    (the FSDP2 plugin, transformer-layer wrapping, reshard after forward), applied directly because the
    Accelerator does not turn FSDP on for CPU ranks."""
    from torch.distributed.fsdp import fully_shard

    if accelerator is None:
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        transformer_cls_names_to_wrap=["Qwen2DecoderLayer"], cpu_ram_efficient_loading=False)
    return fsdp2_prepare_model(accelerator, model)


def clip_gradients(params, max_norm: float) -> None:
    """The global L2 norm over every gradient (a sharded one as the whole tensor), then clip to max_norm."""
    import torch

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)


# -- the report -------------------------------------------------------------------------------------------------
def summarize(results: dict, peers: list[str]) -> dict:
    """results[peer] = [one dict per round]: loss agreement against paratrain and step-time ratios."""
    ref = results["paratrain"][0]["losses"]
    out = {"steps": len(ref), "rounds": len(results["paratrain"]), "peers": {}}
    medians = {p: [statistics.median(r["step_times"][SKIP_STEPS:]) for r in results[p]] for p in peers}
    out["median_step_s"] = {p: statistics.median(m) for p, m in medians.items()}
    # paratrain's first round against every round of every program, paratrain's own later rounds included
    out["paratrain_rounds_identical"] = all(r["losses"] == ref for r in results["paratrain"])
    for peer in peers:
        if peer == "paratrain":
            continue
        diffs = [max(abs(a - r["losses"][i]) for r in results[peer]) for i, a in enumerate(ref)]
        ratios = [a / b for a, b in zip(medians["paratrain"], medians[peer])]
        out["peers"][peer] = {"max_loss_abs_diff": max(diffs), "identical_steps": sum(d == 0.0 for d in diffs),
                              "per_step_abs_diff": diffs, "step_time_ratio": statistics.median(ratios),
                              "ratio_per_round": ratios}
    return out


def format_losses(results: dict, every: int) -> list[str]:
    """The first round's loss of each program at every `every`-th step (and the last), with the largest
    difference from paratrain's at that step."""
    peers = list(results)
    runs = [results[p][0]["losses"] for p in peers]
    lines = ["  step  " + "".join(f"{p:>14}" for p in peers) + "   max |diff|"]
    steps = len(runs[0])
    for i in sorted({*range(0, steps, every), steps - 1}):
        diff = max(abs(r[i] - runs[0][i]) for r in runs[1:])
        lines.append(f"  {i + 1:>4}  " + "".join(f"{r[i]:>14.7f}" for r in runs) + f"   {diff:.3g}")
    return lines


def format_summary(strategy: str, s: dict, note: str, results: dict, every: int) -> str:
    lines = [f"{strategy}: {s['steps']} steps x {s['rounds']} rounds, 2 CPU ranks; median step "
             + ", ".join(f"{p} {v * 1e3:.1f} ms" for p, v in s["median_step_s"].items())]
    lines += format_losses(results, every)
    for peer, r in s["peers"].items():
        lines.append(f"  paratrain vs {peer:<10}: loss max |diff| {r['max_loss_abs_diff']:.3g} "
                     f"({r['identical_steps']}/{s['steps']} steps bit-identical); step time {r['step_time_ratio']:.2f}x "
                     f"(rounds: {', '.join(f'{x:.2f}' for x in r['ratio_per_round'])})")
    lines.append(f"  (losses compared over all {s['rounds']} rounds; paratrain's own rounds "
                 f"{'identical' if s['paratrain_rounds_identical'] else 'DIFFER'})")
    if note:
        lines.append(f"  {note}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--loss-every", type=int, default=10, help="print the losses every N steps (1: every step)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", choices=PEERS[1:], help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        peer_worker(a.worker, a.strategy, a.work, a.steps, a.out)
        return
    try:
        import accelerate
        peers = list(PEERS)
        versions = f"accelerate {accelerate.__version__}"
    except ImportError:
        peers = list(PEERS[:2])
        versions = "accelerate not installed: skipped (pip install accelerate)"
        print("peers: accelerate is not installed, so only paratrain and the plain torch loop run", file=sys.stderr)
    import torch
    import transformers

    work = Path(tempfile.mkdtemp(prefix="paratrain-peers-"))
    write_model(work / "model")
    write_windows(work / "windows.npy", a.steps)
    write_toml(work / "run.toml")
    load = os.getloadavg()
    report = {"torch": torch.__version__, "transformers": transformers.__version__, "peers_versions": versions,
              "model": MODEL, "run": run_config(), "load_before": load[0], "strategies": {}}
    print(f"peers: torch {torch.__version__}, transformers {transformers.__version__}, {versions}; "
          f"load average {load[0]:.2f}", file=sys.stderr)
    t_start = time.perf_counter()
    for strategy in a.strategies.split(","):
        results: dict[str, list[dict]] = {peer: [] for peer in peers}
        for r in range(a.rounds):
            order = peers[r % len(peers):] + peers[:r % len(peers)]  # rotated: no program always runs first
            for peer in order:
                results[peer].append(run_one(peer, work, strategy, a.steps, r))
        summary = summarize(results, peers)
        note = "accelerate zero3: Accelerate's FSDP2 preparation applied directly (its Accelerator keeps " \
               "DDP on CPU ranks)" if strategy == "zero3" and "accelerate" in peers else ""
        report["strategies"][strategy] = summary
        print(format_summary(strategy, summary, note, results, a.loss_every), file=sys.stderr)
    report["load_after"] = os.getloadavg()[0]
    report["wall_s"] = time.perf_counter() - t_start
    print(f"load average {report['load_before']:.2f} before, {report['load_after']:.2f} after; "
          f"{report['wall_s']:.0f} s", file=sys.stderr)
    if a.json:
        print(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

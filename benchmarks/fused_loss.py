"""--fused-loss against the plain loss in one CPU run: the memory it saves and its step time, side by side.

    python benchmarks/fused_loss.py                    # gpt2-124m, micro-batch 2 x seq 256, fp32 (minutes on 2 cores)
    python benchmarks/fused_loss.py --dtype bf16 --micro-batch 8 --rounds 5 --json

Memory: one forward + backward of the model (seed 0) on one batch, the plain loss of its logits (train/step.lm_loss)
against its head's fused loss (models/fused_loss.py; chunks: loss_chunks_for's count, or --loss-chunks): the peak
bytes of the tensors created (benchmarks/cp_memory.py's LiveBytes: activations, the loss's buffers, the
gradients) during the forward and over the whole forward + backward. The figure to compare with is the full
fp32 logits' size. Time: the head + loss alone (forward and backward on random hidden states: what the option
changes), and two trainers (train/trainer.py, strategy single, the same seed and batches), the plain one and one
with --fused-loss, whole training steps; each alternated plain, fused, plain, ... after one warm-up; the median
and the fastest of --head-rounds and of --rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from cp_memory import LiveBytes

MIB = 2**20


def peaks(args, fused: bool, chunks: int | None) -> dict:
    """{"forward", "step"}: peak live bytes during the forward, and over the forward + backward."""
    import torch

    from paratrain.models.presets import build_model, get_preset
    from paratrain.train.step import lm_loss

    model_args = get_preset(args.model)
    model = build_model(model_args, seed=0)
    tokens = torch.randint(0, model_args.vocab_size, (args.micro_batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with LiveBytes() as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = model(inputs, targets=targets, loss_chunks=chunks) if fused else lm_loss(model(inputs), targets)
        forward = meter.peak
        loss.backward()
    return {"forward": forward, "step": meter.peak}


def head_times(args, chunks: int, vocab: int, dim: int) -> dict[str, list[float]]:
    """Seconds of the output head + loss alone, forward and backward, on random hidden states: what the option
    changes, without the blocks' time (and its noise) around it. Alternated plain, fused, ...; one warm-up each."""
    import torch

    from paratrain.models.fused_loss import OutputHead
    from paratrain.train.step import lm_loss

    gen = torch.Generator().manual_seed(0)
    head = OutputHead(dim, vocab)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=gen) * 0.02)
    hidden = torch.randn(args.micro_batch, args.seq_len, dim, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen)
    times: dict[str, list[float]] = {"plain": [], "fused": []}
    for _ in range(args.head_rounds + 1):
        for name in times:
            head.weight.grad = hidden.grad = None
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                loss = head(hidden, targets, chunks) if name == "fused" else lm_loss(head(hidden), targets)
            loss.backward()
            times[name].append(time.perf_counter() - t0)
    return {name: t[1:] for name, t in times.items()}


def ratios(times: dict[str, list[float]]) -> dict[str, float]:
    """fused / plain of the medians and of the fastest rounds (on a busy machine the fastest is the cleaner)."""
    return {"median": statistics.median(times["fused"]) / statistics.median(times["plain"]),
            "fastest": min(times["fused"]) / min(times["plain"])}


def trainer(args, fused: bool):
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(model=args.model, strategy="single", nproc=1, device="cpu", steps=args.rounds + 1,
                      seq_len=args.seq_len, global_batch=args.micro_batch, micro_batch=args.micro_batch,
                      dtype=args.dtype, fused_loss=fused, loss_chunks=args.loss_chunks, metrics=False,
                      resume="never", seed=0)
    return Trainer(cfg, init_runtime("cpu", 600.0), quiet=True)


def timed_step(run) -> tuple[float, float]:
    batch = run.source.next_step()
    t0 = time.perf_counter()
    loss = run.train_step(batch)["loss"]
    return time.perf_counter() - t0, float(loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-124m")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--loss-chunks", type=int, default=1, help="N > 1: the fused loss in N chunks")
    parser.add_argument("--rounds", type=int, default=3, help="timed training steps of each")
    parser.add_argument("--head-rounds", type=int, default=15, help="timed head + loss passes of each")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from paratrain.models.fused_loss import loss_chunks_for
    from paratrain.models.presets import get_preset

    model_args = get_preset(args.model)
    vocab = model_args.vocab_size
    tokens = args.micro_batch * args.seq_len
    chunks = args.loss_chunks if args.loss_chunks > 1 else loss_chunks_for(tokens, vocab)
    memory = {"plain": peaks(args, False, None), "fused": peaks(args, True, chunks)}
    head = head_times(args, chunks, vocab, model_args.dim)

    runs = {"plain": trainer(args, False), "fused": trainer(args, True)}
    losses = {name: [timed_step(run)[1]] for name, run in runs.items()}  # warm-up: the optimizer's state appears
    times: dict[str, list[float]] = {"plain": [], "fused": []}
    for _ in range(args.rounds):
        for name, run in runs.items():
            seconds, loss = timed_step(run)
            times[name].append(seconds)
            losses[name].append(loss)
    logits = tokens * vocab * 4
    saved = {phase: memory["plain"][phase] - memory["fused"][phase] for phase in ("forward", "step")}
    doc = {"model": args.model, "micro_batch": args.micro_batch, "seq_len": args.seq_len, "dtype": args.dtype,
           "chunks": chunks, "fp32_logits_bytes": logits, "peak_bytes": memory, "saved_bytes": saved,
           "head_s": head, "head_ratio": ratios(head), "step_s": times, "step_ratio": ratios(times),
           "max_loss_rel_diff": max(abs(f - p) / abs(p) for p, f in zip(losses["plain"], losses["fused"]))}
    if args.json:
        print(json.dumps(doc))
        return
    print(f"{args.model}, micro-batch {args.micro_batch} x seq {args.seq_len}, {args.dtype}, vocab {vocab}, "
          f"fused in {chunks} chunk(s); full fp32 logits {logits / MIB:.1f} MiB")
    for phase in ("forward", "step"):
        print(f"peak bytes of the {phase:7s}: plain {memory['plain'][phase] / MIB:7.1f} MiB, fused "
              f"{memory['fused'][phase] / MIB:7.1f} MiB: saves {saved[phase] / MIB:7.1f} MiB "
              f"({saved[phase] / logits:.2f} x the fp32 logits)")
    for what, key, rounds in (("head + loss", "head", args.head_rounds), ("training step", "step", args.rounds)):
        seconds = {name: statistics.median(t) for name, t in doc[f"{key}_s"].items()}
        print(f"{what} time fused / plain: median {doc[f'{key}_ratio']['median']:.3f} ({seconds['fused']:.3f} s / "
              f"{seconds['plain']:.3f} s), fastest {doc[f'{key}_ratio']['fastest']:.3f}, over {rounds} rounds")
    print(f"training losses differ by at most {doc['max_loss_rel_diff']:.1e} (relative) over {args.rounds + 1} steps")


if __name__ == "__main__":
    main()

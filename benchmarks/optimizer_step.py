"""--optimizer-graph's folded clip and --bf16-param-copies on a GPT-2 124M-shaped model, side by side on CPU.

Optimizer step (the gradient norm, the clip and AdamW over every parameter), in alternating rounds:
  unfolded foreach   today's CPU step: clip_grads_with_norm_ multiplies every gradient, then foreach AdamW
  unfolded fused     the same clip pass, then the fused AdamW kernel
  folded fused       --optimizer-graph: no clip pass; the fused kernel divides by grad_scale = 1 / coefficient
Clipping is active in every round (max_norm below the gradients' norm). Also the bytes the bf16 copies hold, and a
bf16-autocast forward with and without them (their one saving: no fp32->bf16 cast of each weight per forward).

    python benchmarks/optimizer_step.py [--model gpt2-124m] [--rounds 7] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import statistics
import time


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def optimizer_steps(model, rounds: int) -> dict:
    import torch

    from paratrain.train.optim import build_optimizer
    from paratrain.train.optimizer_graph import OptimizerGraph
    from paratrain.train.step import clip_grad_norm

    variants = {}
    for name, fused in (("unfolded foreach", False), ("unfolded fused", True), ("folded fused", True)):
        params = [p.detach().clone().requires_grad_() for p in model.parameters()]
        gen = torch.Generator().manual_seed(0)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt = build_optimizer(params, 1e-4, (0.9, 0.95), 0.1, "cpu", optimizer_graph=fused)
        max_norm = 0.5 * float(clip_grad_norm(params, 0.0))  # clipping active every step
        if name == "folded fused":
            graph = OptimizerGraph([opt], max_norm, torch.device("cpu"))
            step = lambda params=params, graph=graph: graph.step(clip_grad_norm(params, 0.0))  # noqa: E731
        else:
            step = lambda params=params, opt=opt, max_norm=max_norm: (clip_grad_norm(params, max_norm), opt.step())  # noqa: E731
        step()  # creates the optimizer state
        variants[name] = step
    times = {name: [] for name in variants}
    for _ in range(rounds):  # alternating, so machine noise hits every variant alike
        for name, step in variants.items():
            times[name].append(timed(step))
    return {name: statistics.median(t) for name, t in times.items()}


def forward_times(args, seq_len: int, rounds: int) -> tuple[dict, int]:
    import torch

    from paratrain.models.presets import build_model
    from paratrain.train.param_copies import ParamCopies

    tokens = torch.randint(0, args.vocab_size, (1, seq_len))
    plain, copied = build_model(args, "cpu", seed=0), build_model(args, "cpu", seed=0)
    copies = ParamCopies([copied])
    times = {"forward, autocast casts": [], "forward, bf16 copies": []}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(rounds):
            times["forward, autocast casts"].append(timed(lambda: plain(tokens)))
            times["forward, bf16 copies"].append(timed(lambda: copied(tokens)))
    return {name: statistics.median(t) for name, t in times.items()}, copies.nbytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-124m")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seq-len", type=int, default=128)
    opts = parser.parse_args()
    import torch

    from paratrain.models.presets import build_model, get_preset

    args = get_preset(opts.model)
    model = build_model(args, "cpu", seed=0)
    params = sum(p.numel() for p in model.parameters())
    print(f"{opts.model}: {params / 1e6:.1f}M parameters, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {opts.rounds} rounds")
    steps = optimizer_steps(model, opts.rounds)
    base = steps["unfolded foreach"]
    for name, t in steps.items():
        print(f"  optimizer step, {name:17s} {t * 1e3:8.1f} ms  {t / base:5.2f}x")
    print(f"  folded / unfolded fused: {steps['folded fused'] / steps['unfolded fused']:.2f}x")
    forwards, copy_bytes = forward_times(args, opts.seq_len, opts.rounds)
    plain = forwards["forward, autocast casts"]
    for name, t in forwards.items():
        print(f"  {name} (1 x {opts.seq_len}) {t * 1e3:8.1f} ms  {t / plain:5.2f}x")
    print(f"  bf16 copies: {copy_bytes / 2**20:.1f} MiB ({copy_bytes / (4 * params):.1%} of the fp32 parameters' "
          f"{4 * params / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()

"""MFU of paratrain's single-GPU fast path, next to a plain hand-written PyTorch loop of the same model.

Both run in this one process on the same GPU, one after the other: paratrain's Trainer (gpt2-124m preset,
seq 1024, bf16 autocast, per-block torch.compile + compiled loss, fused AdamW, prefetched pinned batches)
and a nanoGPT-style loop (the same model, whole-model torch.compile of forward + loss, fused AdamW, batches
already on the GPU). MFU uses paratrain's FLOP convention (models/presets.flops_per_token) against the
catalog's dense peak for this GPU (plan/hardware.py); a GPU missing from the catalog gets no MFU, never a
borrowed peak.

    python benchmarks/mfu.py                 # the measurement (needs one CUDA GPU)
    python benchmarks/mfu.py --smoke         # tiny model on CPU: checks the script end to end, in seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch
import torch.nn.functional as F


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per step (no accumulation)")
    p.add_argument("--steps", type=int, default=50, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=10, help="unmeasured steps first (compilation happens here)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ac", default="none", choices=("none", "selective", "full"),
                   help="paratrain run only; the plain loop never checkpoints")
    p.add_argument("--skip-plain", action="store_true", help="measure paratrain only (no ratio)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the script: tiny model, seq 64, fp32, no compile unless --compile is given")
    args = p.parse_args(argv)
    if args.smoke:
        compile_given = any(a in ("--compile", "--no-compile") for a in (argv if argv is not None else sys.argv))
        args.model, args.seq_len, args.micro_batch, args.dtype = "tiny", 64, 4, "fp32"
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
        args.compile = args.compile if compile_given else False
    return args


def device_for(args) -> str:
    if args.smoke:
        return "cpu"
    if not torch.cuda.is_available():
        sys.stderr.write("error: benchmarks/mfu.py measures MFU on a CUDA GPU and this machine has none; run it on "
                         "a GPU machine, or add --smoke for a CPU check of the script\n")
        sys.exit(2)
    return "cuda"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_mem_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def flash_sdpa_check(model_args, seq_len: int, dtype: str, device: str) -> str:
    """Can the flash kernel run on this model's attention shapes? ("yes", or the reason it cannot)."""
    if device != "cuda":
        return "n/a (CPU)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    q = torch.randn(1, model_args.n_heads, seq_len, model_args.head_dim, device=device, dtype=torch_dtype)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as exc:
        return f"no ({str(exc).splitlines()[0][:160]})"
    return "yes"


# -- paratrain ----------------------------------------------------------------------------------------------
def run_paratrain(args, device: str) -> dict:
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer
    from paratrain.train.validate import validate_run

    cfg = TrainConfig(model=args.model, strategy="single", nproc=1, device=device, dtype=args.dtype,
                      compile=args.compile, ac=args.ac, seq_len=args.seq_len, global_batch=args.micro_batch,
                      steps=args.warmup + args.steps, warmup_steps=args.warmup, lr=3e-4, metrics=False,
                      resume="never", ckpt_every=0, timeout_s=600)
    validate_run(cfg, 1)
    rt = init_runtime(device, cfg.timeout_s)
    reset_memory(device)
    trainer = Trainer(cfg, rt, run_dir=None, quiet=True)
    times: list[float] = []
    summary = trainer.fit(on_step=lambda _trainer, record: times.append(record["step_time_s"]))
    measured = times[args.warmup:]
    step_time = sum(measured) / len(measured)
    result = {"step_time_s": step_time, "tokens_per_s": trainer.tokens_per_step / step_time,
              "peak_mem_gib": peak_mem_gib(device), "final_loss": summary["final_loss"],
              "flops_per_token": trainer.flops_per_step / trainer.tokens_per_step, "model_args": trainer.args}
    del trainer
    shutdown()
    reset_memory(device)
    return result


# -- the plain loop: what a user would write by hand --------------------------------------------------------
def run_plain(args, device: str, model_args) -> dict:
    from paratrain.models.presets import build_model

    model = build_model(model_args, "cpu", seed=0).to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=device == "cuda" or None, foreach=None if device == "cuda" else True)
    low = torch.bfloat16 if args.dtype == "bf16" else None

    def loss_of(x, y):
        with torch.autocast(device, dtype=low, enabled=low is not None):
            logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    loss_fn = torch.compile(loss_of) if args.compile else loss_of
    gen = torch.Generator().manual_seed(0)
    total = args.warmup + args.steps
    batches = torch.randint(model_args.vocab_size, (total, args.micro_batch, args.seq_len + 1), generator=gen)
    batches = batches.to(device)
    reset_memory(device)
    t0 = 0.0
    for i in range(total):
        if i == args.warmup:
            sync(device)
            t0 = time.perf_counter()
        x, y = batches[i, :, :-1], batches[i, :, 1:]
        loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    step_time = (time.perf_counter() - t0) / args.steps
    result = {"step_time_s": step_time, "tokens_per_s": args.micro_batch * args.seq_len / step_time,
              "peak_mem_gib": peak_mem_gib(device), "final_loss": float(loss.detach())}
    return result  # its tensors die with this frame; main() frees the cache after


def mfu_of(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12) if peak_tflops else None


def main(argv=None) -> int:
    args = parse_args(argv)
    device = device_for(args)
    from paratrain.gpu_catalog import catalog_name_for, device_peak_tflops

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = device_peak_tflops(device, "fp32" if args.dtype == "fp32" else "bf16")
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    log(f"device {name} (catalog: {catalog_name_for(name) if device == 'cuda' else 'none'}), torch {torch.__version__}")
    log(f"model {args.model}, seq {args.seq_len}, micro-batch {args.micro_batch}, {args.dtype}, "
        f"compile {'on' if args.compile else 'off'}, ac {args.ac}; {args.warmup} warm-up + {args.steps} measured steps")

    ours = run_paratrain(args, device)
    flops = ours.pop("flops_per_token")
    model_args = ours.pop("model_args")
    ours["mfu"] = mfu_of(ours["tokens_per_s"], flops, peak)
    plain = None if args.skip_plain else run_plain(args, device, model_args)
    reset_memory(device)
    if plain:
        plain["mfu"] = mfu_of(plain["tokens_per_s"], flops, peak)
    ratio = ours["tokens_per_s"] / plain["tokens_per_s"] if plain else None

    def show(label: str, r: dict) -> str:
        mfu = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else "MFU n/a"
        mem = f", peak {r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else ""
        return (f"{label:<10} {r['tokens_per_s']:>12,.0f} tokens/s  {r['step_time_s'] * 1e3:8.1f} ms/step  {mfu}"
                f"{mem}  loss {r['final_loss']:.3f}")

    log(show("paratrain", ours))
    if plain:
        log(show("plain", plain))
        log(f"ratio paratrain / plain loop: {ratio:.3f}")
    if peak is None:
        log("MFU n/a: " + ("no GPU peak applies on CPU" if device == "cpu"
                           else f"{name} is not in paratrain.plan.hardware.CATALOG (no peak is borrowed)"))
    else:
        log(f"peak {peak:g} TFLOP/s ({args.dtype}, dense, catalog); {flops / 1e6:.1f} MFLOP per token")
    sdpa = flash_sdpa_check(model_args, args.seq_len, args.dtype, device)
    log(f"flash SDPA on these attention shapes: {sdpa}")
    if args.json:
        doc = {"device": name, "torch": torch.__version__, "model": args.model, "seq_len": args.seq_len,
               "micro_batch": args.micro_batch, "dtype": args.dtype, "compile": args.compile, "ac": args.ac,
               "warmup": args.warmup, "steps": args.steps, "peak_tflops": peak, "flops_per_token": flops,
               "paratrain": ours, "plain": plain, "ratio": ratio, "flash_sdpa": sdpa, "smoke": args.smoke}
        print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MFU of paratrain's single-GPU step next to the best plain PyTorch loop for the same model, side by side.

For each micro-batch (default 16 and 32) and precision (default bf16 and fp8) it runs, in this one process on
the same GPU, one after the other:
1. paratrain's Trainer (--strategy single: gpt2-124m, seq 1024, whole-model torch.compile + compiled loss, fused
   AdamW, prefetched pinned batches; --cuda-graphs and --loss-chunks optional);
2. a plain loop written for speed: the same model and init (fp8: the same torchao float8 conversion), forward and
   loss compiled together, fused AdamW, the flash SDPA kernel forced, batches already on the GPU, one sync at the end.
and prints tokens/s, ms/step, MFU, peak memory and the ratio paratrain / plain. MFU uses paratrain's FLOP
convention (models/presets.flops_per_token) against the catalog's dense peak of the precision that runs; a GPU
(or a precision) missing from the catalog gets no MFU, never a borrowed peak.

    python benchmarks/mfu.py                 # the measurement (needs one CUDA GPU; on a CPU it says so, exit 0)
    python benchmarks/mfu.py --smoke         # tiny model on CPU: checks the script end to end, in seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batches", default="16,32", help="comma-separated sequences per step (no accumulation)")
    p.add_argument("--dtypes", default="bf16,fp8", help="comma-separated: bf16, fp8, fp32")
    p.add_argument("--steps", type=int, default=50, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=10, help="unmeasured steps first (compilation happens here)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cuda-graphs", action="store_true", help="paratrain run with --cuda-graphs")
    p.add_argument("--loss-chunks", type=int, default=1, help="paratrain run with --loss-chunks N")
    p.add_argument("--ac", default="none", choices=("none", "selective", "full"),
                   help="paratrain run only; the plain loop never checkpoints")
    p.add_argument("--skip-plain", action="store_true", help="measure paratrain only (no ratio)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the script: tiny model, seq 64, fp32, no compile unless --compile is given")
    args = p.parse_args(argv)
    args.micro_batches = [int(x) for x in args.micro_batches.split(",") if x]
    args.dtypes = [x for x in args.dtypes.split(",") if x]
    if args.smoke:
        compile_given = any(a in ("--compile", "--no-compile") for a in (argv if argv is not None else sys.argv))
        args.model, args.seq_len, args.micro_batches, args.dtypes = "tiny", 64, [4], ["fp32"]
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
        args.compile = args.compile if compile_given else False
    return args


def device_for(args) -> str | None:
    """"cuda", "cpu" for --smoke, or None: no GPU, nothing to measure (said on stderr; the script exits 0)."""
    if args.smoke:
        return "cpu"
    if not torch.cuda.is_available():
        sys.stderr.write("benchmarks/mfu.py: no CUDA GPU on this machine, so nothing is measured; run it on a GPU "
                         "machine, or add --smoke for a CPU check of the script\n")
        return None
    return "cuda"


def fp8_refusal(device: str) -> str | None:
    """Why fp8 cannot run here (paratrain's own check), or None."""
    from paratrain.errors import UserError
    from paratrain.parallel.layout import Layout
    from paratrain.train.precision import check_fp8

    try:
        check_fp8(Layout(), device)
    except UserError as exc:
        return str(exc)
    return None


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
def step_times(metrics: Path) -> list[float]:
    """Each step's seconds, in step order, from a run's metrics.jsonl."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = sorted((r["step"], r["step_time_s"]) for r in records if "step_time_s" in r and "event" not in r)
    return [seconds for _step, seconds in steps]


def run_paratrain(args, device: str, micro_batch: int, dtype: str) -> dict:
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer
    from paratrain.train.validate import validate_run

    cfg = TrainConfig(model=args.model, strategy="single", nproc=1, device=device, dtype=dtype,
                      compile=args.compile, cuda_graphs=args.cuda_graphs, loss_chunks=args.loss_chunks, ac=args.ac,
                      seq_len=args.seq_len, global_batch=micro_batch, steps=args.warmup + args.steps,
                      warmup_steps=args.warmup, lr=3e-4, metrics=True, resume="never", ckpt_every=0, timeout_s=600)
    validate_run(cfg, 1)
    rt = init_runtime(device, cfg.timeout_s)
    reset_memory(device)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, rt, run_dir=Path(run_dir), quiet=True)
        # the step users run: no on_step callback, which would make fit() read each step's loss on the host
        # before launching the next (train/step_record.py); the per-step times come from metrics.jsonl, written
        # from CUDA events that tile the stream's timeline
        summary = trainer.fit()
        times = step_times(Path(run_dir) / "metrics.jsonl")
    measured = times[args.warmup:]
    step_time = sum(measured) / len(measured)
    result = {"step_time_s": step_time, "tokens_per_s": trainer.tokens_per_step / step_time,
              "peak_mem_gib": peak_mem_gib(device), "final_loss": summary["final_loss"],
              "peak_tflops": trainer.peak_tflops, "flops_per_token": trainer.flops_per_step / trainer.tokens_per_step,
              "model_args": trainer.args}
    del trainer
    shutdown()
    reset_memory(device)
    return result


# -- the plain loop: the fastest single-GPU loop we can write by hand ---------------------------------------------
def run_plain(args, device: str, model_args, micro_batch: int, dtype: str) -> dict:
    from paratrain.models.presets import build_model
    from paratrain.models.speed import model_speed_for
    from paratrain.parallel.compile import fuse_gemm_epilogues

    # the speed options that change the model's code, as the paired paratrain row builds and compiles it
    model = build_model(model_args, "cpu", seed=0, speed=model_speed_for(args)).to(device)
    if getattr(args, "fused_bias_gelu", False) and args.compile:
        fuse_gemm_epilogues(device)
    if dtype == "fp8":
        from paratrain.train.float8 import convert_to_float8

        model = convert_to_float8(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=device == "cuda" or None, foreach=None if device == "cuda" else True)
    low = {"bf16": torch.bfloat16, "fp8": torch.bfloat16}.get(dtype)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 runs as TF32, as paratrain's does

    def loss_of(x, y):
        with torch.autocast(device, dtype=low, enabled=low is not None):
            logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    # forward and loss in one compiled graph
    loss_fn = torch.compile(loss_of) if args.compile else loss_of
    gen = torch.Generator().manual_seed(0)
    total = args.warmup + args.steps
    batches = torch.randint(model_args.vocab_size, (total, micro_batch, args.seq_len + 1), generator=gen)
    batches = batches.to(device)
    reset_memory(device)
    t0 = 0.0
    with flash_attention_only(device, dtype):
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
    result = {"step_time_s": step_time, "tokens_per_s": micro_batch * args.seq_len / step_time,
              "peak_mem_gib": peak_mem_gib(device), "final_loss": float(loss.detach())}
    return result  # its tensors die with this frame; main() frees the cache after


def flash_attention_only(device: str, dtype: str):
    """The plain loop forces the flash SDPA kernel on CUDA in bf16/fp8 (error rather than a silent fallback)."""
    import contextlib

    if device != "cuda" or dtype == "fp32":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def mfu_of(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12) if peak_tflops else None


def show(label: str, r: dict) -> str:
    mfu = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else "MFU unknown"
    mem = f", peak {r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else ""
    return (f"  {label:<10} {r['tokens_per_s']:>12,.0f} tokens/s  {r['step_time_s'] * 1e3:8.1f} ms/step  {mfu}"
            f"{mem}  loss {r['final_loss']:.3f}")


def measure(args, device: str, micro_batch: int, dtype: str, log) -> dict:
    """One (micro-batch, precision) row: paratrain, the plain loop, the ratio."""
    row = {"micro_batch": micro_batch, "dtype": dtype}
    refusal = fp8_refusal(device) if dtype == "fp8" else None
    if refusal:
        log(f"micro-batch {micro_batch}, {dtype}: not measured: {refusal}")
        return {**row, "skipped": refusal}
    ours = run_paratrain(args, device, micro_batch, dtype)
    flops, peak = ours.pop("flops_per_token"), ours.pop("peak_tflops")
    model_args = ours.pop("model_args")
    ours["mfu"] = mfu_of(ours["tokens_per_s"], flops, peak)
    plain = None if args.skip_plain else run_plain(args, device, model_args, micro_batch, dtype)
    reset_memory(device)
    if plain:
        plain["mfu"] = mfu_of(plain["tokens_per_s"], flops, peak)
    ratio = ours["tokens_per_s"] / plain["tokens_per_s"] if plain else None
    log(f"micro-batch {micro_batch}, {dtype} (peak {f'{peak:g} TFLOP/s' if peak else 'unknown'}, "
        f"{flops / 1e6:.1f} MFLOP per token):")
    log(show("paratrain", ours))
    if plain:
        log(show("plain", plain))
        log(f"  ratio paratrain / plain loop: {ratio:.3f}")
    return {**row, "peak_tflops": peak, "flops_per_token": flops, "paratrain": ours, "plain": plain, "ratio": ratio,
            "flash_sdpa": flash_sdpa_check(model_args, args.seq_len, dtype, device)}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = device_for(args)
    if device is None:
        if args.json:
            print(json.dumps({"skipped": "no CUDA GPU", "runs": []}))
        return 0
    from paratrain.gpu_catalog import catalog_name_for

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    log(f"device {name} (catalog: {catalog_name_for(name) if device == 'cuda' else 'none'}), torch {torch.__version__}")
    log(f"model {args.model}, seq {args.seq_len}, compile {'on' if args.compile else 'off'}, cuda graphs "
        f"{'on' if args.cuda_graphs else 'off'}, loss chunks {args.loss_chunks}, ac {args.ac}; {args.warmup} warm-up "
        f"+ {args.steps} measured steps per run")
    runs = [measure(args, device, mb, dtype, log) for mb in args.micro_batches for dtype in args.dtypes]
    if device == "cuda" and catalog_name_for(name) is None:
        log(f"MFU unknown: {name} is not in paratrain.gpu_catalog.CATALOG (no peak is borrowed)")
    if args.json:
        doc = {"device": name, "torch": torch.__version__, "model": args.model, "seq_len": args.seq_len,
               "compile": args.compile, "cuda_graphs": args.cuda_graphs, "loss_chunks": args.loss_chunks,
               "ac": args.ac, "warmup": args.warmup, "steps": args.steps, "runs": runs, "smoke": args.smoke}
        print(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One plain-loop row of benchmarks/gpu_suite.py, as its own process: benchmarks/mfu.py's hand-written loop for
one (model, precision, micro-batch, compile) on one device. Prints one JSON document on stdout:
{"step_time_s", "tokens_per_s", "peak_mem_gib", "final_loss", "mfu", "flops_per_token", "peak_tflops"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if (HERE.parent / "src" / "paratrain").is_dir():
    sys.path.insert(0, str(HERE.parent / "src"))  # this tree's paratrain, also where it is not pip-installed

import mfu  # noqa: E402 - benchmarks/ is not a package


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--config", help="TOML with shape overrides (dim, n_layers, ffn_dim)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=30, help="measured steps")
    # the model-code speed options (gpu_suite_rows.MODEL_CODE_FLAGS): the same model the paired train row builds
    for flag in ("--bf16-residual", "--fused-qkv", "--fused-bias-gelu"):
        p.add_argument(flag, action="store_true", help=f"as paratrain train {flag}")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from paratrain.config import load_config
    from paratrain.gpu_catalog import device_peak_tflops
    from paratrain.models.presets import flops_per_token, model_args_for
    from paratrain.train.precision import peak_dtype

    cfg = load_config(args.config, {"model": args.model, "seq_len": args.seq_len})
    model_args = model_args_for(cfg)
    result = mfu.run_plain(args, args.device, model_args, args.micro_batch, args.dtype)
    flops = flops_per_token(model_args, args.seq_len)
    peak = device_peak_tflops(args.device, peak_dtype(args.dtype, True))  # the plain loop runs fp32 as TF32
    result.update(mfu=mfu.mfu_of(result["tokens_per_s"], flops, peak), flops_per_token=flops, peak_tflops=peak)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

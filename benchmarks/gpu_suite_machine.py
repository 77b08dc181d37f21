"""What this machine can run, read once by benchmarks/gpu_suite.py, and the one-line reason a row cannot."""

from __future__ import annotations

import importlib.util

from gpu_suite_rows import Row
from paratrain.cli_options import flag_of


def probe_machine(dry_run: bool) -> dict:
    import torch

    import paratrain
    from paratrain.cli_options import run_options

    m = {"device": "cpu", "name": "cpu", "capability": None, "mem_gib": None, "torch": torch.__version__,
         "torchao": None, "torchao_error": None, "triton": None, "paratrain": paratrain.__version__,
         "cuda_graph_trees": hasattr(torch.compiler, "cudagraph_mark_step_begin"), "fp8_refusal": None,
         "train_options": set(run_options()), "peak_tflops": None}
    if importlib.util.find_spec("triton") is not None:
        import triton

        m["triton"] = triton.__version__
    if importlib.util.find_spec("torchao") is not None:
        try:
            import torchao
            import torchao.float8  # noqa: F401 - an older torch fails here, not at find_spec

            m["torchao"] = getattr(torchao, "__version__", "unknown")
        except Exception as exc:  # noqa: BLE001 - any import failure is one skip line, not a crash
            m["torchao_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    if not dry_run and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        m.update(device="cuda", name=props.name, capability=f"{props.major}.{props.minor}",
                 mem_gib=props.total_memory / 2**30)
        from paratrain.gpu_catalog import device_peak_tflops

        # the catalog peaks the runs' MFU divides by: an fp8 row's MFU is also read against the bf16 one
        m["peak_tflops"] = {dtype: device_peak_tflops("cuda", dtype) for dtype in ("bf16", "fp8")}
        from mfu import fp8_refusal  # paratrain's own check: capability, torchao

        m["fp8_refusal"] = fp8_refusal("cuda")
    return m


def skip_reason(row: Row, m: dict, dry_run: bool) -> str | None:
    """None when the row can run here, else why not, in one line."""
    missing = [flag_of(f) for f in row.flags if f not in m["train_options"]]
    if missing:
        return f"this paratrain's train has no {', '.join(missing)} (paratrain train --help)"
    needs = row.needs()
    if m["device"] != "cuda":
        if not dry_run:
            return "no CUDA GPU on this machine (benchmarks/gpu_suite.py --dry-run checks the suite on CPU)"
        return "needs CUDA (a --dry-run runs on CPU)" if {"fp8", "cuda_graphs"} & set(needs) else None
    if "cuda_graphs" in needs and not m["cuda_graph_trees"]:
        return f"torch {m['torch']} too old: no torch.compiler.cudagraph_mark_step_begin (CUDA graph trees)"
    if "compile" in needs and m["device"] == "cuda" and not m["triton"]:
        return "no triton: torch.compile cannot build GPU kernels here"
    if "fp8" in needs:
        if m["torchao_error"]:
            return f"torchao does not import with torch {m['torch']} ({m['torchao_error']})"
        if m["fp8_refusal"]:
            return m["fp8_refusal"]
    return None

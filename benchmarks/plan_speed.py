"""Seconds per `paratrain plan`, for model shapes from 125M to 1T parameters on clusters up to 4,096 GPUs.

    python benchmarks/plan_speed.py [--shapes 125m,8b,...] [--json]

Each plan runs as a user runs it (`python -m paratrain.cli plan ... --json`, a fresh process, imports included),
twice: cold (an empty trace cache) and warm (the cache the cold run filled), and then the full search
(`--search full`: every layout refined, no pruning), warm; the cold run's traces are counted by kind (the files
it wrote to the empty cache). The machine's load average is printed with the figures: on a shared 2-core
machine it moves the wall-clock seconds; the CPU seconds of the plan process are printed beside them.
Targets: a plan <= 5 s, a full search <= 30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (name, hf config, GPU, GPUs, seq, global batch)
SHAPES = {
    "125m": ({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50304,
              "n_positions": 2048, "tie_word_embeddings": False}, "a100-80", 8, 2048, 64),
    "8b": ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 8192}, "h100-sxm", 64, 8192, 256),
    "70b": ({"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192}, "h100-sxm", 512, 8192, 512),
    "175b": ({"model_type": "gpt2", "n_layer": 96, "n_embd": 12288, "n_head": 96, "vocab_size": 51200,
              "n_positions": 2048, "tie_word_embeddings": False}, "a100-80", 1024, 2048, 1536),
    "530b": ({"model_type": "gpt2", "n_layer": 105, "n_embd": 20480, "n_head": 128, "vocab_size": 51200,
              "n_positions": 2048, "tie_word_embeddings": False}, "a100-80", 2240, 2048, 1920),
    "1t": ({"model_type": "gpt2", "n_layer": 128, "n_embd": 25600, "n_head": 160, "vocab_size": 51200,
            "n_positions": 2048, "tie_word_embeddings": False}, "a100-80", 4096, 2048, 4096),
}


def run_plan(config: Path, gpu: str, gpus: int, seq: int, batch: int, cache: str,
             extra: list[str]) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of the plan process, its JSON document)."""
    env = {**os.environ, "PARATRAIN_CACHE": cache, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "paratrain.cli", "plan", "--hf-config", str(config), "--gpu", gpu, "--gpus",
           str(gpus), "--seq-len", str(seq), "--global-batch", str(batch), "--json", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if res.returncode != 0:
        raise RuntimeError(f"plan failed ({res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
    return seconds, cpu, json.loads(res.stdout)


def traces_written(cache: str) -> dict[str, int]:
    """What the cold plan traced (or built), by kind: the files it wrote to its empty trace cache
    (trace_cache.py names each `KIND-DIGEST.json`)."""
    out: dict[str, int] = {}
    for f in sorted((Path(cache) / "traces").glob("*.json")):
        kind = f.name.rsplit("-", 1)[0]
        out[kind] = out.get(kind, 0) + 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--no-full", action="store_true", help="skip the full-search runs")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    rows = []
    out = sys.stderr if opts.json else sys.stdout
    out.write(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")
    out.write(f"{'shape':<6} {'params':>9} {'gpu':<9} {'GPUs':>5} {'cold s':>7} {'(cpu)':>6} {'warm s':>7} {'(cpu)':>6} "
              f"{'full s':>7} {'(cpu)':>6} {'layouts':>8}  best\n")
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.shapes.split(","):
            hf, gpu, gpus, seq, batch = SHAPES[name]
            config = Path(tmp) / f"{name}.json"
            config.write_text(json.dumps({"_name_or_path": f"plan-speed-{name}", **hf}))
            cache = str(Path(tmp) / f"cache-{name}")
            cold, cold_cpu, doc = run_plan(config, gpu, gpus, seq, batch, cache, [])
            traced = traces_written(cache)
            warm, warm_cpu, doc = run_plan(config, gpu, gpus, seq, batch, cache, [])
            full = full_cpu = None
            if not opts.no_full:
                full, full_cpu, _ = run_plan(config, gpu, gpus, seq, batch, cache, ["--search", "full"])
            best = doc["candidates"][0] if doc["candidates"] else None
            label = (" ".join(f"{k}={v}" for k, v in best["dims"].items() if v > 1) + f" ac={best['activation_checkpointing']}"
                     if best else "-")
            row = {"shape": name, "params": doc["model"]["params"], "gpu": gpu, "gpus": gpus, "cold_s": cold,
                   "cold_cpu_s": cold_cpu, "warm_s": warm, "warm_cpu_s": warm_cpu, "full_search_s": full,
                   "full_search_cpu_s": full_cpu, "layouts_examined": doc["layouts_examined"],
                   "fits": doc["fits"], "best": label, "cold_traces": traced}
            rows.append(row)
            nan = float("nan")
            out.write(f"{name:<6} {row['params'] / 1e9:>8.2f}B {gpu:<9} {gpus:>5} {cold:>7.2f} {cold_cpu:>6.2f} "
                      f"{warm:>7.2f} {warm_cpu:>6.2f} {full if full is not None else nan:>7.2f} "
                      f"{full_cpu if full_cpu is not None else nan:>6.2f} {row['layouts_examined']:>8}  {label}\n"
                      f"       cold plan traced: {', '.join(f'{n} {k}' for k, n in traced.items())}\n")
            out.flush()
    out.write(f"load average at end: {os.getloadavg()[0]:.2f}\n")
    if opts.json:
        print(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Document loader throughput against the step's consumption: JSON Lines tokenized on the fly, packed, `tiny`
at seq 256 on 2 CPU ranks (ddp), a fast step so the loader has to keep up.

Measured side by side in one run:
- the loader alone: global tokens/s of the document stream (read through `datasets`, tokenized, packed), in one
  process, as each rank's worker runs it (every rank reads the global stream and keeps its rows);
- a real `paratrain train` run reading the same file: the tokens/s the step consumes, and the data wait as a
  fraction of the step time (from metrics.jsonl, step 1 left out: it waits for the worker's start).

    python benchmarks/data_throughput.py            # about a minute on 2 cores
    python benchmarks/data_throughput.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the of and to in is was for on that with as by at from his her an which were are this be had not "
         "but they have one their all or been has its who also more when first other after into two time "
         "after over new some these would only many may such then most people city years work later could "
         "water river north school world during music state system between government house known high").split()


def write_corpus(root: Path, documents: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path = root / "corpus.jsonl"
    with open(path, "w") as f:
        for _ in range(documents):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400)))
            f.write(json.dumps({"text": text}) + "\n")
    (root / "tok.txt").write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(200)))
    return path


def loader_tokens_per_s(corpus: Path, tok: Path, seq_len: int, global_batch: int, steps: int) -> float:
    from paratrain.train.data.doc_sources import parse_sources
    from paratrain.train.data.doc_stream import DocumentStream, StreamConfig

    stream = DocumentStream(StreamConfig(parse_sources(str(corpus)), str(tok), seq_len))
    stream.next_global_batch(global_batch)  # opening the files and the first read-ahead
    t0 = time.perf_counter()
    for _ in range(steps):
        stream.next_global_batch(global_batch)
    return steps * global_batch * seq_len / (time.perf_counter() - t0)


def train_run(root: Path, corpus: Path, tok: Path, seq_len: int, global_batch: int, steps: int) -> dict:
    cmd = [sys.executable, "-m", "paratrain.cli", "train", "--model", "tiny", "--strategy", "ddp", "--nproc", "2",
           "--device", "cpu", "--seq-len", str(seq_len), "--global-batch", str(global_batch), "--steps", str(steps),
           "--data", str(corpus), "--tokenizer", str(tok), "--vocab-size", "1024", "--out", str(root / "run"),
           "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    step = statistics.mean(r["step_time_s"] for r in records)
    wait = statistics.mean(r["data_wait_s"] for r in records)
    return {"step_time_s": step, "data_wait_s": wait, "data_wait_fraction": wait / step,
            "consumed_tokens_per_s": global_batch * seq_len / step, "steps_measured": len(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--documents", type=int, default=4000)
    args = parser.parse_args()
    from paratrain.train.data.train_tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = write_corpus(root, args.documents)
        train_tokenizer([root / "tok.txt"], root / "tok", 1000)
        loader = loader_tokens_per_s(corpus, root / "tok", args.seq_len, args.global_batch, args.steps)
        run = train_run(root, corpus, root / "tok", args.seq_len, args.global_batch, args.steps)
    result = {"model": "tiny", "seq_len": args.seq_len, "global_batch": args.global_batch, "ranks": 2,
              "data_workers": 1, "loader_tokens_per_s": loader, **run,
              "loader_headroom": loader / run["consumed_tokens_per_s"]}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"loader alone:   {loader:,.0f} tokens/s (global stream, JSON Lines tokenized on the fly, packed)")
    print(f"training step:  {run['consumed_tokens_per_s']:,.0f} tokens/s consumed ({run['step_time_s'] * 1e3:.1f} ms "
          f"per step of {args.global_batch} x {args.seq_len} tokens, ddp on 2 CPU ranks)")
    print(f"loader headroom: {result['loader_headroom']:.1f}x; data wait {run['data_wait_s'] * 1e3:.2f} ms per step = "
          f"{run['data_wait_fraction']:.2%} of the step (target <= 2%)")


if __name__ == "__main__":
    main()

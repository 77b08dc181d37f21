"""`paratrain generate` against transformers' `generate` on one process: the same model, prompts and lengths,
greedy, the KV cache on both, tokens/s side by side at each batch size, as ratios measured in one run.

The model: a preset trained a few steps on the synthetic data (its checkpoint), exported to a Hugging Face
directory by paratrain's own exporter (`paratrain export`), which transformers loads. paratrain generates from the
checkpoint through its library call (infer/source_loader.py run_ranks with infer/generate_run.py generate_rank,
the model loaded once); transformers from the export (`AutoModelForCausalLM.generate(do_sample=False,
use_cache=True)`), with --new-tokens new tokens for every row on both (min_new_tokens: no early end). Each side's
tokens/s is the new tokens over the generation loop's wall time (the model already loaded), the median of
--repeats runs after one warm-up; both run in this process with the same threads, their runs alternating. The
greedy tokens of both are compared too (`same_tokens`: the fraction of rows whose tokens agree).

    python benchmarks/inference.py                       # tiny, CPU, fp32, batch 1 and 8
    python benchmarks/inference.py --model gpt2-tiny --batches 1,8,32 --json
    python benchmarks/inference.py --device cuda --model gpt2-124m --dtype bf16 --new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
if (SRC / "paratrain").is_dir():
    sys.path.insert(0, str(SRC))  # this tree's paratrain, also where it is not pip-installed (the device image)

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a paratrain preset with an HF export (tiny, gpt2-tiny, ...)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side and batch (after one warm-up)")
    p.add_argument("--train-steps", type=int, default=4, help="steps trained before the export")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="where the checkpoint and export go (default: temp)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    return p.parse_args(argv)


@contextmanager
def restored_environ():
    """A lone in-process rank sets RANK, WORLD_SIZE and the like: the next one must not see them."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def train_and_export(args, root: Path) -> tuple[Path, Path]:
    """(the checkpoint step directory, the Hugging Face export) of --model trained --train-steps steps."""
    from paratrain.config import load_config
    from paratrain.convert.hf_export import export_checkpoint, parse_size
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    steps = max(args.train_steps, 1)
    cfg = load_config(None, {"model": args.model, "strategy": "single", "nproc": 1, "device": args.device,
                             "steps": steps, "seq_len": args.prompt_len + args.new_tokens, "global_batch": 4,
                             "ckpt_every": steps, "ckpt_dir": str(root / "ckpt"), "resume": "never",
                             "metrics": False, "seed": args.seed})
    with restored_environ():
        rt = init_runtime(args.device, 300)
        try:
            Trainer(cfg, rt, quiet=True).fit()
        finally:
            shutdown()
    step_dir = root / "ckpt" / f"step-{steps}"
    export_checkpoint(step_dir, root / "hf", parse_size("2GB"), "fp32")
    return step_dir, root / "hf"


def prompts_for(args, batch: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed + batch)
    return torch.randint(vocab, (batch, args.prompt_len), generator=gen).tolist()


def paratrain_rate(loaded, prompts: list[dict], options) -> tuple[float, list[list[int]]]:
    """One generation through paratrain's library call (infer/generate_run.py generate_rank): (tokens/s over its
    generation loop, each row's new tokens)."""
    from paratrain.infer.generate_run import generate_rank

    result = generate_rank(loaded, prompts, options)
    return result["tokens_per_s"], [o["tokens"] for o in result["outputs"]]


def transformers_rate(model, inputs: torch.Tensor, new_tokens: int) -> tuple[float, list[list[int]]]:
    """One transformers generate() call: (tokens/s over its wall time, each row's new tokens)."""
    cuda = inputs.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        seqs = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return inputs.shape[0] * new_tokens / seconds, seqs[:, inputs.shape[1]:].tolist()


def measure_both(loaded, prompt_sets: dict, hf_dir: str, dtype: str, new_tokens: int, repeats: int) -> dict:
    """On the one rank, with paratrain's model loaded: transformers' model loaded from the export, then per batch
    one warm-up of each and `repeats` timed runs, the two alternating (a machine's load drifts alike on both).
    {batch: {"paratrain": (rates, tokens), "transformers": (rates, tokens)}}."""
    from transformers import AutoModelForCausalLM

    from paratrain.infer.generate import GenerateOptions
    from paratrain.infer.prompts import Prompt

    device = loaded.trainer.rt.device
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPES[dtype]).to(device).eval()
    out = {}
    for batch, ids in prompt_sets.items():
        prompts = [Prompt(i, tuple(p)).to_dict() for i, p in enumerate(ids)]
        options = GenerateOptions(new_tokens, batch_size=batch)
        inputs = torch.tensor(ids, device=device)
        rates = {"paratrain": [], "transformers": []}
        tokens = {}
        for run in range(repeats + 1):
            for side, (rate, tokens[side]) in (("paratrain", paratrain_rate(loaded, prompts, options)),
                                               ("transformers", transformers_rate(model, inputs, new_tokens))):
                if run:
                    rates[side].append(rate)
        out[batch] = {side: (rates[side], tokens[side]) for side in rates}
    return out


def measure(args, step_dir: Path, hf_dir: Path, prompt_sets: dict) -> dict:
    from paratrain.infer.source_loader import resolve_source, run_ranks

    cfg = resolve_source(str(step_dir), {"strategy": "single", "nproc": 1, "device": args.device,
                                         "dtype": args.dtype})
    with restored_environ():
        return run_ranks(cfg, measure_both, prompt_sets, str(hf_dir), args.dtype, args.new_tokens, args.repeats)[0]


def compare(measured: dict) -> list[dict]:
    rows = []
    for batch, sides in measured.items():
        (ours, our_tokens), (theirs, their_tokens) = sides["paratrain"], sides["transformers"]
        mine, hf = statistics.median(ours), statistics.median(theirs)
        same = sum(a == b for a, b in zip(our_tokens, their_tokens, strict=True)) / batch
        rows.append({"batch": batch, "paratrain_tokens_per_s": mine, "transformers_tokens_per_s": hf,
                     "ratio": mine / hf, "same_tokens": same, "paratrain_runs": ours, "transformers_runs": theirs})
    return rows


def run(args) -> dict:
    from paratrain.models.presets import get_preset

    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        step_dir, hf_dir = train_and_export(args, root)
        vocab = get_preset(args.model).vocab_size
        prompt_sets = {b: prompts_for(args, b, vocab) for b in batches}
        measured = measure(args, step_dir, hf_dir, prompt_sets)
    return {"model": args.model, "device": args.device, "dtype": args.dtype, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "rows": compare(measured)}


def table(doc: dict) -> str:
    lines = [f"{doc['model']} on {doc['device']} ({doc['dtype']}, {doc['threads']} threads): prompt "
             f"{doc['prompt_len']} tokens, {doc['new_tokens']} new, greedy, KV cache on both, median of "
             f"{doc['repeats']}",
             f"{'batch':>5}  {'paratrain tok/s':>15}  {'transformers tok/s':>18}  {'ratio':>6}  same tokens"]
    for r in doc["rows"]:
        lines.append(f"{r['batch']:>5}  {r['paratrain_tokens_per_s']:>15,.0f}  {r['transformers_tokens_per_s']:>18,.0f}"
                     f"  {r['ratio']:>5.2f}x  {r['same_tokens']:.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    doc = run(args)
    if args.json:
        print(json.dumps(doc, indent=1))
        print(table(doc), file=sys.stderr)
    else:
        print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`paratrain generate SOURCE`: prompts read and checked in the CLI process, generated on every rank of the layout
(infer/generate.py), gathered on rank 0 in input order, then the `generate --json` document (DESIGN.md):
{"outputs": [{"prompt", "tokens", "text", "logprobs"}], "tokens_per_s", "ttft_s", "tpot_s", "peak_mem_gib",
"layout"}."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.infer.generate import GenerateOptions, RankRun, generate_on_rank
from paratrain.infer.pipeline_generate import pipeline_generate_on_rank
from paratrain.infer.prompts import Prompt, check_lengths, decoder, to_prompts
from paratrain.models.hf_files import is_hf_model
from paratrain.models.presets import model_args_for
from paratrain.parallel.collective_hooks import collective


@dataclass(frozen=True)
class GenerateJob:
    """Everything the ranks need, checked: the prompts (token ids) and the options; plus, for the CLI process, the
    tokenizer that turns generated ids into text."""

    prompts: tuple[Prompt, ...]
    options: GenerateOptions
    tokenizer: str | None


def tokenizer_of(cfg: TrainConfig) -> str | None:
    """The tokenizer a source's prompts and outputs use: --tokenizer, else a transformers model directory's own
    tokenizer.json, else none (a preset trained on token ids)."""
    if cfg.tokenizer:
        return cfg.tokenizer
    if is_hf_model(cfg.model):
        folder = Path(cfg.model[len("hf:"):])
        folder = folder if folder.is_dir() else folder.parent
        if (folder / "tokenizer.json").is_file():
            return str(folder)
    return None


def check_generate_layout(cfg: TrainConfig) -> None:
    """Layouts generate runs: every one without context parallelism, pipeline stages one per rank and without
    sequence parallelism (one line otherwise)."""
    from paratrain.parallel.strategies import resolve_layout
    from paratrain.train.validate import world_size_for

    layout = resolve_layout(cfg, world_size_for(cfg))
    if layout.splits_stages and layout.virtual_stages > 1:
        raise UserError(f"generate runs one pipeline stage per rank ({layout.label()}): give --pp-schedule 1f1b")
    if layout.splits_stages and layout.sp:
        raise UserError(f"generate under pipeline stages runs tp without sequence parallelism ({layout.label()}): "
                        "drop sequence parallelism")
    if layout.splits_sequences:
        raise UserError(f"generate does not run context parallelism ({layout.label()}): a prompt is short; use tp, "
                        "dp, ep or their meshes")


def prepare_job(cfg: TrainConfig, raw: list[dict], options: GenerateOptions) -> GenerateJob:
    """`raw` prompts (infer/prompts.py read_prompts) as token ids, checked against the model's vocabulary and
    positions, and the end-of-text id."""
    args = model_args_for(cfg)
    tokenizer = tokenizer_of(cfg)
    prompts = to_prompts(raw, args.vocab_size, tokenizer)
    check_lengths(prompts, options.max_new_tokens, args.max_seq_len)
    if options.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {options.batch_size}")
    check_generate_layout(cfg)
    eos = None
    if tokenizer is not None:
        from paratrain.train.data.prepare_tokens import load_tokenizer, pick_eot

        eos = pick_eot(load_tokenizer(tokenizer)[1], None)
    return GenerateJob(tuple(prompts), GenerateOptions(**{**options.__dict__, "eos_id": eos}), tokenizer)


# verify --generate without prompts: two lengths, so that batches of one length and a data-parallel split's
# filler round both run
DEFAULT_PROMPT_LENGTHS = (6, 6, 6, 9)


def default_prompts(cfg: TrainConfig) -> list[dict]:
    """Token-id prompts drawn from cfg's seed over the model's vocabulary."""
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = model_args_for(cfg).vocab_size
    return [{"ids": torch.randint(vocab, (n,), generator=gen).tolist(), "where": f"default prompt {i}"}
            for i, n in enumerate(DEFAULT_PROMPT_LENGTHS)]


def generate_rank(loaded, prompt_dicts: list[dict], options: GenerateOptions) -> dict | None:
    """One rank of the run (a collective: every rank calls it): its share generated, then everything on rank 0."""
    trainer = loaded.trainer
    prompts = [Prompt.from_dict(d) for d in prompt_dicts]
    if loaded.layout.splits_stages:  # each rank its stage, the stages joined by sends (infer/pipeline_generate.py)
        run = pipeline_generate_on_rank(trainer.step_runner, loaded.layout, trainer.rt.rank, trainer.rt.device,
                                        loaded.cfg.dtype, prompts, options, trainer.hooks)
    else:
        run = generate_on_rank(loaded.model_parts, loaded.layout, trainer.rt.rank, trainer.rt.device,
                               loaded.cfg.dtype, prompts, options, trainer.hooks)
    runs = gather_runs((run, trainer.memory_gib()), loaded.layout, trainer.rt.is_main)
    if runs is None:
        return None
    return {**merge_runs(runs, len(prompts)), "layout": loaded.layout.to_dict(), "step": loaded.step}


def generate_in_group(cfg: TrainConfig, runtime, prompts: list[Prompt], options: GenerateOptions,
                      layout=None) -> dict | None:
    """Load cfg's source under `layout` (default: cfg's for this world; a one-device layout runs on every rank
    alone) in a joined process group and generate; rank 0's merged result (generate_rank), None elsewhere."""
    import gc

    from paratrain.infer.source_loader import load_for_inference

    loaded = load_for_inference(cfg, runtime, layout)
    result = generate_rank(loaded, [p.to_dict() for p in prompts], options)
    if loaded.layout.world == 1 and not runtime.is_main:
        result = None
    del loaded
    gc.collect()
    return result


def gather_runs(mine: tuple, layout, is_main: bool) -> list | None:
    """Every rank's (RankRun, peak GiB) on rank 0 (None elsewhere); alone, just this one."""
    if layout.world == 1:
        return [mine]
    group = dist.group.WORLD
    out = [None] * dist.get_world_size() if is_main else None
    collective("generate_outputs", "world", "gather", group,
               lambda: dist.gather_object(mine, out, dst=0, group=group), ())
    return out


def merge_runs(runs: list[tuple[RankRun, float]], count: int) -> dict:
    """Each prompt's output once, in input order (tensor-parallel peers generate the same rows: the first rank's
    is kept), and the run's figures: tokens/s over the slowest rank's loop, time to first token (per batch) and
    per output token (per decode step) averaged over every rank's real batches, and the largest peak memory."""
    outputs = {}
    for run, _ in runs:
        for out in run.outputs:
            outputs.setdefault(out.index, out)
    missing = sorted(set(range(count)) - set(outputs))
    if missing:
        raise RuntimeError(f"prompts {missing[:5]} were generated by no rank")
    ordered = [outputs[i] for i in range(count)]
    seconds = max(run.seconds for run, _ in runs)
    ttft = [t for run, _ in runs for t in run.ttft_s]
    steps = [t for run, _ in runs for t in run.step_s]
    return {"outputs": [{"index": o.index, "tokens": o.tokens, "logprobs": o.logprobs, "gaps": o.gaps}
                        for o in ordered],
            "tokens_per_s": sum(len(o.tokens) for o in ordered) / seconds if seconds > 0 else None,
            "ttft_s": sum(ttft) / len(ttft) if ttft else None,
            "tpot_s": sum(steps) / len(steps) if steps else None,
            "peak_mem_gib": max(peak for _, peak in runs),
            "kv_cache": all(run.cached for run, _ in runs)}


def run_generate(cfg: TrainConfig, job: GenerateJob) -> dict | None:
    """Generate on every rank of cfg's layout; the generate --json document (None on a non-zero rank of a torchrun
    job)."""
    from paratrain.infer.source_loader import run_ranks

    results = run_ranks(cfg, generate_rank, [p.to_dict() for p in job.prompts], job.options)
    if 0 not in results:
        return None
    return generate_document(results[0], job)


def generate_document(result: dict, job: GenerateJob) -> dict:
    """The ranks' result with each output's prompt as given and its text."""
    text_of = decoder(job.tokenizer)
    outputs = [{"prompt": prompt.given, "tokens": out["tokens"], "text": text_of(out["tokens"]),
                "logprobs": out["logprobs"]} for prompt, out in zip(job.prompts, result["outputs"], strict=True)]
    return {"outputs": outputs, **{k: v for k, v in result.items() if k != "outputs"},
            "sampling": job.options.sampling.describe(), "max_new_tokens": job.options.max_new_tokens}


def write_outputs(path: Path, doc: dict) -> None:
    """--out: the outputs as JSON Lines, one a prompt, in input order."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            for out in doc["outputs"]:
                f.write(json.dumps(out) + "\n")
    except OSError as exc:
        raise UserError(f"--out {path}: cannot write it: {exc.strerror or exc}") from None


def summary_line(doc: dict) -> str:
    """The stderr summary: how much, how fast, how big."""
    tokens = sum(len(o["tokens"]) for o in doc["outputs"])

    def ms(value) -> str:
        return "n/a" if value is None else f"{value * 1e3:.1f} ms"

    rate = "n/a" if doc["tokens_per_s"] is None else f"{doc['tokens_per_s']:.1f}"
    cache = "KV cache" if doc.get("kv_cache") else "no KV cache"
    return (f"generated {tokens} tokens for {len(doc['outputs'])} prompt(s) ({doc['sampling']}, {cache}): "
            f"{rate} tokens/s, time to first token {ms(doc['ttft_s'])}, per output token {ms(doc['tpot_s'])}, "
            f"peak memory {doc['peak_mem_gib']:.3f} GiB")

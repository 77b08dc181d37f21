"""`paratrain verify --generate`: the same prompts generated on one device and under the layout, token for token.

Every rank first generates every prompt on a one-device copy of the model (each alone: the checkpoint is read by
all ranks together, as DCP wants), then the layout generates them together (infer/generate.py); rank 0 compares.
Tokens must be equal and each token's logprob within the dtype's tolerance (fp32: 1e-4, as issue 49 sets; the
anchors: Megatron-Core checks its inference 1e-3; TF32 on CUDA: 5e-3). A different token at a position whose two largest logits lie
closer than the tie gap (fp32: 1e-5) is a near-tie that summation order may flip: reported, not failed, and the
prompt is not compared past it (its later tokens follow another context). The first real divergence is named:
the prompt, the position, both tokens and their logprobs.
"""

from __future__ import annotations

from paratrain.infer.generate import GenerateOptions
from paratrain.infer.generate_run import generate_in_group, generate_rank
from paratrain.infer.prompts import Prompt

# dtype -> (logprob absolute tolerance, top-2 logit gap under which a flipped token is a near-tie). "tf32": fp32 on
# CUDA, whose matmuls run in TF32 unless --no-tf32 (one H200, tiny: the KV cache against the whole sequence moved
# logprobs 3.4e-4, the GPU against the CPU 8.3e-4)
TOLERANCES = {"fp32": (1e-4, 1e-5), "tf32": (5e-3, 5e-3), "bf16": (5e-2, 5e-2), "fp16": (1e-2, 1e-2)}


def tolerance_for(dtype: str) -> tuple[float, float]:
    return TOLERANCES.get(dtype, TOLERANCES["bf16"])


def precision_of(trainer) -> str:
    """The precision the comparison's tolerance follows: the run's dtype, or "tf32" for fp32 with TF32 matmuls."""
    return "tf32" if trainer.cfg.dtype == "fp32" and trainer.tf32 else trainer.cfg.dtype


def compare_generations(reference: list[dict], outputs: list[dict], dtype: str) -> dict:
    """Each prompt's tokens and logprobs against the reference's: {"passed", "tokens_compared",
    "max_logprob_abs_diff", "first_divergence" (None, or prompt, position, kind, both tokens and logprobs, the
    gap), "near_ties": [the same, for near-ties], "tolerance"}."""
    atol, tie_gap = tolerance_for(dtype)
    compared, max_diff, first, near_ties = 0, 0.0, None, []
    for prompt, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        for position in range(max(len(ref["tokens"]), len(out["tokens"]))):
            mine = _at(out, position)
            theirs = _at(ref, position)
            if mine is None or theirs is None:
                found = {"kind": "length", **_where(prompt, position, theirs, mine)}
                first = first or found
                break
            if mine[0] != theirs[0]:
                gap = min(theirs[2], mine[2])
                found = {"kind": "token", **_where(prompt, position, theirs, mine), "gap": gap}
                if gap < tie_gap:
                    near_ties.append(found)
                else:
                    first = first or found
                break
            compared += 1
            diff = abs(mine[1] - theirs[1])
            max_diff = max(max_diff, diff)
            if diff > atol and first is None:
                first = {"kind": "logprob", **_where(prompt, position, theirs, mine), "abs_diff": diff}
    return {"passed": first is None, "tokens_compared": compared, "max_logprob_abs_diff": max_diff,
            "first_divergence": first, "near_ties": near_ties,
            "tolerance": {"logprob_atol": atol, "tie_gap": tie_gap}}


def _at(output: dict, position: int) -> tuple[int, float, float] | None:
    if position >= len(output["tokens"]):
        return None
    return output["tokens"][position], output["logprobs"][position], output["gaps"][position]


def _where(prompt: int, position: int, ref, mine) -> dict:
    return {"prompt": prompt, "position": position,
            "token_ref": ref and ref[0], "token": mine and mine[0],
            "logprob_ref": ref and ref[1], "logprob": mine and mine[1]}


def describe_generation_divergence(first: dict | None) -> str | None:
    """One line for a person: which prompt, where, and the two tokens."""
    if not first:
        return None
    where = f"prompt {first['prompt']}, new token {first['position']}"
    if first["kind"] == "length":
        return f"first divergence at {where}: one run ended there (reference token {first['token_ref']}, layout " \
               f"token {first['token']})"
    tokens = f"reference token {first['token_ref']} (logprob {first['logprob_ref']:.6g}), layout token " \
             f"{first['token']} (logprob {first['logprob']:.6g})"
    if first["kind"] == "token":
        return f"first divergence at {where}: {tokens}; top-2 logit gap {first['gap']:.3g}"
    return f"first divergence at {where}: the same token {first['token']}, logprobs differ by " \
           f"{first['abs_diff']:.3g} (reference {first['logprob_ref']:.6g}, layout {first['logprob']:.6g})"


def report_lines(report: dict) -> list[str]:
    """The verdict, each near-tie, and where the run first diverges: a line each, for stderr."""
    lines = [f"verify --generate {'PASSED' if report['passed'] else 'FAILED'} ({report['strategy']}, world "
             f"{report['world_size']}, {report['prompts']} prompt(s) x {report['max_new_tokens']} new tokens, "
             f"{report['dtype']}, {report['sampling']}): {report['tokens_compared']} tokens equal, max logprob diff "
             f"{report['max_logprob_abs_diff']:.2e}; {len(report['near_ties'])} near-tie(s)"]
    lines += [f"verify: near-tie (reported, not failed): prompt {t['prompt']}, new token {t['position']}: reference "
              f"{t['token_ref']}, layout {t['token']}, top-2 logit gap {t['gap']:.3g}" for t in report["near_ties"]]
    where = describe_generation_divergence(report["first_divergence"])
    return lines + ([f"verify: {where}"] if where else [])


def run_verify_generate(cfg, job) -> dict | None:
    """verify --generate on every rank of cfg's layout (`job`: infer/generate_run.py's GenerateJob); rank 0's
    report (None on a non-zero rank of a torchrun job)."""
    from paratrain.infer.source_loader import run_ranks

    return run_ranks(cfg, verify_generate_rank, [p.to_dict() for p in job.prompts], job.options).get(0)


def reference_layout(cfg):
    """(the one-device config of cfg, its layout): verify's reference, at cfg's dtype."""
    from paratrain.parallel.strategies import resolve_layout
    from paratrain.verify.parity import reference_config

    ref_cfg = reference_config(cfg, cfg.dtype)
    return ref_cfg, resolve_layout(ref_cfg, 1)


def verify_generate_rank(loaded, prompt_dicts: list[dict], options: GenerateOptions) -> dict | None:
    """One rank of `verify --generate` (a collective); rank 0's report. `loaded`: the layout's model."""
    trainer, cfg = loaded.trainer, loaded.cfg
    prompts = [Prompt.from_dict(d) for d in prompt_dicts]
    ref_cfg, ref_layout = reference_layout(cfg)
    reference = generate_in_group(ref_cfg, trainer.rt, prompts, options, ref_layout)
    result = generate_rank(loaded, prompt_dicts, options)
    if result is None:
        return None
    layout = loaded.layout
    precision = precision_of(trainer)
    report = compare_generations(reference["outputs"], result["outputs"], precision)
    return {"mode": "generate", "strategy": layout.strategy, "dims": layout.degrees(), "world_size": layout.world,
            "dtype": precision, "prompts": len(prompts), "max_new_tokens": options.max_new_tokens,
            "sampling": options.sampling.describe(), "kv_cache": result["kv_cache"], "step": loaded.step,
            **report}

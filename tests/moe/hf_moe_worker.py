# transformers' MoE models (--model hf:DIR) in ONE launch of 2 ranks (gloo, CPU): verify parity against one device
# (fp32, verify/parity.py's tolerances and its router-decision check) of tiny Qwen3-MoE, Mixtral and OLMoE
# configs under --ep 2, tp=2 and zero3 (and GPT-OSS's and DeepSeek-V3's, found by their shape: issue 48); planted EP faults (tests/support/moe_faults.py) that must fail at step 1;
# three short runs that save a checkpoint for test_hf_moe.py's export checks; and one run with the first layer's
# router biased to expert 0, whose metrics.jsonl (and the clean qwen3_moe-ep2 run's) the doctor's rule reads.
# `retrain` (a second launch) trains the exports again as hf: models under another strategy.
"""Usage: torchrun --standalone --nproc-per-node 2 hf_moe_worker.py WORKDIR -> rank 0 prints one JSON line.

WORKDIR holds one folder per model type with its config.json (written by the test with transformers' own
config classes); checkpoints go to WORKDIR/ck-<id>, run directories (metrics.jsonl) to WORKDIR/run-<id>.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support.moe_faults

from paratrain.config import TrainConfig  # noqa: E402
from paratrain.train.runtime import init_runtime, shutdown  # noqa: E402
from paratrain.train.trainer import Trainer  # noqa: E402
from paratrain.train.validate import validate_run  # noqa: E402
from paratrain.verify.parity import verify_in_group  # noqa: E402
from support.moe_faults import planted  # noqa: E402

KINDS = ("qwen3_moe", "mixtral", "olmoe")
# found by their shape (issue 48): GPT-OSS (sinks, alternating sliding/full attention, transposed experts with
# biases, no tp plan for attention or experts) and DeepSeek-V3 (MLA, a dense first layer, a shared expert, sigmoid
# group-limited routing with a selection bias), tiny configs of interop/hf_tiny_config.py; Qwen2-MoE's shared
# expert behind its own sigmoid gate under tp
SHAPE_KINDS = ("gpt_oss", "deepseek_v3")
LAYOUTS = {"ep2": {"strategy": "ep", "ep": 2}, "tp2": {"strategy": "tp"}, "zero3": {"strategy": "zero3"}}
CASES = [
    *[{"id": f"{kind}-{name}", "kind": kind, **fields} for kind in KINDS + SHAPE_KINDS
      for name, fields in LAYOUTS.items()],
    {"id": "qwen2_moe-tp2", "kind": "qwen2_moe", "strategy": "tp"},
    # an indexer the language-model loss never reaches (no gradient): DDP finds such parameters each step
    {"id": "dots3_note_text-ddp", "kind": "dots3_note_text", "strategy": "ddp"},
    # a pipeline's stages name the layers as the whole model does; with 2 micro-batches per step a layer's last
    # forward is not the batch, so routing is not compared (None), with one it is
    {"id": "qwen3_moe-pp2", "kind": "qwen3_moe", "strategy": "pp", "pp": 2},
    {"id": "qwen3_moe-pp2-gpipe1", "kind": "qwen3_moe", "strategy": "pp", "pp": 2, "pp_schedule": "gpipe",
     "microbatches": 1},
    *[{"id": f"qwen3_moe-{fault}", "kind": "qwen3_moe", "fault": fault, "strategy": "ep", "ep": 2, "steps": 2}
      for fault in ("moe-wrong-splits", "moe-swapped-ids", "moe-dropped-expert-grad")],
]
# checkpoints for the export checks: hf: runs under ep and tp, and paratrain's moe-tiny (exported as Mixtral)
SAVES = [{"id": "qwen3_moe-ep2", "kind": "qwen3_moe", "strategy": "ep", "ep": 2},
         {"id": "mixtral-tp2", "kind": "mixtral", "strategy": "tp"},
         {"id": "moe-tiny-ep2", "model": "moe-tiny", "strategy": "ep", "ep": 2},
         {"id": "qwen3_moe-ep2-biased", "kind": "qwen3_moe", "strategy": "ep", "ep": 2,
          "fault": "moe-biased-first-router"}]
# the exports of SAVES (written by test_hf_moe.py between the launches) trained again as hf: models, one step
# under another strategy: the qwen3_moe ep checkpoint's under tp, the mixtral tp and moe-tiny ones' under ep
RETRAIN = [{"id": "qwen3_moe-ep2-then-tp2", "out": "out-qwen3_moe-ep2", "strategy": "tp"},
           {"id": "mixtral-tp2-then-ep2", "out": "out-mixtral-tp2", "strategy": "ep", "ep": 2},
           {"id": "moe-tiny-ep2-then-ep2", "out": "out-moe-tiny", "strategy": "ep", "ep": 2}]
KEYS = ("strategy", "dims", "passed", "max_loss_abs_diff", "max_grad_rel_diff", "max_param_abs_diff",
        "expert_assignments_match", "first_assignment_mismatch", "first_divergence")


def config(rt, work: str, kind: str | None, **fields) -> TrainConfig:
    model = f"hf:{os.path.join(work, kind)}" if kind else "moe-tiny"
    return TrainConfig(**{"model": model, "nproc": rt.world_size, "device": "cpu", "steps": 3, "seq_len": 32,
                          "global_batch": 4, "metrics": False, "resume": "never", "timeout_s": 120.0, **fields})


def run(work: str) -> dict | None:
    """Every case and save, in this process group: rank 0's report (None on the other ranks)."""
    rt = init_runtime("cpu", 120.0)
    out = []
    for case in CASES:
        fields = {k: v for k, v in case.items() if k not in ("id", "fault", "kind")}
        cfg = config(rt, work, case["kind"], **fields)
        validate_run(cfg, rt.world_size)
        with planted(case.get("fault")):
            report = verify_in_group(cfg, rt)
        if rt.is_main:
            first = report["first_divergence"]
            steps = [s for s in (first and first["step"], (report["first_assignment_mismatch"] or {}).get("step")) if s]
            out.append({"id": case["id"], **{k: report[k] for k in KEYS}, "first_step": min(steps or [None])})
    for save in SAVES:
        fields = {k: v for k, v in save.items() if k not in ("id", "kind", "model", "fault")}
        cfg = config(rt, work, save.get("kind"), **fields, steps=2, ckpt_every=2,
                     ckpt_dir=os.path.join(work, f"ck-{save['id']}"), metrics=True)
        run_dir = Path(work) / f"run-{save['id']}"
        run_dir.mkdir(exist_ok=True)
        with planted(save.get("fault")):
            Trainer(cfg, rt, run_dir=run_dir, quiet=True).fit()
    dist.barrier()
    gc.collect()
    shutdown()
    return json.loads(json.dumps({"verify": out}, default=str)) if rt.is_main else None


def retrain(work: str) -> dict | None:
    """Each RETRAIN run in this process group, its metrics.jsonl in WORKDIR/run-<id>: {} on rank 0."""
    rt = init_runtime("cpu", 120.0)
    for case in RETRAIN:
        cfg = config(rt, work, case["out"], steps=1, metrics=True,
                     **{k: v for k, v in case.items() if k not in ("id", "out")})
        validate_run(cfg, rt.world_size)
        run_dir = Path(work) / f"run-{case['id']}"
        run_dir.mkdir(exist_ok=True)
        Trainer(cfg, rt, run_dir=run_dir, quiet=True).fit()
    dist.barrier()
    gc.collect()
    shutdown()
    return {} if rt.is_main else None


def main() -> None:
    report = run(sys.argv[1])
    if report is not None:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

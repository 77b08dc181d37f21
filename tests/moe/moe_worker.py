# The MoE checks that need a process group, in ONE launch of 4 ranks (gloo, CPU): verify parity of expert
# parallelism against one device (fp32, verify/parity.py's tolerances and its router-decision check) and the
# planted EP faults of tests/support/moe_faults.py, each of which must fail at step 1; and a checkpoint saved
# at ep=2 resumed at ep=4 and ep=1 (DCP reshards the experts), against the run that never stopped.
"""Usage: torchrun --standalone --nproc-per-node 4 moe_worker.py [CASE_ID ...] -> rank 0 prints one JSON line. The
suite runs run_checks in its shared 4-rank group (tests/conftest.py's four_ranks, "moe" in its spec)."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import tempfile

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support.moe_faults

from paratrain.config import TrainConfig  # noqa: E402
from paratrain.train.runtime import init_runtime, shutdown  # noqa: E402
from paratrain.train.trainer import Trainer  # noqa: E402
from paratrain.train.validate import validate_run  # noqa: E402
from paratrain.verify.parity import verify_in_group  # noqa: E402
from support.moe_faults import planted  # noqa: E402

EP_FSDP = {"strategy": "ep", "ep": 2}  # dp_shard=4: experts split 2 ways, FSDP over the other 2
CASES = [
    {"id": "ep2-dp_shard4", **EP_FSDP},
    # selective AC replays each block with the experts' FSDP hooks inside it: the profiler ranges they mark differ
    # between forward and replay when the experts have no FSDP peers (ep = dp_shard; activation_checkpoint.py)
    {"id": "ep4-ac-selective", "strategy": "ep", "ep": 4, "ac": "selective"},
    # one micro-batch per pipeline: the balancing loss is counted per micro-batch (docs/moe.md)
    {"id": "ep2-pp2", "strategy": "pp", "pp": 2, "dp_shard": 2, "ep": 2, "pp_schedule": "gpipe", "microbatches": 1},
    *[{"id": fault, "fault": fault, **EP_FSDP, "steps": 2}
      for fault in ("moe-wrong-splits", "moe-swapped-ids", "moe-dropped-expert-grad", "moe-aux-per-rank")],
    {"id": "ep2-dp_shard2-tp2", "strategy": "tp", "dp_shard": 2, "tp": 2, "ep": 2},
    # ep within dp_shard x cp (parallel/dims.py): each cp rank routes its own part of the sequence
    {"id": "ep2-dp_shard2-cp2", "strategy": "ep", "dp_shard": 2, "cp": 2, "ep": 2},
]
KEYS = ("strategy", "dims", "passed", "checks", "max_loss_abs_diff", "max_grad_rel_diff", "max_param_abs_diff",
        "expert_assignments_match", "first_assignment_mismatch", "first_divergence")


def config(rt, **fields) -> TrainConfig:
    return TrainConfig(**{"model": "moe-tiny", "nproc": rt.world_size, "device": "cpu", "steps": 3,
                          "metrics": False, "resume": "never", "timeout_s": 120.0, **fields})


def resume_at_other_ep(rt, ckpt_dir: str) -> dict:
    """6 steps at ep=2 saving at step 3; the same from step 3 at ep=4 and at ep=1 (zero3): final losses."""
    out = {"ep2_full": Trainer(config(rt, strategy="ep", ep=2, steps=6, ckpt_every=3, ckpt_dir=ckpt_dir),
                               rt, quiet=True).fit()["final_loss"]}
    for name, fields in (("ep4_resumed", {"strategy": "ep", "ep": 4}), ("ep1_resumed", {"strategy": "zero3"})):
        cfg = config(rt, **fields, steps=6, ckpt_dir=ckpt_dir, resume=os.path.join(ckpt_dir, "step-3"))
        out[name] = Trainer(cfg, rt, quiet=True).fit()["final_loss"]
    return out


def rows_against_routing(rt) -> dict:
    """One step at ep=2: the rows this rank sends (read from its moe_splits counts as the collective passes)
    against the distinct (token, ep rank) pairs of its routers' own choices, summed over the ranks."""
    from paratrain.parallel.collective_hooks import add_interceptor
    from paratrain.parallel.ep.ep_exchange import split_counts

    seen = {"rows": 0, "copies": 0, "pairs": 0}

    def count_rows(call, proceed):
        out = proceed()
        if call.purpose == "moe_splits":
            copies, rows = split_counts(call.tensors[0], dist.get_world_size(call.group))
            seen["rows"] += int(rows.sum())
            seen["copies"] += int(copies.sum())
        return out

    trainer = Trainer(config(rt, **EP_FSDP, steps=1), rt, quiet=True)
    local = trainer.args.n_experts // EP_FSDP["ep"]

    def count_pairs(module, args, output):
        ranks = (output[1] // local).sort(dim=-1).values  # each token's experts' ep ranks
        seen["pairs"] += int(ranks.shape[0] + (ranks[:, 1:] != ranks[:, :-1]).sum())

    handles = [m.register_forward_hook(count_pairs) for part in trainer.step_runner.model_parts
               for m in part.modules() if hasattr(m, "expert_bias") and hasattr(m, "top_k")]
    remove = add_interceptor(count_rows)
    try:
        trainer.train_step(trainer.source.next_step())
    finally:
        remove()
        for h in handles:
            h.remove()
    totals = [None] * rt.world_size
    dist.all_gather_object(totals, seen)
    return {key: sum(t[key] for t in totals) for key in seen}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def redistribute_warnings():
    """What DTensor's redistribution logs on this rank meanwhile (e.g. '2 sequential all_reduce operations': a
    reduction over two mesh dims with no flattened view of them)."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    handler = _Warnings()
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def run_checks(rt, only: list[str] | None = None) -> dict:
    """The cases (those of `only`, all when none) and the resume, in this process group: rank 0's report."""
    out = []
    for case in [c for c in CASES if not only or c["id"] in only]:
        fields = {k: v for k, v in case.items() if k not in ("id", "fault")}
        cfg = config(rt, **fields)
        validate_run(cfg, rt.world_size)
        with planted(case.get("fault")), redistribute_warnings() as warned:
            report = verify_in_group(cfg, rt)
        warned_anywhere = [None] * rt.world_size
        dist.all_gather_object(warned_anywhere, warned)
        if rt.is_main:
            first = report["first_divergence"]
            out.append({"id": case["id"], **{k: report[k] for k in KEYS},
                        "redistribute_warnings": sorted({line for lines in warned_anywhere for line in lines}),
                        "first_step": min([s for s in (first and first["step"],
                                                       (report["first_assignment_mismatch"] or {}).get("step"))
                                           if s] or [None])})
    report = {"verify": out}
    if not only or "rows" in only:
        report["rows"] = rows_against_routing(rt)
    if not only or "resume" in only:
        with tempfile.TemporaryDirectory() as tmp:
            shared = [tmp]
            dist.broadcast_object_list(shared, src=0)  # one directory for every rank (rank 0's)
            report["resume"] = resume_at_other_ep(rt, shared[0])
            dist.barrier()
    return report


def main() -> None:
    rt = init_runtime("cpu", 120.0)
    report = run_checks(rt, sys.argv[1:])  # case ids to run (all when none)
    dist.barrier()
    if rt.is_main:
        print(json.dumps(report, default=str), flush=True)
    gc.collect()
    shutdown()


if __name__ == "__main__":
    main()

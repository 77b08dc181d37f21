# The checks of tests/parallel that need a process group, all in ONE launch per world size (gloo, CPU): verify
# parity of several strategies against the single-device reference, collective accounting, ZeRO-1
# checkpoints across sizes, pipeline_checks.py's schedules and layouts, uneven_worker.py's splits, and the
# tensor- and context-parallel parity workers' checks, and tests/train's validation and resharding workers.
# conftest.py says which.
"""Usage: torchrun --standalone --nproc-per-node N dp_worker.py SPEC.json -> rank 0 prints one JSON line; the
suite calls run(SPEC) on ranks forked from its warm forkserver instead (tests/groups.py).

SPEC: {"verify": [{"id": NAME, "strategy": ..., degrees...}], "comm": bool, "ckpt_save": DIR|null,
       "ckpt_load": DIR|null, "approx": {"steps": N, "runs": {name: overrides}} | null,
       "pipeline": {"ckpt_dir": DIR|null} | null, "uneven": bool, "tp_parity": bool, "cp_parity": bool,
       "validation": bool, "reshard": DIR|null, "moe": bool, "semi_sync": DIR|null, "kv_cache": bool,
       "infer_eval": DIR|null, "generate": DIR|null}
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from paratrain.config import TrainConfig
from paratrain.models.presets import count_params
from paratrain.parallel.collective_bytes import count_collectives
from paratrain.train.runtime import init_runtime, shutdown
from paratrain.train.trainer import Trainer
from paratrain.train.validate import validate_run
from paratrain.verify.parity import verify_in_group


def config(rt, **overrides) -> TrainConfig:
    base = {"strategy": "ddp", "nproc": rt.world_size, "device": "cpu", "steps": 5, "metrics": False,
            "resume": "never", "timeout_s": 120.0}
    return TrainConfig(**{**base, **overrides})


def run_verify(rt, specs: list[dict]) -> list[dict]:
    out = []
    for spec in specs:
        fields = {k: v for k, v in spec.items() if k != "id"}
        cfg = config(rt, **fields)
        validate_run(cfg, rt.world_size)
        report = verify_in_group(cfg, rt)
        if rt.is_main:
            out.append({"id": spec["id"], "world_size": rt.world_size,
                        **{k: report[k] for k in ("strategy", "dims", "dtype", "passed", "checks", "max_loss_abs_diff",
                                                  "max_grad_rel_diff", "max_param_abs_diff", "model_state_bytes",
                                                  "expert_assignments_match")},
                        "lora": report.get("lora"), "semi_sync": report.get("semi_sync")})
    return out


def step_bytes(rt, strategy: str) -> dict:
    """Collectives of the second training step (the first builds DDP buckets / FSDP state) by op."""
    trainer = Trainer(config(rt, strategy=strategy), rt, quiet=True)
    trainer.train_step(trainer.source.next_step())
    with count_collectives() as stats:
        trainer.train_step(trainer.source.next_step())
    return {"bytes": dict(stats.bytes_by_op), "calls": dict(stats.calls_by_op), "wire": stats.total_wire_bytes,
            "params": count_params(trainer.args)}


def zero3_against_plain_loop(rt) -> dict:
    """ZeRO-3 on benchmarks/peers.py's transformers model: the collectives of the third step (calls and bytes by op)
    and the losses of paratrain's loop and of the peers' plain fully_shard loop (each decoder layer, then the root),
    from the same initial weights and token rows."""
    import importlib.util
    import tempfile
    from pathlib import Path

    from paratrain.models.hf_model import build_hf_model

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
    spec = importlib.util.spec_from_file_location("peers", bench)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    run = {**peers.run_config(), "seq_len": 32}
    with tempfile.TemporaryDirectory() as folder:  # no weights: each rank draws them from the seed
        (Path(folder) / "config.json").write_text(json.dumps(peers.MODEL))
        trainer = Trainer(config(rt, **run, strategy="zero3", model=f"hf:{folder}", micro_batch=4), rt, quiet=True)
        model = peers.shard_model(build_hf_model(f"hf:{folder}", run["seed"]).hf, None)
    batches = [trainer.source.next_step() for _ in range(3)]
    optimizer = peers.peer_optimizer(model.parameters())
    params = list(model.parameters())
    out = {}
    for name in ("paratrain", "plain"):
        losses = []
        for i, (mb,) in enumerate(batches):
            with count_collectives(enabled=i == 2) as stats:
                if name == "paratrain":
                    losses.append(trainer.train_step([mb])["loss"])
                else:
                    losses.append(peers.plain_step(model, optimizer, params, mb.inputs, mb.targets, run["grad_clip"]))
        out[name] = {"calls": dict(stats.calls_by_op), "bytes": dict(stats.bytes_by_op), "losses": losses}
    return out


def run_comm(rt) -> dict:
    """Byte counts per strategy, and proof that counting changes no result and leaves nothing installed."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    out = {s: step_bytes(rt, s) for s in ("ddp", "zero1", "zero2", "zero3")}
    out["zero3_vs_plain"] = zero3_against_plain_loop(rt)
    losses = {}
    for counted in (False, True):
        trainer = Trainer(config(rt, strategy="zero3"), rt, quiet=True)
        with count_collectives(enabled=counted):
            losses[counted] = [trainer.train_step(trainer.source.next_step())["loss"] for _ in range(3)]
        params = torch.cat([p.detach().to_local().flatten() for p in trainer.step_runner.model.parameters()])
        losses[f"{counted}-params"] = params.sum().item()
    out["identical"] = losses[False] == losses[True] and losses["False-params"] == losses["True-params"]
    out["mode_left_installed"] = _get_current_dispatch_mode() is not None
    return out


def run_checkpoint(rt, save_dir: str | None, load_dir: str | None) -> dict:
    """ZeRO-1: a 6-step run saving at step 3; a later launch (another world size) resumes from step 3."""
    out = {}
    if save_dir:
        cfg = config(rt, strategy="zero1", steps=6, ckpt_every=3, ckpt_dir=save_dir)
        out["full_run_loss"] = Trainer(cfg, rt, quiet=True).fit()["final_loss"]
    if load_dir:
        for strategy in ("zero1", "ddp"):
            cfg = config(rt, strategy=strategy, steps=6, ckpt_dir=load_dir, resume=os.path.join(load_dir, "step-3"))
            trainer = Trainer(cfg, rt, quiet=True)
            out[f"resumed_{strategy}_loss"] = trainer.fit()["final_loss"]
    return out


def run_pipeline(rt, ckpt_dir: str | None) -> dict | None:
    """pipeline_checks.py's layouts for this world size, and (given a folder) its checkpoint across layouts."""
    from pipeline_checks import LAYOUTS, check_checkpoint_across_layouts, check_layout

    results = {name: check_layout(rt, overrides) for name, overrides in LAYOUTS[rt.world_size].items()}
    if ckpt_dir:
        results["checkpoint"] = check_checkpoint_across_layouts(rt, ckpt_dir)
    return results


def run_approx(rt, steps: int, runs: dict) -> dict:
    losses = {}
    for name, overrides in runs.items():
        losses[name] = Trainer(config(rt, steps=steps, **overrides), rt, quiet=True).fit()["losses"]
    return losses


def run(spec: dict) -> dict | None:
    """Every check SPEC names, in this process group; rank 0's report (None on the other ranks)."""
    rt = init_runtime("cpu", 120.0)
    report = {"world_size": rt.world_size, "verify": run_verify(rt, spec.get("verify", []))}
    if spec.get("comm"):
        report["comm"] = run_comm(rt)
    if spec.get("ckpt_save") or spec.get("ckpt_load"):
        report["checkpoint"] = run_checkpoint(rt, spec.get("ckpt_save"), spec.get("ckpt_load"))
    if spec.get("pipeline"):
        report["pipeline"] = run_pipeline(rt, spec["pipeline"]["ckpt_dir"])
    if spec.get("uneven"):
        from uneven_worker import run_checks

        report["uneven"] = run_checks(rt)
    if spec.get("tp_parity"):
        from tp_parity_worker import run_checks as tp_checks

        report["tp_parity"] = tp_checks()
    if spec.get("cp_parity"):
        from cp_parity_worker import run_checks as cp_checks

        report["cp_parity"] = cp_checks()
    if spec.get("validation") or spec.get("reshard"):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train"))
    if spec.get("validation"):
        from val_worker import run_checks as validation_checks

        report["validation"] = validation_checks(rt)
    if spec.get("reshard"):
        from pathlib import Path

        from reshard_worker import run_checks as reshard_checks

        report["reshard"] = reshard_checks(rt, Path(spec["reshard"]))
    if spec.get("approx"):
        report["approx"] = run_approx(rt, spec["approx"]["steps"], spec["approx"]["runs"])
    if spec.get("semi_sync"):  # semi_sync_worker.py: --semi-sync's reductions and resume (4 ranks: 2 x 2 islands)
        from semi_sync_worker import run_checks as semi_sync_checks

        report["semi_sync"] = semi_sync_checks(rt, spec["semi_sync"])
    if spec.get("moe"):  # tests/moe/moe_worker.py's expert-parallel cases, faults and resume
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moe"))
        from moe_worker import run_checks as moe_checks

        report["moe"] = moe_checks(rt)
    if spec.get("kv_cache"):  # tests/infer/kv_cache_worker.py: greedy decoding through the KV cache under tp, ep
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "infer"))
        from kv_cache_worker import run_checks as kv_cache_checks

        report["kv_cache"] = kv_cache_checks(rt)
    if spec.get("infer_eval"):  # tests/infer/eval_worker.py: paratrain eval of a checkpoint under every layout
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "infer"))
        from pathlib import Path

        from eval_worker import run_checks as eval_checks

        report["infer_eval"] = eval_checks(rt, Path(spec["infer_eval"]))
    if spec.get("generate"):  # tests/infer/generate_worker.py: paratrain generate under every layout
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "infer"))
        from pathlib import Path

        from generate_worker import run_checks as generate_checks

        report["generate"] = generate_checks(rt, Path(spec["generate"]))
    dist.barrier()
    gc.collect()  # free the trainers (DDP reducers) while the groups are registered: see train/worker.py
    shutdown()
    return json.loads(json.dumps(report)) if rt.is_main else None  # plain data, as a JSON line would carry


def main() -> None:
    with open(sys.argv[1]) as f:
        report = run(json.load(f))
    if report is not None:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

"""One description of a run: the Layout the planner predicts for is the Layout the trainer runs.

For every strategy and the micro-batching variants, the trainer's Layout (resolve_layout, what Trainer(cfg, rt)
builds) must be among the planner's candidates for the same choices, and a candidate's `paratrain train`
command must resolve back to it, field by field. bench and doctor report the Layout their workers ran and
the one their prediction was made for: the two must be the same object, field by field.
"""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.config import TrainConfig
from paratrain.costs.hardware import profile_from_spec
from paratrain.gpu_catalog import get_gpu
from paratrain.models.presets import model_args_for
from paratrain.parallel.layout import Layout
from paratrain.parallel.strategies import STRATEGY_TABLE, resolve_layout
from paratrain.plan.plan_cli import fixed_choices
from paratrain.plan.plan_report import candidate_doc
from paratrain.plan.request import PlanRequest
from paratrain.plan.search import Job, search

BASE = {"model": "tiny4", "seq_len": 64, "global_batch": 8, "device": "cpu"}
VARIANTS = [
    # ep splits a Mixture-of-Experts model's experts: a dense model is refused (parallel/ep/expert_parallel.py)
    *[(name, {"single": 1, "hsdp": 4}.get(name, 2), {"model": "moe-tiny"} if name == "ep" else {})
      for name in STRATEGY_TABLE],
    ("pp", 2, {"micro_batch": 2}),
    ("pp", 2, {"microbatches": 4}),
    ("pp", 2, {"pp_schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": 4}),
    ("pp", 2, {"pp_schedule": "gpipe", "micro_batch": 1}),
    ("ddp", 2, {"micro_batch": 2}),
    ("zero3", 2, {"micro_batch": 1}),
    ("tp-sp", 4, {"dp_shard": 2}),
    ("pp", 4, {"dp_replicate": 2, "micro_batch": 2}),
    ("cp-ulysses", 4, {"dp_shard": 2}),
]


def variant_id(v) -> str:
    name, world, extra = v
    return f"{name}-x{world}" + "".join(f"-{k}={val}" for k, val in extra.items())


def planner_candidates(cfg: TrainConfig, world: int, given: dict) -> tuple[Job, object, list]:
    """Ask the planner with the choices the user gave train (`plan --strategy S --pp-schedule ...`), the
    degrees and micro-batch pinned to what train resolved (plan takes --micro-batch, not --microbatches)."""
    args = model_args_for(cfg)
    lay = resolve_layout(cfg, world)
    opts = {"gpus": world, "strategy": cfg.strategy, **lay.degrees(), "micro_batch": lay.micro_batch,
            "ac": cfg.ac, "sp": None, "cp_impl": None, "pp_schedule": given.get("pp_schedule"),
            "virtual_stages": given.get("virtual_stages")}
    fixed = fixed_choices(PlanRequest.of(opts))
    spec = dataclasses.replace(get_gpu("cpu"), gpus_per_node=world, mem_gib=1024)
    job = Job(args=args, model_name=cfg.model, gpus=world, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
              dtype=cfg.dtype, device_type="cpu")
    profile = profile_from_spec(spec)
    feasible, infeasible, _ = search(job, profile, fixed)
    return job, profile, feasible + infeasible


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_planner_predicts_for_the_layout_train_runs(variant):
    from paratrain.cli import resolve_config

    name, world, extra = variant
    cfg = TrainConfig(**{**BASE, **extra}, strategy=name, nproc=world)
    runs = resolve_layout(cfg, world)
    job, profile, candidates = planner_candidates(cfg, world, extra)
    same = [c for c in candidates if c.layout == runs]
    assert same, f"{runs.label()} not among {[c.layout.label() for c in candidates]}"
    # the candidate's command, parsed by the CLI, runs exactly that layout again
    argv = candidate_doc(job, profile, same[0])["command"].split()[2:]
    opts = {argv[i][2:].replace("-", "_"): argv[i + 1] for i in range(len(argv) - 1)
            if argv[i].startswith("--") and not argv[i + 1].startswith("--")}
    opts = {k: (int(v) if v.isdigit() else v) for k, v in opts.items()}
    opts["sp"] = "--sp" in argv
    again = resolve_layout(resolve_config({**opts, "config": None}), world)
    assert again == runs and again.to_dict() == runs.to_dict()


def test_a_single_device_trainer_runs_the_resolved_layout():
    import torch

    from paratrain.train.runtime import Runtime
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(**BASE, strategy="single", nproc=1, micro_batch=2, steps=1, metrics=False)
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    assert Trainer(cfg, rt, quiet=True).layout == resolve_layout(cfg, 1)


def test_layout_fields_compare_but_the_mesh_does_not():
    a = Layout(pp=2, microbatches=4, micro_batch=2)
    assert a == a.replace(mesh=object()) and a != a.replace(microbatches=2)
    assert Layout.from_dict(a.to_dict()) == a and "mesh" not in a.to_dict()


@pytest.mark.timeout(300)
def test_bench_and_doctor_predict_for_the_layout_their_workers_ran(cli_here):
    """pp with --micro-batch was where bench and doctor once predicted for another run: each reports the
    layout its workers ran next to the one its prediction used."""
    common = ("--model", "tiny4", "--seq-len", "32", "--timeout-s", "120")
    res = cli_here("bench", "--strategies", "pp,cp-ulysses", "--nproc", "2", "--steps", "1", "--warmup", "2",
              "--scaling", "strong", "--global-batch", "8", "--micro-batch", "2", "--json", *common)
    assert res.returncode == 0, res.stderr[-3000:]
    for run in res.json()["runs"]:
        cfg = TrainConfig(**{**BASE, "seq_len": 32}, strategy=run["strategy"], nproc=2, micro_batch=2)
        assert run["predicted_layout"] == run["layout"] == resolve_layout(cfg, 2).to_dict(), run["strategy"]
    pp = next(r for r in res.json()["runs"] if r["strategy"] == "pp")
    assert (pp["layout"]["microbatches"], pp["layout"]["micro_batch"]) == (4, 2)  # 8 sequences, 2 at a time

    res = cli_here("doctor", "--strategy", "pp", "--nproc", "2", "--global-batch", "8", "--micro-batch", "2",
              "--steps", "2", "--probe-rounds", "0", "--json", *common, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    report = res.json()
    assert report["predicted"]["layout_fields"] == report["run"]["layout"]
    assert Layout.from_dict(report["run"]["layout"]).microbatches == 4
    # the bubble is the pipeline's measured idle time, not a formula: a 2-stage pipeline idles
    assert report["breakdown"]["bubble"] > 0

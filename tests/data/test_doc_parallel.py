"""Document data under the strategies, in one 2-rank launch (doc_worker.py), plus SIGKILL resumes.

- Document masks are real: the first step's loss of packed rows (the mean over their real tokens) equals every
  document's loss run alone on one device (fp32, 1e-5 relative) under single, ddp (with accumulation), zero3, tp,
  tp-sp, cp-ring, cp-ulysses and pp (every schedule, Llama and GPT-2, and naive model parallel), with document
  boundaries inside the ring's blocks (seq 64 = 4 chunks of 16); the mask dropped (support/drop_doc_mask.py)
  fails it under one-device attention, TP, both CP kernels and pp. The same for a transformers model
  (`--model hf:`) under cp-ring, cp-ulysses and pp. The composed mesh dp_shard 2 x cp-ring 2 in a 4-rank launch,
  with its fault and a verify.
- Validation on a JSON Lines file gives the same val_loss under single, ddp, zero3 and pp.
- `paratrain verify` (verify_in_group) passes on a packed JSON Lines + Parquet mixture under zero3, tp-sp,
  cp-ring and pp (one and two stages per rank).
- Bit-identical resume: a run over a JSON Lines + Parquet mixture, SIGKILLed on one rank while its loader
  worker has prefetched past the step, restarted by torch elastic from its last checkpoint: the per-step
  losses after the kill equal the uninterrupted run's exactly (ddp and zero3; reference: doc_worker's fit).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from helpers import plugin_env
from reliability.inproc import launch_here
from support.doc_corpus import make_corpus

pytest.importorskip("datasets")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "doc_worker.py")
MASKED = ("single", "ddp", "zero3", "tp", "tp-sp", "cp-ring", "cp-ulysses")
# pipeline parallel, every schedule: each stage gets its micro-batch's positions and document ids
PIPELINED = {"pp-gpipe": {"strategy": "pp", "pp_schedule": "gpipe", "microbatches": 2},
             "pp": {"strategy": "pp", "microbatches": 2},
             "pp-interleaved": {"strategy": "pp", "pp_schedule": "interleaved-1f1b", "virtual_stages": 2,
                                "model": "tiny4", "microbatches": 2},
             "pp-zero-bubble": {"strategy": "pp", "pp_schedule": "zero-bubble", "virtual_stages": 2,
                                "model": "tiny4", "microbatches": 2},
             "pp-gpt2": {"strategy": "pp", "model": "gpt2-tiny", "microbatches": 2},
             "model": {"strategy": "model"}}
FAULTED = ("single", "tp", "cp-ring", "cp-ulysses", "pp")
# a transformers model (--model hf:..., a tiny Llama config): its attention function gets the document ids
TRANSFORMERS = {"hf-cp-ring": {"strategy": "cp-ring"}, "hf-cp-ulysses": {"strategy": "cp-ulysses"},
                "hf-pp": {"strategy": "pp", "microbatches": 2}}
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# `paratrain verify` on a packed mixture: one strategy of each family, pp with one and two stages per rank
VERIFIED = {"zero3": {"strategy": "zero3"}, "tp-sp": {"strategy": "tp-sp"}, "cp-ring": {"strategy": "cp-ring"},
            "pp": PIPELINED["pp"], "pp-zero-bubble": PIPELINED["pp-zero-bubble"]}
STEPS, CKPT_EVERY, KILL = 6, 2, "1:3"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def mixture(corpus) -> str:
    return f"{corpus['a']}:0.6,{corpus['b']}:0.4"


@pytest.fixture(scope="module")
def group(corpus, tmp_path_factory):
    base = {"data": corpus["a"], "tokenizer": corpus["tok"], "vocab_size": 320, "seq_len": 64, "global_batch": 4}
    masks = [{"id": s, "strategy": s} for s in MASKED]
    masks += [{"id": "ddp-accumulate", "strategy": "ddp", "micro_batch": 1}]
    masks += [{"id": case, **fields} for case, fields in PIPELINED.items()]
    masks += [{"id": f"{s}-fault", "strategy": s, **PIPELINED.get(s, {}), "fault": True} for s in FAULTED]
    fits = [{"id": s, "strategy": s, "steps": STEPS, "data": mixture(corpus)} for s in ("ddp", "zero3")]
    vals = [{"id": s, "strategy": s, "steps": 2, "val_data": corpus["val"], "eval_every": 2, "val_batches": 2,
             **PIPELINED.get(s, {})} for s in ("single", "ddp", "zero3", "pp")]
    if HAS_TRANSFORMERS:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(WORKER)), "models"))
        from hf_configs import write_config

        hf = {"model": f"hf:{write_config(tmp_path_factory.mktemp('hf'), 'llama', vocab_size=320)}",
              "vocab_size": None}
        masks += [{"id": case, **fields, **hf} for case, fields in TRANSFORMERS.items()]
        masks += [{"id": f"{case}-fault", **fields, **hf, "fault": True} for case, fields in TRANSFORMERS.items()]
    verifies = [{"id": case, **fields, "steps": 3, "data": mixture(corpus)} for case, fields in VERIFIED.items()]
    return launch(2, {"base": base, "masks": masks, "fits": fits, "vals": vals, "verifies": verifies},
                  tmp_path_factory)


def launch(nproc: int, spec: dict, tmp_path_factory) -> dict:
    """doc_worker.run(spec) on `nproc` ranks forked from this process's warm forkserver (reliability/inproc.py)."""
    (tmp_path_factory.mktemp("docs") / "spec.json").write_text(json.dumps(spec))  # to rerun: torchrun doc_worker.py
    if os.path.dirname(WORKER) not in sys.path:
        sys.path.insert(0, os.path.dirname(WORKER))  # the ranks import doc_worker by name (they get this sys.path)
    import doc_worker

    report = launch_here(doc_worker.run, (spec,), nproc, timeout_s=120.0)
    assert report is not None
    return report


# the composed mesh: FSDP over 2 ranks, each pair splitting the sequence with the ring (4 ranks)
COMPOSED = {"strategy": "cp-ring", "dp_shard": 2, "cp": 2}


@pytest.fixture(scope="module")
def composed(corpus, tmp_path_factory):
    base = {"data": corpus["a"], "tokenizer": corpus["tok"], "vocab_size": 320, "seq_len": 64, "global_batch": 4}
    masks = [{"id": "dp_shard2xcp2", **COMPOSED}, {"id": "dp_shard2xcp2-fault", **COMPOSED, "fault": True}]
    verifies = [{"id": "dp_shard2xcp2", **COMPOSED, "steps": 3, "data": mixture(corpus)}]
    return launch(4, {"base": base, "masks": masks, "fits": [], "vals": [], "verifies": verifies}, tmp_path_factory)


def test_composed_mesh_masks_documents_and_verifies(composed):
    result, faulted = composed["masks"]["dp_shard2xcp2"], composed["masks"]["dp_shard2xcp2-fault"]
    assert result["boundaries"] >= 4 and result["inside_ring_blocks"] >= 1
    assert result["loss"] == pytest.approx(result["reference"], rel=1e-5)
    assert abs(faulted["loss"] - faulted["reference"]) > 5e-5 * faulted["reference"]
    report = composed["verifies"]["dp_shard2xcp2"]
    assert report["passed"] and report["steps"] == 3 and report["first_divergence"] is None, report


@pytest.mark.parametrize("case", [*MASKED, "ddp-accumulate", *PIPELINED])
def test_packed_loss_equals_each_document_alone(group, case):
    result = group["masks"][case]
    assert result["boundaries"] >= 4 and result["inside_ring_blocks"] >= 1  # a document ends inside a block
    assert result["loss"] == pytest.approx(result["reference"], rel=1e-5), case


@pytest.mark.parametrize("case", FAULTED)
def test_dropped_mask_fails(group, case):
    result = group["masks"][f"{case}-fault"]
    assert abs(result["loss"] - result["reference"]) > 5e-5 * result["reference"], case


@pytest.mark.parametrize("case", TRANSFORMERS)
def test_transformers_model_packed_loss_equals_each_document_alone(group, case):
    pytest.importorskip("transformers")
    result, faulted = group["masks"][case], group["masks"][f"{case}-fault"]
    assert result["loss"] == pytest.approx(result["reference"], rel=1e-5), case
    assert abs(faulted["loss"] - faulted["reference"]) > 5e-5 * faulted["reference"], case


def test_val_loss_is_the_same_under_single_ddp_zero3_and_pp(group):
    vals = group["vals"]
    for strategy in ("ddp", "zero3", "pp"):
        assert vals[strategy] == pytest.approx(vals["single"], rel=1e-5), strategy


@pytest.mark.parametrize("case", VERIFIED)
def test_verify_passes_on_packed_rows(group, case):
    report = group["verifies"][case]
    assert report["passed"] and report["steps"] == 3 and report["first_divergence"] is None, report


def last_losses(metrics) -> dict[int, float]:
    """step -> loss, the last record of each step (a restarted run logs the replayed steps again)."""
    out = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_sigkill_resume_is_bit_identical(cli_here, group, corpus, tmp_path, strategy):
    # in this process: the ranks (and their restarts) fork from the warm forkserver; their output in stderr
    proc = cli_here("train", "--strategy", strategy, "--nproc", "2", "--device", "cpu", "--data", mixture(corpus),
                    "--tokenizer", corpus["tok"], "--vocab-size", "320", "--seq-len", "64", "--global-batch", "4",
                    "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--ckpt-dir", "ck", "--resume", "auto",
                    "--out", "run", "--max-restarts", "1", "--timeout-s", "120",
                    env=plugin_env("support.kill_stall:plugin", PARATRAIN_FAULT_KILL=KILL), ranks=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from ck/step-2 (step 2)" in proc.stderr
    losses = last_losses(tmp_path / "run" / "metrics.jsonl")
    reference = group["fits"][strategy]["losses"]
    assert [losses[s] for s in range(1, STEPS + 1)] == reference  # exactly: not approx


def test_summary_reports_the_tokens_drawn_per_source(group, corpus):
    drawn = group["fits"]["ddp"]["tokens_per_source"]
    assert set(drawn) == {corpus["a"], corpus["b"]} and all(n > 0 for n in drawn.values())
    # every rank runs the same global stream, and it does not depend on the strategy
    assert group["fits"]["zero3"]["tokens_per_source"] == drawn

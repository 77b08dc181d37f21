"""Tied embeddings under pipeline parallelism (parallel/tied_weights.py), in-process and single-device: the last
stage's copy of the table, its name, and the grad norm that counts the shared weight once.

Parity with one device (verify, fp32 tolerances of verify/compare.py) runs in the shared process groups: GPT-2
under pp 1F1B and interleaved 1F1B, and dp_shard x tp-sp (tests/groups.py, tests/models/test_gpt2_strategies.py),
a tied Llama-style transformers config under tp-sp, dp_shard x tp-sp, pp 1F1B and interleaved
(tests/models/test_hf_verify.py); the planted fault "tied-grad-not-summed" (the copies' gradients not summed)
fails verify at step 1 (tests/bench/test_verify_mutations.py, test_hf_verify.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from paratrain.models.gpt2 import GPT2
from paratrain.models.hf_pipeline import hf_name
from paratrain.models.presets import get_preset
from paratrain.parallel.pp.pipeline_split import carve_stage, split_into_stages
from paratrain.parallel.tied_weights import is_tied_copy, mark_copy, tied_table_name
from paratrain.train.step import clip_grad_norm


def gpt2_stages(n_layers: int = 2, n_stages: int = 2):
    import dataclasses

    model = GPT2(dataclasses.replace(get_preset("gpt2-tiny"), n_layers=n_layers))
    model.init_weights(0)
    specs = split_into_stages(model, n_stages)
    return model, [carve_stage(model, spec) for spec in specs]


def test_last_stage_holds_an_identical_copy_named_as_the_table():
    model, (first, last) = gpt2_stages()
    table = model.tok_embeddings.tokens.weight
    assert tied_table_name(model) == "tokens.weight"
    assert first.tok_embeddings.tokens.weight is table and first.output is None
    assert last.output.weight is not table and torch.equal(last.output.weight, table)
    assert model.output.weight is table  # the whole model stays tied
    assert hf_name(last, "output.weight") == "tok_embeddings.tokens.weight"
    assert hf_name(last, "output") == "output"  # the head module keeps its own name (activation fingerprints)
    assert tied_table_name(first) is None and tied_table_name(last) is None


def test_middle_stages_hold_no_copy():
    _, stages = gpt2_stages(n_layers=4, n_stages=4)
    assert [s.output is not None for s in stages] == [False, False, False, True]
    assert not any(getattr(s, "tied_names", None) for s in stages[:-1])


def test_transformers_stage_copy_maps_to_its_token_table(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
    from hf_configs import write_config

    from paratrain.models.hf_model import build_hf_model
    from paratrain.models.hf_pipeline import pipeline_view
    from paratrain.models.hf_shape import hf_model_args

    spec = f"hf:{write_config(tmp_path, 'llama', tie_word_embeddings=True)}"
    view = pipeline_view(build_hf_model(spec), hf_model_args(spec))
    last = carve_stage(view, split_into_stages(view, 2)[-1])
    assert torch.equal(last.output.weight, view.tok_embeddings.weight)
    assert last.output.weight is not view.tok_embeddings.weight
    assert hf_name(last, "output.weight") == "hf.model.embed_tokens.weight"
    assert hf_name(last, "output") == "hf.lm_head"


def test_grad_norm_counts_the_shared_weight_once_and_clips_both_copies():
    table, copy, other = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    for p, g in ((table, [3.0, 0.0, 0.0]), (copy, [3.0, 0.0, 0.0]), (other, [0.0, 4.0, 0.0])):
        p.grad = torch.tensor(g)
    mark_copy(copy)
    assert is_tied_copy(copy) and not is_tied_copy(table)
    norm = clip_grad_norm([table, copy, other], max_norm=1.0)
    assert float(norm) == pytest.approx(5.0)  # sqrt(3^2 + 4^2): the copy is not counted again
    assert torch.allclose(copy.grad, table.grad) and float(table.grad[0]) == pytest.approx(3.0 / 5.0, rel=1e-5)

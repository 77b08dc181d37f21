"""generate's token choice (infer/sampling.py): temperature, top-k and top-p narrow the choice exactly as
transformers' logits warpers do (the reference: TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, in
generate's order); greedy takes the arg max; a prompt's random stream depends on (seed, index) only."""

from __future__ import annotations

import pytest
import torch

from paratrain.errors import UserError
from paratrain.infer.sampling import Sampling, choose_tokens, processed_scores, prompt_generator


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.5),
                                                     (1.0, 1, 1.0), (2.0, 0, 0.05)])
def test_processed_scores_match_transformers_warpers(temperature, top_k, top_p):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 256, generator=torch.Generator().manual_seed(0)) * 3
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    got = processed_scores(logits, Sampling(temperature, top_k, top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    kept = ~torch.isinf(want)
    torch.testing.assert_close(got[kept], want[kept])


def test_greedy_takes_the_arg_max_and_reports_the_models_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 2.0, -1.0]])
    tokens, logprobs = choose_tokens(logits, Sampling(), [None, None])
    assert tokens.tolist() == [1, 0]  # a tie: the lowest id
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[[0, 1], [1, 0]])


def test_a_prompts_stream_depends_on_seed_and_index_only():
    def draws(seed, index):
        return torch.rand(8, generator=prompt_generator(seed, index)).tolist()

    assert draws(3, 5) == draws(3, 5)
    assert draws(3, 5) != draws(3, 6) and draws(3, 5) != draws(4, 5)
    logits = torch.zeros(2, 50)
    sampling = Sampling(1.0, seed=3)
    together, _ = choose_tokens(logits, sampling, [prompt_generator(3, 0), prompt_generator(3, 1)])
    alone, _ = choose_tokens(logits[1:], sampling, [prompt_generator(3, 1)])
    assert together[1] == alone[0]  # the row's neighbours in its batch change nothing


@pytest.mark.parametrize("args,needle", [((0.0, 5, None, None), "--temperature 0"),
                                         ((0.0, None, 0.9, None), "--top-p samples"),
                                         ((-1.0, None, None, None), "--temperature must be"),
                                         ((1.0, 0, None, None), "--top-k must be"),
                                         ((1.0, None, 0.0, None), "--top-p must be")])
def test_bad_sampling_options(args, needle):
    with pytest.raises(UserError, match=needle):
        Sampling.of(*args)

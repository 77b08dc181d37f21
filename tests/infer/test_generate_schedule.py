"""How generate deals prompts to data-parallel ranks and batches (infer/generate.py): every prompt on exactly one
rank, batches of one length and at most --batch-size, and every rank the same number of rounds (filler rounds
for a rank with fewer batches), so that ranks whose forwards are collectives stay in lock step."""

from __future__ import annotations

import pytest

from paratrain.infer.generate import FILLER, schedule
from paratrain.infer.prompts import Prompt

LENGTHS = [6, 6, 6, 9, 3, 6, 9, 12, 6, 6, 3]


@pytest.mark.parametrize("dp,batch_size", [(1, 16), (2, 2), (3, 1), (4, 3), (8, 16)])
def test_each_prompt_once_batches_of_one_length_equal_rounds(dp, batch_size):
    prompts = [Prompt(i, tuple(range(n))) for i, n in enumerate(LENGTHS)]
    ranks = [schedule(prompts, dp, r, batch_size) for r in range(dp)]
    assert len({len(rounds) for rounds in ranks}) == 1  # lock step
    dealt = [p.index for rounds in ranks for batch in rounds for p in batch if p is not FILLER]
    assert sorted(dealt) == list(range(len(LENGTHS)))  # no prompt lost, none twice
    for rounds in ranks:
        for batch in rounds:
            assert len(batch) <= batch_size and len({len(p.ids) for p in batch}) == 1
            assert batch == [FILLER] or FILLER not in batch


def test_the_default_verify_prompts_give_rank_0_a_filler_round():
    prompts = [Prompt(i, tuple(range(n))) for i, n in enumerate((6, 6, 6, 9))]
    assert [[p.index for p in b] for b in schedule(prompts, 2, 0, 16)] == [[0, 2], [-1]]
    assert [[p.index for p in b] for b in schedule(prompts, 2, 1, 16)] == [[1], [3]]

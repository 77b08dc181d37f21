"""Choosing the next token from the model's logits: greedy (the default), or sampled with a temperature, top-k and
top-p, from a random stream that belongs to the prompt (its index in the input), so that how prompts are split over
data-parallel ranks or batched never changes what a prompt draws.

The processing follows transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper (in that order,
at least one token kept). The logprob reported for a token is the model's own: log_softmax of the raw logits,
whatever the sampling options, so outputs compare across runs with different options.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paratrain.errors import UserError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    seed: int = 0

    @classmethod
    def of(cls, temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None) -> Sampling:
        """The options as given on the command line (None: not given); one UserError line for a bad set."""
        temperature = 0.0 if temperature is None else float(temperature)
        if not np.isfinite(temperature) or temperature < 0:
            raise UserError(f"--temperature must be 0 (greedy) or positive, got {temperature}")
        if temperature == 0 and (top_k is not None or top_p is not None):
            given = " and ".join(f for f, v in (("--top-k", top_k), ("--top-p", top_p)) if v is not None)
            raise UserError(f"{given} samples, but --temperature 0 decodes greedily: give --temperature T > 0 "
                            f"with {given}, or drop {given}")
        if top_k is not None and top_k < 1:
            raise UserError(f"--top-k must be at least 1, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {top_p}")
        return cls(temperature, top_k or 0, 1.0 if top_p is None else float(top_p), 0 if seed is None else int(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        return ", ".join(parts) + f", seed {self.seed}"


def prompt_generator(seed: int, index: int) -> torch.Generator:
    """Prompt `index`'s own random stream: seeded from (seed, index) through numpy's SeedSequence, so streams of
    neighbouring prompts or seeds are unrelated."""
    state = np.random.SeedSequence([seed & 0xFFFFFFFF, index]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def processed_scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(batch, vocab) scores to sample from: divided by the temperature, then all but the top-k and the smallest
    set whose probability reaches top-p set to -inf."""
    scores = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(scores, descending=True, dim=-1)
        mass_before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)
        drop = mass_before >= sampling.top_p  # the first token has mass_before 0: always kept
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


def choose_tokens(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator | None]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprobs), each (batch,), from (batch, vocab) logits. Greedy: the arg max (the lowest id on a
    tie). Sampled: one draw per row from that row's generator (None: a row nobody reads, e.g. lock-step filler)."""
    logits = logits.detach().float().cpu()
    logprobs = logits.log_softmax(-1)
    if sampling.greedy:
        tokens = logits.argmax(-1)
    else:
        probs = processed_scores(logits, sampling).softmax(-1)
        tokens = torch.stack([torch.multinomial(row, 1, generator=gen).squeeze(0) if gen is not None
                              else row.argmax() for row, gen in zip(probs, generators)])
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """(batch,) the difference between each row's two largest logits (verify: a near-tie may flip)."""
    top = torch.topk(logits.detach().float().cpu(), 2, dim=-1).values
    return top[:, 0] - top[:, 1]


def choose_step(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator | None]
                ) -> tuple[torch.Tensor, list[int], list[float], list[float]]:
    """One decode step's choice for every row of (batch, vocab) logits: the tokens (batch,) as a tensor, the next
    step's input, and as lists what the outputs record: the tokens, their logprobs and the top-2 gaps. Greedy
    decoding stays on the logits' device and brings the three lists to the host in one copy (the same numbers as
    choose_tokens and top2_gap)."""
    if not sampling.greedy:
        tokens, logprobs = choose_tokens(logits, sampling, generators)
        return tokens, tokens.tolist(), logprobs.tolist(), top2_gap(logits).tolist()
    logits = logits.detach().float()
    tokens = logits.argmax(-1)
    logprobs = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    top = torch.topk(logits, 2, dim=-1).values
    host = torch.stack([tokens.double(), logprobs.double(), (top[:, 0] - top[:, 1]).double()]).cpu().tolist()
    return tokens, [int(t) for t in host[0]], host[1], host[2]

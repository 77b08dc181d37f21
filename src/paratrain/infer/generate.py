"""The generation loop on one rank: this data-parallel rank's prompts, in batches of one length (no padding, so
no batch changes a prompt's numbers), decoded token by token in lock step with every other rank.

Ranks in lock step: under FSDP, tensor or expert parallelism a forward is a collective (parameter all-gathers,
DTensor reductions, the experts' all-to-all), so every rank runs the same forwards: the same number of rounds
(one batch each; a rank out of prompts decodes a one-token filler row), and in each round a prefill, then one
decode step at a time while any rank still has a row running (an all-reduce of the running rows: ranks agree on
the end of every sequence). A row ends at --max-new-tokens or at the tokenizer's end-of-text token; finished rows
keep decoding with their batch, unread.

Each step's next-token logits are whole on every rank (a tensor-parallel head's vocab shards gathered), pass the
next_token_logits hooks (train/hooks.py), then choose a token (infer/sampling.py). The forwards use the KV cache
(infer/kv_cache.py) where the model supports it and --no-kv-cache is not given, else the whole sequence again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paratrain.infer.kv_cache import forward_step, new_cache, supports_cache, whole_logits
from paratrain.infer.prompts import Prompt
from paratrain.infer.sampling import Sampling, choose_step, prompt_generator
from paratrain.parallel.collective_hooks import collective
from paratrain.train.step import autocast_context

FILLER = Prompt(-1, (0,))  # a rank's row in a round where it has no prompt left


@dataclass(frozen=True)
class GenerateOptions:
    max_new_tokens: int
    sampling: Sampling = Sampling()
    batch_size: int = 16  # prompts per forward on each data-parallel rank
    use_cache: bool = True
    eos_id: int | None = None  # the tokenizer's end of text: a row that emits it ends


@dataclass
class Output:
    """One prompt's generation: the new tokens, their logprobs (log_softmax of the raw logits) and at each
    position the gap between the two largest logits (verify: a near-tie may flip between layouts)."""

    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


@dataclass
class RankRun:
    """What one rank generated and measured."""

    outputs: list[Output]
    ttft_s: list[float]  # per batch: prefill to its first tokens
    step_s: list[float]  # per decode step of a real batch
    seconds: float  # the whole loop
    cached: bool  # whether the KV cache ran


def rank_shares(prompts: list[Prompt], dp: int) -> list[list[Prompt]]:
    """Each data-parallel rank's prompts: in order of (length, index), dealt round-robin, so every rank gets
    within one prompt of the others and of each length."""
    ordered = sorted(prompts, key=lambda p: (len(p.ids), p.index))
    return [ordered[r::dp] for r in range(dp)]


def batches_of(share: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """`share` (in length order) cut into batches of one length, at most batch_size each."""
    out: list[list[Prompt]] = []
    for prompt in share:
        if out and len(out[-1]) < batch_size and len(out[-1][0].ids) == len(prompt.ids):
            out[-1].append(prompt)
        else:
            out.append([prompt])
    return out


def schedule(prompts: list[Prompt], dp: int, dp_rank: int, batch_size: int) -> list[list[Prompt]]:
    """This rank's batches, one per round, the rounds of every rank counted: a rank with fewer batches gets
    filler rounds ([FILLER]) so that all run the same forwards."""
    per_rank = [batches_of(share, batch_size) for share in rank_shares(prompts, dp)]
    rounds = max(len(b) for b in per_rank)
    mine = per_rank[dp_rank]
    return mine + [[FILLER]] * (rounds - len(mine))


class Decoder:
    """The model's next-token logits (batch, vocab; whole): with the KV cache, or the whole sequence each step."""

    def __init__(self, parts: list, layout, device: torch.device, dtype: str, use_cache: bool):
        self.parts, self.layout, self.device, self.dtype = parts, layout, device, dtype
        self.cached = use_cache and supports_cache(parts)
        self.cache, self.tokens = None, None
        # one device: inference mode skips autograd's bookkeeping on every op; under FSDP and DTensor no_grad,
        # since their parameters' version counters must go on counting
        self.grad_off = torch.inference_mode if layout.world == 1 else torch.no_grad

    def _forward(self, fn):
        with self.grad_off(), autocast_context(self.device.type, self.dtype, self.dtype != "fp32"):
            return fn()

    def prefill(self, tokens: torch.Tensor, max_len: int) -> torch.Tensor:
        tokens = tokens.to(self.device)
        if self.cached:
            self.cache = new_cache(self.parts, tokens.shape[0], max_len, self.layout)
            positions = torch.arange(tokens.shape[1], device=self.device)
            return self._forward(lambda: forward_step(self.parts, tokens, positions, self.cache))[:, -1]
        self.tokens = tokens
        return self._whole_sequence()

    def step(self, new: torch.Tensor) -> torch.Tensor:
        """The logits after appending `new` (batch,) to every row."""
        new = new.to(self.device)[:, None]
        if self.cached:
            position = torch.arange(self.cache.length, self.cache.length + 1, device=self.device)  # no host copy
            return self._forward(lambda: forward_step(self.parts, new, position, self.cache))[:, -1]
        self.tokens = torch.cat([self.tokens, new], dim=1)
        return self._whole_sequence()

    def _whole_sequence(self) -> torch.Tensor:
        return self._forward(lambda: whole_logits(self.parts[0](self.tokens)[:, -1:]))[:, -1]


class Agreement:
    """Whether any rank still has a running row: one all-reduce over every rank of the layout (none alone)."""

    def __init__(self, layout, device: torch.device):
        if layout.world > 1 and layout.world != dist.get_world_size():
            raise ValueError(f"generate runs a layout over every rank of the group: {layout.world} of "
                             f"{dist.get_world_size()}")
        self.group = dist.group.WORLD if layout.world > 1 else None
        self.device = device  # NCCL reduces device tensors only

    def any_running(self, rows: int) -> bool:
        return running_anywhere(rows, self.group, "world", self.device)


def running_anywhere(rows: int, group, group_name: str, device: torch.device) -> bool:
    """Whether any rank of `group` (None: this rank alone) has a running row: an all-reduce of the counts."""
    if group is None:
        return rows > 0
    count = torch.tensor([rows], dtype=torch.int64, device=device)
    collective("generate_running", group_name, "all_reduce", group, lambda: dist.all_reduce(count, group=group),
               (count,))
    return int(count.item()) > 0


def record_step(logits: torch.Tensor, opts: GenerateOptions, generators: list, outputs: list[Output],
                running: list[bool], count: int) -> torch.Tensor:
    """Step `count`'s tokens chosen from the next-token logits and appended to the rows still running (a row ends
    at --max-new-tokens or the end-of-text token); the chosen tokens (batch,), the next step's input."""
    chosen, tokens, logprobs, gaps = choose_step(logits, opts.sampling, generators)
    for row, out in enumerate(outputs):
        if running[row]:
            out.tokens.append(tokens[row])
            out.logprobs.append(logprobs[row])
            out.gaps.append(gaps[row])
            running[row] = count < opts.max_new_tokens and tokens[row] != opts.eos_id
    return chosen


def decode_batch(decoder: Decoder, batch: list[Prompt], opts: GenerateOptions, agreement: Agreement, hooks,
                 run: RankRun) -> None:
    """One round: `batch`'s prefill and decode steps, in lock step; real rows' outputs appended to run."""
    real = batch[0] is not FILLER
    gens = [prompt_generator(opts.sampling.seed, p.index) if real and not opts.sampling.greedy else None
            for p in batch]
    outputs = [Output(p.index) for p in batch]
    running = [real] * len(batch)
    tokens = torch.tensor([p.ids for p in batch], dtype=torch.long)
    start = time.perf_counter()
    logits = decoder.prefill(tokens, tokens.shape[1] + opts.max_new_tokens)
    for count in range(1, opts.max_new_tokens + 1):
        logits = hooks.apply_next_token_logits(logits, decoder.layout) if hooks is not None else logits
        chosen = record_step(logits, opts, gens, outputs, running, count)
        now = time.perf_counter()
        if real:
            (run.ttft_s if count == 1 else run.step_s).append(now - start)
        # every rank reaches --max-new-tokens at the same count: no need to ask then
        if count == opts.max_new_tokens or not agreement.any_running(sum(running)):
            break
        start = now
        logits = decoder.step(chosen)
    if real:
        run.outputs.extend(outputs)


def generate_on_rank(parts: list, layout, rank: int, device: torch.device, dtype: str, prompts: list[Prompt],
                     opts: GenerateOptions, hooks=None) -> RankRun:
    """This rank's share of `prompts` generated under `layout` (every rank of it calls this with the same
    prompts and options). `hooks`: the registry whose next_token_logits callbacks see each step's logits."""
    dp_rank = layout.dp_rank(rank) if layout.world > 1 else 0
    decoder = Decoder(parts, layout, device, dtype, opts.use_cache)
    agreement = Agreement(layout, device)
    run = RankRun([], [], [], 0.0, decoder.cached)
    start = time.perf_counter()
    for batch in schedule(prompts, layout.dp, dp_rank, opts.batch_size):
        decode_batch(decoder, batch, opts, agreement, hooks, run)
    run.seconds = time.perf_counter() - start
    return run

"""The generation loop under pipeline stages: each rank runs its own stage's layers, the stages joined by plain
point-to-point sends on the pp group (torch's PipelineStage fixes its shapes at the first micro-batch, and a
prefill's shapes are not a decode step's).

A round is one batch of a data-parallel rank's prompts (one length, at most --batch-size, as without pp), cut into
up to pp micro-batches: while the last stage chooses one micro-batch's next tokens, the earlier stages run the
others, so with pp micro-batches in flight every stage is busy at every decode step; the bubble is the prefill's
fill and the last step's drain. Each rank loops over (decode step, micro-batch) in the same order:

- the first stage embeds the micro-batch's tokens (the prompt, then the token its last step chose), a later stage
  receives the hidden states (a prefill's message carries their dtype and shape first);
- the stage runs its layers through its own KV cache (infer/kv_cache.py stage_forward: one cache per stage and
  micro-batch), or cache-free the whole sequence again where the stage cannot cache;
- the last stage's logits pass the next_token_logits hooks and choose the tokens (infer/sampling.py), and it
  sends them to every other stage with whether the micro-batch goes on: a row ends at --max-new-tokens or the
  end-of-text token, and a micro-batch goes on while any of its rows runs on any data-parallel replica (an
  all-reduce among the last stages), so every rank agrees when every sequence ended.

A data-parallel replica with fewer batches, or a batch cut into fewer micro-batches, runs filler micro-batches
(infer/generate.py FILLER) so that every replica's stages run the same forwards (FSDP's all-gathers). One stage
per rank: the interleaved schedules' virtual stages are refused (generate_run.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paratrain.infer.generate import (
    FILLER,
    GenerateOptions,
    Output,
    RankRun,
    batches_of,
    rank_shares,
    record_step,
    running_anywhere,
)
from paratrain.infer.kv_cache import KVCache, stage_forward, stage_supports_cache, whole_logits
from paratrain.infer.prompts import Prompt
from paratrain.infer.sampling import prompt_generator
from paratrain.parallel.collective_hooks import collective
from paratrain.train.step import autocast_context

HIDDEN_TAG, TOKENS_TAG = 1, 2  # the two kinds of message, each on its own channel
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cut(batch: list[Prompt], parts: int) -> list[list[Prompt]]:
    """`batch` in up to `parts` consecutive micro-batches of near-equal size."""
    parts = min(parts, len(batch))
    size, extra = divmod(len(batch), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        out.append(batch[start:stop])
        start = stop
    return out


def pipeline_rounds(prompts: list[Prompt], dp: int, dp_rank: int, batch_size: int, pp: int
                    ) -> list[list[list[Prompt]]]:
    """This data-parallel rank's rounds, each a list of micro-batches; every replica's rounds and micro-batch
    counts alike (filler micro-batches where it has fewer)."""
    per_rank = [batches_of(share, batch_size) for share in rank_shares(prompts, dp)]
    rounds = []
    for index in range(max(len(b) for b in per_rank)):
        cuts = [cut(b[index], pp) if index < len(b) else [] for b in per_rank]
        mine = cuts[dp_rank]
        rounds.append(mine + [[FILLER]] * (max(len(c) for c in cuts) - len(mine)))
    return rounds


@dataclass
class MicroBatch:
    """One micro-batch's state on this rank through a round."""

    prompts: list[Prompt]
    tokens: torch.Tensor  # (rows, length so far): the first stage's input history
    cache: KVCache | None
    real: bool
    outputs: list[Output] = field(default_factory=list)
    running: list[bool] = field(default_factory=list)
    generators: list = field(default_factory=list)
    goes_on: bool = True  # on the last stage: whether its last step asked for another
    wire_dtype: torch.dtype | None = None  # the hidden states' dtype from the previous stage
    last_token_at: float = 0.0


class StageLink:
    """This rank's stage and its neighbours on the pp group."""

    def __init__(self, runner, layout, device: torch.device, dtype: str, use_cache: bool):
        if len(runner.stages) != 1:
            raise ValueError("pipeline generation runs one stage per rank")
        stage = runner.stages[0]
        self.part, self.first, self.last = runner.model_parts[0], stage.is_first, stage.is_last
        self.device, self.dtype = device, dtype
        self.group = runner.pp_mesh.get_group()
        pp_rank = runner.pp_mesh.get_local_rank()
        self.prev = dist.get_global_rank(self.group, pp_rank - 1) if pp_rank > 0 else None
        self.next = dist.get_global_rank(self.group, pp_rank + 1) if pp_rank < layout.pp - 1 else None
        self.head = dist.get_global_rank(self.group, layout.pp - 1)
        self.others = [dist.get_global_rank(self.group, r) for r in range(layout.pp - 1)]
        self.dim = getattr(self.part, "module", self.part).args.dim
        self.cached = use_cache and stage_supports_cache(self.part)
        dp_mesh = layout.submesh("dp")
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None else None
        self.pending: list = []  # (work, tensor) of sends in flight

    def forward(self, mb: MicroBatch, inputs: torch.Tensor, start: int) -> torch.Tensor:
        with torch.no_grad(), autocast_context(self.device.type, self.dtype, self.dtype != "fp32"):
            positions = torch.arange(start, start + inputs.shape[1], device=self.device)
            if mb.cache is not None:
                return stage_forward(self.part, inputs, positions, mb.cache)
            return self.part(inputs, positions=positions.expand(inputs.shape[0], -1))

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        work = collective("generate handoff", "pp", "isend", self.group,
                          lambda: dist.isend(tensor, dst, group=self.group, tag=tag), (tensor,))
        self.pending.append((work, tensor))

    def send_hidden(self, hidden: torch.Tensor, prefill: bool) -> None:
        if hasattr(hidden, "full_tensor"):
            raise ValueError("a stage handed on a DTensor: generate under pp runs without sequence parallelism")
        hidden = hidden.contiguous()
        if prefill:  # the receiver learns the dtype once per micro-batch
            header = torch.tensor([DTYPES.index(hidden.dtype), *hidden.shape], dtype=torch.int64, device=self.device)
            self.send(header, self.next, HIDDEN_TAG)
        self.send(hidden, self.next, HIDDEN_TAG)

    def recv_hidden(self, mb: MicroBatch, seq: int) -> torch.Tensor:
        rows = mb.tokens.shape[0]
        if mb.wire_dtype is None:
            header = torch.empty(4, dtype=torch.int64, device=self.device)
            self._recv(header, self.prev, HIDDEN_TAG)
            mb.wire_dtype = DTYPES[int(header[0])]
        hidden = torch.empty(rows, seq, self.dim, dtype=mb.wire_dtype, device=self.device)
        self._recv(hidden, self.prev, HIDDEN_TAG)
        return hidden

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        collective("generate handoff", "pp", "recv", self.group,
                   lambda: dist.recv(tensor, src, group=self.group, tag=tag), (tensor,), src=src)

    def send_tokens(self, chosen: torch.Tensor, goes_on: bool) -> None:
        message = torch.cat([chosen.to(self.device), torch.tensor([int(goes_on)], device=self.device)])
        for rank in self.others:
            self.send(message, rank, TOKENS_TAG)

    def recv_tokens(self, rows: int) -> tuple[torch.Tensor, bool]:
        message = torch.empty(rows + 1, dtype=torch.int64, device=self.device)
        self._recv(message, self.head, TOKENS_TAG)
        return message[:rows], bool(message[rows])

    def any_replica_running(self, rows: int) -> bool:
        return running_anywhere(rows, self.dp_group, "dp", self.device)

    def drain(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []


def new_micro_batch(link: StageLink, prompts: list[Prompt], opts: GenerateOptions) -> MicroBatch:
    real = prompts[0] is not FILLER
    tokens = torch.tensor([p.ids for p in prompts], dtype=torch.long, device=link.device)
    cache = None
    if link.cached:
        cache = KVCache(len(prompts), tokens.shape[1] + opts.max_new_tokens, link.device)
    mb = MicroBatch(prompts, tokens, cache, real)
    if link.last:
        mb.outputs = [Output(p.index) for p in prompts]
        mb.running = [real] * len(prompts)
        mb.generators = [prompt_generator(opts.sampling.seed, p.index) if real and not opts.sampling.greedy else None
                         for p in prompts]
    return mb


def stage_step(link: StageLink, mb: MicroBatch, step: int) -> torch.Tensor:
    """This stage's forward of the micro-batch's step (0: the prefill), its output sent on to the next stage."""
    length = mb.tokens.shape[1]
    # with the cache a decode step feeds the newest token, without it the whole sequence again
    start = 0 if step == 0 or mb.cache is None else length - 1
    if link.first:
        inputs = mb.tokens[:, start:]
    else:
        inputs = link.recv_hidden(mb, length - start)
    out = link.forward(mb, inputs, start)
    if not link.last:
        link.send_hidden(out, prefill=step == 0)
    return out


def choose(link: StageLink, mb: MicroBatch, logits: torch.Tensor, opts: GenerateOptions, hooks, layout,
           count: int, run: RankRun) -> torch.Tensor:
    """The last stage: the micro-batch's next tokens, its real rows' outputs and timing recorded."""
    logits = hooks.apply_next_token_logits(logits, layout) if hooks is not None else logits
    chosen = record_step(logits, opts, mb.generators, mb.outputs, mb.running, count)
    now = time.perf_counter()
    if mb.real:
        (run.ttft_s if count == 1 else run.step_s).append(now - mb.last_token_at)
    mb.last_token_at = now
    return chosen


def run_round(link: StageLink, micro: list[list[Prompt]], opts: GenerateOptions, hooks, layout, run: RankRun
              ) -> None:
    """One round's micro-batches decoded through the pipeline, step by step; real outputs appended to run."""
    batches = [new_micro_batch(link, prompts, opts) for prompts in micro]
    started = time.perf_counter()
    for mb in batches:
        mb.last_token_at = started
    active = list(batches)
    step = 0
    while active:
        for mb in list(active):
            if step > 0 and not goes_on(link, mb, step, opts):
                active.remove(mb)
                continue
            out = stage_step(link, mb, step)
            if link.last:
                count = step + 1
                chosen = choose(link, mb, whole_logits(out)[:, -1], opts, hooks, layout, count, run)
                mb.tokens = torch.cat([mb.tokens, chosen.to(link.device)[:, None]], dim=1)
                if count < opts.max_new_tokens:
                    mb.goes_on = link.any_replica_running(sum(mb.running))
                    link.send_tokens(chosen, mb.goes_on)
        step += 1
    link.drain()
    if link.last:
        run.outputs.extend(out for mb in batches if mb.real for out in mb.outputs)


def goes_on(link: StageLink, mb: MicroBatch, step: int, opts: GenerateOptions) -> bool:
    """Whether the micro-batch runs `step` (> 0): every stage reaches --max-new-tokens at the same step; before it,
    the last stage's word (with the tokens the first stage feeds next)."""
    if step >= opts.max_new_tokens:
        return False
    if link.last:
        return mb.goes_on
    chosen, more = link.recv_tokens(mb.tokens.shape[0])
    mb.tokens = torch.cat([mb.tokens, chosen[:, None]], dim=1)  # a later stage only counts the length
    return more


def pipeline_generate_on_rank(runner, layout, rank: int, device: torch.device, dtype: str, prompts: list[Prompt],
                              opts: GenerateOptions, hooks=None) -> RankRun:
    """This rank's part of generating `prompts` under a pipeline layout (every rank of it calls this with the
    same prompts and options). `runner`: the trainer's PipelineStep (its stages and model parts). The outputs
    are on the last stage's ranks."""
    link = StageLink(runner, layout, device, dtype, opts.use_cache)
    run = RankRun([], [], [], 0.0, link.cached)
    start = time.perf_counter()
    for micro in pipeline_rounds(prompts, layout.dp, layout.dp_rank(rank), opts.batch_size, layout.pp):
        run_round(link, micro, opts, hooks, layout, run)
    run.seconds = time.perf_counter() - start
    return run

"""The price of generation under one layout (tp x pp x dp): memory per device and time per decode step.

Memory per device: the weights paratrain's generate holds (the training model's fp32 parameters; --dtype is the
compute and KV-cache dtype), the KV cache of each sequence (layers x 2 x kv_heads x head_dim x seq x dtype bytes,
tp dividing the kv heads and pp the layers) with its slot positions, and the prefill's largest transient (a block's
activations or the prompt's logits, whichever is larger). The largest batch is what the memory left after the
weights holds.

Time per decode step: memory bound at small batch (the weights and the cache read once per step, over the
device's memory bandwidth), compute bound at large batch (2 x params x batch FLOPs over the matmul rate),
whichever is larger, or the host's per-op cost where that is larger (a CPU, a small model); plus the layout's
communication per token: two all-reduces per layer and the vocab gather under tp, the sends between stages
under pp. A pipeline decodes its rows in pp micro-batches, each passing every stage in turn: a row waits for
all pp stages per token, while the stages work on the other micro-batches meanwhile.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from paratrain.costs.hardware import HardwareProfile
from paratrain.errors import UserError, flag_of
from paratrain.models.args import ModelArgs

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
WEIGHT_BYTES = 4  # generate runs the training model, whose parameters are fp32 (autocast computes in --dtype)
POSITION_BYTES = 8  # the cache's per-slot position (int64, one per row and slot)
OPS_PER_LAYER = 30  # tensor ops one decode step runs per block (norms, projections, rope, attention, MLP)


@dataclass(frozen=True)
class InferenceShape:
    """What a generate run asks: prompt tokens and new tokens per sequence, and sequences at once."""

    prompt_len: int
    new_tokens: int
    batch: int | None = None  # sequences per data-parallel replica; None: the largest that fits

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.new_tokens


def roles_of(layout) -> dict[str, int]:
    """How `layout` (a parallel.layout.Layout) divides generation: {"heads", "stages", "replicas"}, each the
    product of the degrees of the dimensions whose technique plays that role (parallel/technique.py)."""
    from paratrain.parallel.dims import all_dims

    out = {"heads": 1, "stages": 1, "replicas": 1}
    degrees = layout.degrees()
    for d in all_dims():
        if d.technique.inference_role:
            out[d.technique.inference_role] *= degrees[d.name]
    return out


def layout_problem(args: ModelArgs, layout) -> str | None:
    """Why the model cannot be generated under `layout` (None: it can)."""
    from paratrain.parallel.dims import all_dims

    degrees = layout.degrees()
    for d in all_dims():
        if degrees[d.name] == 1:
            continue
        if not d.technique.inference_role:
            return f"{d.flag} {degrees[d.name]}: plan --inference prices heads, stages and replicas only"
        problem = d.technique.inference_problem(args, degrees[d.name])
        if problem:
            return problem
    return None


def layouts_for(gpus: int, fixed: dict[str, int]) -> list:
    """Every Layout of `gpus` devices over the dimensions generation prices (the first of each role: replicas
    as --dp-replicate), their degrees' product `gpus`, `fixed` degrees kept; the most heads split first."""
    from paratrain.parallel.dims import all_dims
    from paratrain.parallel.layout import Layout

    seen, dims = set(), []
    for d in all_dims():
        role = d.technique.inference_role
        if role and role not in seen and d.world_factor:
            seen.add(role)
            dims.append(d)
    priced = {d.name for d in dims}
    for name, degree in fixed.items():
        if name not in priced and degree != 1:
            raise UserError(f"{flag_of(name)} {degree}: plan --inference splits heads, stages and replicas "
                            f"({', '.join(flag_of(n) for n in sorted(priced))})")
    rows: list[dict[str, int]] = [{}]
    for d in dims:
        options = [fixed[d.name]] if d.name in fixed else [k for k in range(1, gpus + 1) if gpus % k == 0]
        rows = [{**r, d.name: k} for r in rows for k in options]
    layouts = [Layout(**r) for r in rows if math.prod(r.values()) == gpus]
    return sorted(layouts, key=lambda lay: (-roles_of(lay)["heads"], -roles_of(lay)["stages"]))


def kv_bytes_per_sequence(args: ModelArgs, split: dict, seq_len: int, dtype: str) -> float:
    """One sequence's cache on one device: its stage's layers, its share of the kv heads, and the slot positions."""
    layers = -(-args.n_layers // split["stages"])  # the fullest stage
    kv = layers * 2 * (args.kv_heads // split["heads"]) * args.head_dim * seq_len * DTYPE_BYTES[dtype]
    return kv + POSITION_BYTES * seq_len


def weight_bytes(params: int, args: ModelArgs, split: dict) -> float:
    """One device's parameters: the heads' split divides every matrix (the norms are a rounding); stages divide
    the blocks, the token table on the first stage and the head on the last (one device holds both when there
    is one stage)."""
    table = args.vocab_size * args.dim
    head = 0 if args.tie_embeddings else table
    stages = split["stages"]
    blocks = params - table - head
    ends = table + head if stages == 1 else max(table, head)
    local = blocks * -(-args.n_layers // stages) / args.n_layers + ends
    return local / split["heads"] * WEIGHT_BYTES


def prefill_transient_bytes(args: ModelArgs, split: dict, batch: int, prompt_len: int, dtype: str) -> float:
    """The prefill's largest short-lived tensors for one forward's rows (a pipeline's micro-batch): inside a block
    the MLP's hidden states (SwiGLU: gate, up, activation and product; GELU: two) beside the residual stream, or
    after the blocks the logits of every prompt position (fp32; under a heads split this rank's vocab shard, the
    gather's buffer and the whole put back together), whichever is larger."""
    act, heads = DTYPE_BYTES[dtype], split["heads"]
    rows = -(-batch // split["stages"])
    hidden = args.expert_dim if args.moe else args.ffn_dim
    states = 2 if args.family == "gpt2" else 4
    block = states * hidden / heads * act + 3 * args.dim * act
    logits = args.vocab_size * 4 * (1 + (1 + 1 / heads) * (heads > 1))
    return rows * prompt_len * max(block, logits)


@dataclass
class InferencePrice:
    dims: dict  # the layout's degrees
    label: str
    weights_bytes: float
    kv_cache_bytes_per_seq: float
    batch: int  # sequences per data-parallel replica priced
    max_batch: int  # the most that fit per replica
    memory_bytes: float  # per device at `batch`
    decode_step_s: float
    bound: str  # what limits a decode step: "memory", "compute" or "host"
    comm_s_per_token: float
    ttft_s: float
    tokens_per_s: float  # all replicas' output tokens per second at `batch`
    feasible: bool
    reasons: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def _link(profile: HardwareProfile) -> tuple[float, float]:
    """(bytes/s, seconds per hop) within a node."""
    return profile.link_gbs.get("intra", 1.0) * 1e9, profile.latency_us.get("intra", 10.0) * 1e-6


def comm_s(profile: HardwareProfile, args: ModelArgs, layout, rows: int, dtype: str) -> float:
    """One forward's communication for `rows` tokens: each technique's own term (parallel/technique.py)."""
    from paratrain.parallel.dims import all_dims

    degrees = layout.degrees()
    return sum(d.technique.inference_comm_s(args, degrees[d.name], rows, DTYPE_BYTES[dtype], _link(profile))
               for d in all_dims() if degrees[d.name] > 1)


def _host_s(profile: HardwareProfile, layers: float) -> float:
    scale = profile.overhead_scale if profile.overhead_scale is not None else profile.compute_scale
    return OPS_PER_LAYER * layers * profile.op_overhead_us["fwd"] * 1e-6 * scale


def _matmul_s(profile: HardwareProfile, flops: float, dtype: str) -> float:
    return flops / (profile.dtype_tflops[dtype] * 1e12) * profile.compute_scale


def decode_step(profile: HardwareProfile, args: ModelArgs, params: int, layout, batch: int, context: int,
                dtype: str) -> tuple[float, str, float]:
    """(seconds per output token of a row, what bounds it, of which communication) with `batch` rows per replica
    at `context` cached tokens."""
    split = roles_of(layout)
    heads, stages = split["heads"], split["stages"]
    rows = max(1, -(-batch // stages))  # a pipeline's micro-batch
    read = weight_bytes(params, args, split) + rows * kv_bytes_per_sequence(args, split, context, dtype)
    memory = read / (profile.mem_bw_gbs * 1e9)
    flops = 2 * params / (heads * stages) * rows + 4 * args.n_layers / stages * args.n_heads / heads * \
        args.head_dim * context * rows
    times = {"memory": memory, "compute": _matmul_s(profile, flops, dtype),
             "host": _host_s(profile, args.n_layers / stages)}
    bound = max(times, key=times.get)
    work = max(memory, times["compute"])
    # a GPU launches ahead (the launch cost hides under the work); a CPU runs each op's host part in turn
    stage_s = max(work, times["host"]) if profile.overhead_overlaps else work + times["host"]
    comm = comm_s(profile, args, layout, rows, dtype)
    # a row's token passes all the stages in turn (they work on the other micro-batches meanwhile)
    return stages * stage_s + comm, bound, comm


def prefill_time(profile: HardwareProfile, args: ModelArgs, params: int, layout, rows: int, prompt_len: int,
                 dtype: str) -> float:
    """Time to first token: the prompt's forward through every stage (compute bound unless small), with its
    communication for prompt_len tokens a row."""
    split = roles_of(layout)
    tokens = rows * prompt_len
    heads = split["heads"]
    flops = 2 * params / heads * tokens + 2 * args.n_layers * args.n_heads / heads * args.head_dim * prompt_len * tokens
    compute = _matmul_s(profile, flops, dtype)
    memory = weight_bytes(params, args, split) * split["stages"] / (profile.mem_bw_gbs * 1e9)
    host = _host_s(profile, args.n_layers)
    work = max(compute, memory, host) if profile.overhead_overlaps else max(compute, memory) + host
    return work + comm_s(profile, args, layout, tokens, dtype)


def price(profile: HardwareProfile, args: ModelArgs, params: int, layout, shape: InferenceShape,
          dtype: str) -> InferencePrice:
    """The layout's memory, largest batch, decode step and time to first token (module docstring)."""
    split = roles_of(layout)
    reasons = []
    weights = weight_bytes(params, args, split)
    kv = kv_bytes_per_sequence(args, split, shape.seq_len, dtype)
    capacity = profile.gpu.mem_gib * 2**30

    def memory_at(rows: int) -> float:
        return weights + rows * kv + prefill_transient_bytes(args, split, rows, shape.prompt_len, dtype)

    # a row's share of a prefill: a pipeline's micro-batch holds 1 / stages of the rows
    per_row = kv + prefill_transient_bytes(args, split, split["stages"], shape.prompt_len, dtype) / split["stages"]
    max_batch = int((capacity - weights) // per_row) if capacity > weights else 0
    while max_batch > 0 and memory_at(max_batch) > capacity:  # a micro-batch's rounding
        max_batch -= 1
    batch = shape.batch if shape.batch is not None else max(1, max_batch)
    memory = memory_at(batch)
    feasible = memory <= capacity
    if weights > capacity:
        reasons.append(f"the weights alone ({weights / 2**30:.3g} GiB per device) exceed the "
                       f"{profile.gpu.mem_gib:g} GiB of memory")
    elif not feasible:
        reasons.append(f"batch {batch} needs {memory / 2**30:.3g} GiB per device; at most {max_batch} fit")
    context = shape.prompt_len + shape.new_tokens // 2  # the mean over the decode
    step, bound, comm = decode_step(profile, args, params, layout, batch, context, dtype)
    ttft = prefill_time(profile, args, params, layout, batch, shape.prompt_len, dtype)
    return InferencePrice(layout.degrees(), layout.describe(), weights, kv, batch, max_batch, memory, step, bound,
                          comm, ttft, batch * split["replicas"] / step if step > 0 else 0.0, feasible, reasons)

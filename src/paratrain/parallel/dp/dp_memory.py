"""Data parallelism's memory-cost term (the planner's plan/costing/memory.py asks it through the technique):
what the data-parallel wrapper does to one rank's traced states. FSDP2 shards parameters, gradients and
optimizer state over dp_shard x cp and holds the parameters it gathers; DDP's buckets hold one more copy of
the gradients; ZeRO-1 shards the optimizer state over the data-parallel ranks."""

from __future__ import annotations

GIB = 2**30


def autocast_weight_copies(tr, layers: int, dtype: str) -> float:
    """Autocast keeps a low-precision copy of every matmul weight the rank computes with from forward to
    backward; FSDP's bf16 policy gathers bf16 weights instead, so these copies are not made there. The weights
    it computes with are those that get a gradient (under --ep, not the other ranks' experts), and under LoRA the
    frozen base as well (autocast casts a frozen weight at every use, and a matmul saves the copy for its input's
    gradient)."""
    if dtype == "fp32":
        return 0.0
    frozen = tr.scalar("params", layers) - tr.scalar("trained_params", layers)  # 0 without LoRA
    return (tr.scalar("grads", layers) + frozen) / 2  # fp32 -> 16-bit: half the (matmul-dominated) parameter bytes


def others_experts(args, layout) -> float:
    """fp32 bytes of the experts of one MoE block that other ranks compute under --ep (the trace holds every
    expert's weights, plan/tracing/moe_trace.py split_experts)."""
    if not args.moe or layout.ep <= 1:
        return 0.0
    return 4.0 * 3 * args.dim * args.expert_dim * args.n_experts * (1 - 1 / layout.ep)


def gradient_shares(tr, args, layout) -> tuple[tuple[str, float], ...]:
    """The share of each unit's traced (fp32, unsharded) gradients a rank keeps after FSDP's reduce-scatter: 1 /
    shard degree; a block's own experts under --ep are sharded over the shard degree / ep ranks that hold the
    same experts (parallel/ep/expert_parallel.py apply_ep), so of those it keeps ep / shard degree."""
    f = layout.shard_degree
    block = 1.0 / f
    if args.moe and layout.ep > 1:  # the traced "block" is the MoE one (plan/costing/block_kinds.py)
        grads = tr.ut.seg("first", "block", "bwd").grads_end
        own = min(grads, 4.0 * 3 * args.dim * args.expert_dim * args.n_experts / layout.ep)  # fp32 weights
        block = ((grads - own) + own * layout.ep) / (f * grads) if grads else block
    return (("pre", 1.0 / f), ("dense", 1.0 / f), ("block", block), ("head", 1.0 / f))


def kept_gradients(tr, args, layout) -> tuple[tuple[str, float], ...] | None:
    """FSDP without gradient accumulation reduce-scatters each group's gradients once its backward is done and
    keeps the shard. With accumulation paratrain's runtime runs the micro-batches before the last without
    gradient sync (set_requires_gradient_sync(False)): FSDP keeps the unsharded gradients, in fp32, until then."""
    if layout.fsdp and layout.microbatches == 1:
        return gradient_shares(tr, args, layout)
    return None


def shard_states(s, tr, args, layout, part: str, layers: int, dtype: str, notes: list[str]) -> None:
    """Change the rank's states `s` (plan/costing/memory.py RankStates) in place as the data-parallel wrapper
    does; `tr`: the chunk's trace (plan/costing/compose.py Composed)."""
    if layout.fsdp:
        f = layout.shard_degree
        mixed = dtype in ("bf16", "fp8")
        per_param = 2.0 if mixed else 4.0  # FSDP's unsharded copies are in the mixed-precision param dtype
        # FSDP gathers the rank's own experts only (--ep): the others' are another rank's to gather
        idle = others_experts(args, layout)
        unsharded_all = (s.params - idle * tr.counts(layers)["block"]) / 4.0 * per_param
        per_block = max(tr.unit_params("block") - idle, tr.unit_params("dense")) / 4.0 * per_param
        head = part in ("whole", "last")
        if layout.zero_stage == 2:
            held = unsharded_all  # reshard_after_forward=False: every gathered parameter waits for backward
        else:
            # ZeRO-3 gathers a block for its forward and again for its backward, and prefetches the next one.
            # The norm + head stay gathered from their forward to their backward (data_parallel.apply_fsdp), so
            # the loss over the logits (often the traced peak) sees them unsharded. The traced peak competes
            # with these moments: take the highest.
            head_bytes = (args.vocab_size * args.dim / layout.tp + args.dim) * per_param if head else 0.0
            # a group being gathered exists twice for a moment (all-gather buffer + unsharded copy), next to
            # the group in use (or the one prefetched)
            moments = [tr.scalar("block_fwd_mark", layers, s.kept) + 3 * per_block,
                       tr.scalar("block_bwd_mark", layers, s.kept) + 3 * per_block]
            if head:
                # the loss with the head held, and the head's backward with the last block being gathered
                moments += [tr.scalar("head_peak", layers, s.kept) + head_bytes,
                            tr.scalar("head_bwd_mark", layers, s.kept) + head_bytes + 2 * per_block]
            # the marks come from the first micro-batch; later ones also hold the accumulated gradients
            accumulated = s.fb.grads - tr.phase("first_mb", layers, s.kept).grads
            traced_peak = s.fb.total - s.fb.optimizer  # the marks were taken without optimizer state
            held = max(0.0, max(moments) + accumulated - traced_peak)
        if mixed:
            copies = autocast_weight_copies(tr, layers, dtype)
            s.fb.rest = max(0.0, s.fb.rest - copies)
            # of those, the activations hold the ones an op saved for its backward (the others are freed as the
            # forward leaves autocast; under activation checkpointing, most)
            s.acts = max(0.0, s.acts - max(0.0, copies - tr.scalar("autocast_freed", layers)))
        # gradients at the peak: those of the unit whose backward runs, unsharded, beside the shards kept of the
        # units done (s.kept), or all unsharded when micro-batches accumulate without sync (kept_gradients)
        s.grads_live = float(s.fb.grads)
        # at the step every gradient is a reduce-scattered fp32 shard
        s.params, s.optimizer = s.params / f, s.optimizer / f
        s.grads = tr.scalar("grads", layers, gradient_shares(tr, args, layout))
        s.opt_rest /= f
        s.extra = held
        notes.append(f"FSDP shards params/grads/optimizer {f} ways; {held / GIB:.2f} GiB of unsharded "
                     f"{'bf16' if mixed else 'fp32'} parameters held at the peak")
        if s.kept is None and layout.microbatches > 1:
            notes.append(f"gradient accumulation: the micro-batches before the last run without gradient sync, so "
                         f"FSDP holds this part's {tr.scalar('grads', layers) / GIB:.2f} GiB of gradients unsharded "
                         "in fp32 until the last one")
    elif layout.ddp or layout.dp_replicate > 1:
        # DDP's buckets (gradient_as_bucket_view) hold one copy of the gradients for the whole run; gradients
        # accumulated under no_sync, and those just computed, are separate tensors until copied in
        s.grads_live = float(s.fb.grads) + s.grads
        if layout.zero_stage == 1:
            s.optimizer /= layout.dp
            s.opt_rest /= layout.dp

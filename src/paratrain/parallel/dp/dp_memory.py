"""Data parallelism's memory-cost term (the planner's plan/costing/memory.py asks it through the technique):
what the data-parallel wrapper does to one rank's traced states. FSDP2 shards parameters, gradients and
optimizer state over dp_shard x cp and holds the parameters it gathers; DDP's buckets hold one more copy of
the gradients; ZeRO-1 shards the optimizer state over the data-parallel ranks."""

from __future__ import annotations

GIB = 2**30


def autocast_weight_copies(tr, layers: int, dtype: str) -> float:
    """Autocast keeps a low-precision copy of every matmul weight from forward to backward; FSDP's bf16 policy
    gathers bf16 weights instead, so these copies are not made there."""
    if dtype == "fp32":
        return 0.0
    return tr.scalar("params", layers) / 2  # fp32 -> 16-bit: half the (matmul-dominated) parameter bytes


def shard_states(s, tr, args, layout, part: str, layers: int, dtype: str, notes: list[str]) -> None:
    """Change the rank's states `s` (plan/costing/memory.py RankStates) in place as the data-parallel wrapper
    does; `tr`: the chunk's trace (plan/costing/compose.py Composed)."""
    if layout.fsdp:
        f = layout.shard_degree
        mixed = dtype in ("bf16", "fp8")
        per_param = 2.0 if mixed else 4.0  # FSDP's unsharded copies are in the mixed-precision param dtype
        unsharded_all = s.params / 4.0 * per_param
        per_block = tr.per_block_params() / 4.0 * per_param
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
            moments = [tr.scalar("block_fwd_mark", layers) + 3 * per_block,
                       tr.scalar("block_bwd_mark", layers) + 3 * per_block]
            if head:
                # the loss with the head held, and the head's backward with the last block being gathered
                moments += [tr.scalar("head_peak", layers) + head_bytes,
                            tr.scalar("head_bwd_mark", layers) + head_bytes + 2 * per_block]
            # the marks come from the first micro-batch; later ones also hold the accumulated gradients
            accumulated = s.fb.grads - tr.phase("first_mb", layers).grads
            traced_peak = s.fb.total - s.optimizer  # the marks were taken without optimizer state
            held = max(0.0, max(moments) + accumulated - traced_peak)
        if mixed:
            s.fb.rest = max(0.0, s.fb.rest - autocast_weight_copies(tr, layers, dtype))
        # gradients at the peak are the unsharded ones being computed (or accumulated unsynced over micro-batches)
        # exactly as traced; the sharded ones appear only after each block's reduce-scatter
        s.grads_live = float(s.fb.grads)
        s.params, s.optimizer, s.grads = s.params / f, s.optimizer / f, s.grads / f
        s.opt_rest /= f
        s.extra = held
        notes.append(f"FSDP shards params/grads/optimizer {f} ways; {held / GIB:.2f} GiB of unsharded "
                     f"{'bf16' if mixed else 'fp32'} parameters held at the peak")
    elif layout.ddp or layout.dp_replicate > 1:
        # DDP's buckets (gradient_as_bucket_view) hold one copy of the gradients for the whole run; gradients
        # accumulated under no_sync, and those just computed, are separate tensors until copied in
        s.grads_live = float(s.fb.grads) + s.grads
        if layout.zero_stage == 1:
            s.optimizer /= layout.dp
            s.opt_rest /= layout.dp

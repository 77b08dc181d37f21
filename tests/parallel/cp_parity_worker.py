# Multi-rank checks for context parallel attention, run in ONE process group of 4 ranks (gloo, CPU):
# ring and Ulysses vs full-sequence causal SDPA (the reference), outputs and input gradients, cp = 2 and 4.
"""Usage: python cp_parity_worker.py -> one JSON line of results (from rank 0); non-zero exit on failure.
The suite runs run_checks inside its shared 4-rank group instead (tests/groups.py, dp_worker.py's "cp_parity")."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.errors import UserError
from paratrain.parallel.cp import ring_attention as ring_module
from paratrain.parallel.cp.ring_attention import ring_attention, zigzag_positions
from paratrain.parallel.cp.ulysses import ulysses_attention

WORLD = 4
ATOL = 1e-5  # fp32: reference is F.scaled_dot_product_attention(is_causal=True) on the full sequence
IMPLS = {"ring": ring_attention, "ulysses": ulysses_attention}


def reference(seed: int, shape):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64).float() for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dout)
    return (q, k, v, dout), (out.detach(), q.grad, k.grad, v.grad)


def check_parity(impl: str, cp: int, group, group_rank: int, seed: int, shape) -> float:
    """Max abs error of (out, dq, dk, dv) on this rank's shard against the full reference."""
    (q, k, v, dout), expected = reference(seed, shape)
    idx = zigzag_positions(shape[2], cp, group_rank)
    local = [t.detach().index_select(2, idx).clone().requires_grad_() for t in (q, k, v)]
    out = IMPLS[impl](*local, group=group)
    out.backward(dout.index_select(2, idx))
    got = (out.detach(), local[0].grad, local[1].grad, local[2].grad)
    return max(float((g - e.index_select(2, idx)).abs().max()) for g, e in zip(got, expected))


def expect_user_error(fn) -> str:
    try:
        fn()
    except UserError as exc:
        return str(exc)
    raise AssertionError("expected a UserError")


def main() -> dict:
    dist.init_process_group("gloo")
    merged = run_checks()
    dist.destroy_process_group()
    return merged


def run_checks() -> dict:
    """Every check, in the current 4-rank default group; the same result on every rank."""
    rank = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]  # every rank creates every group
    world = dist.group.WORLD
    results = {}
    # (batch, heads, seq, head_dim): seq 24 is a multiple of 2*cp for cp=2 and 4; 12 heads split 2 and 4 ways
    for impl in IMPLS:
        for cp, group, grank in ((2, pair, rank % 2), (4, world, rank)):
            for seq in (24, 48):
                err = check_parity(impl, cp, group, grank, seed=seq + cp, shape=(2, 12, seq, 16))
                results[f"{impl}_cp{cp}_seq{seq}"] = err
    # tiny query tiles: the tiled path (several row tiles per block) must give the same answer
    ring_module.TILE_SCORES = 2 * 12 * 12 * 5
    results["ring_cp4_seq48_tiled"] = check_parity("ring", 4, world, rank, seed=7, shape=(2, 12, 48, 16))
    ring_module.TILE_SCORES = 1 << 21
    # half precision inputs still compute in fp32 inside and return the input dtype
    bf = [torch.randn(1, 4, 8, 16).bfloat16().requires_grad_() for _ in range(3)]
    out = ring_attention(*bf, group=pair)
    out.sum().backward()
    results["ring_bf16_dtype_ok"] = out.dtype == torch.bfloat16 and bf[1].grad.dtype == torch.bfloat16
    # clear errors: sequence not a multiple of 2*cp, heads not divisible by cp (Ulysses)
    results["err_seq"] = expect_user_error(lambda: zigzag_positions(10, 4, rank))
    odd = torch.zeros(1, 6, 8, 4)
    results["err_heads"] = expect_user_error(lambda: ulysses_attention(odd, odd, odd, group=world))
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, results)
    merged = {k: (max(g[k] for g in gathered) if isinstance(v, float) else v) for k, v in gathered[0].items()}
    errors_ok = all(v <= ATOL for v in merged.values() if isinstance(v, float))
    merged["ok"] = errors_ok and merged["ring_bf16_dtype_ok"]
    return merged


if __name__ == "__main__":
    if "RANK" not in os.environ:  # the launcher: re-run this file on WORLD ranks
        from paratrain.train.launch import run_workers

        result = run_workers(main, (), WORLD, 0, 120.0)[0]
        print(json.dumps(result))
        sys.exit(0 if result["ok"] else 1)
    main()

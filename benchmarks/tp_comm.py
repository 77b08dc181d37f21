"""Measured tensor-parallel traffic per layer per training step, against the Megatron-LM expectation.

Megatron (Shoeybi et al. 2019; Korthikanti et al. 2022): each transformer layer does 4 all-reduces of b*s*h
activations per step (2 forward, 2 backward), each moving 2(t-1)/t of its payload per rank on a ring.
Sequence parallel replaces each all-reduce by an all-gather + reduce-scatter pair: the same volume.
Per-layer bytes are isolated by running the same model with 1 and 3 layers and taking the difference,
so the embedding, head and loss traffic cancel out. Run: python benchmarks/tp_comm.py [--tp 2|4]
"""

from __future__ import annotations

import argparse
import os
import sys

BATCH, SEQ, DIM = 4, 64, 64
LAYERS = (1, 3)


def measure(sp: bool, n_layers: int, tp_mesh, device) -> dict:
    """Collective bytes of one full training step (forward, backward, clip, AdamW) on this rank."""
    import torch

    from paratrain.models.llama import ModelArgs
    from paratrain.models.plans import tp_plan_for
    from paratrain.models.presets import build_model
    from paratrain.parallel.collective_bytes import count_collectives
    from paratrain.parallel.tp.tensor_parallel import apply_tp
    from paratrain.train.step import clip_grad_norm, lm_loss

    args = ModelArgs(name="bench", vocab_size=256, dim=DIM, n_layers=n_layers, n_heads=4, n_kv_heads=4, ffn_dim=192)
    model = build_model(args, "cpu", seed=0).to(device)
    model = apply_tp(model, tp_mesh, sp=sp, plan=tp_plan_for(model, tp_mesh.size(), sp=sp))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ + 1), generator=gen).to(device)
    with count_collectives() as stats:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
    return {"bytes": stats.total_bytes, "wire": stats.total_wire_bytes, "calls": dict(stats.calls_by_op),
            "by_op": dict(stats.bytes_by_op)}


def worker() -> dict:
    import torch.distributed as dist

    from paratrain.parallel.layout import Layout
    from paratrain.train.runtime import init_runtime, shutdown

    rt = init_runtime("cpu", 120.0)
    dims = Layout(tp=rt.world_size).with_mesh(rt.device_type)
    out = {}
    for sp in (False, True):
        out[sp] = {n: measure(sp, n, dims.submesh("tp"), rt.device) for n in LAYERS}
    dist.barrier()
    shutdown()
    return out


def report(results: dict, tp: int) -> None:
    elem_bytes = 4  # fp32 activations
    payload = BATCH * SEQ * DIM * elem_bytes
    expected_wire = 4 * payload * 2 * (tp - 1) / tp
    span = LAYERS[1] - LAYERS[0]
    print(f"TP traffic per layer per step, tp={tp}, b={BATCH} s={SEQ} h={DIM} fp32 "
          f"(Megatron: 4 x b*s*h x 2(t-1)/t = {expected_wire:,.0f} wire bytes per rank)")
    print(f"{'mode':<8}{'payload B/layer':>17}{'wire B/layer':>15}{'expected':>12}{'ratio':>8}  calls/layer")
    for sp, runs in results.items():
        lo, hi = runs[LAYERS[0]], runs[LAYERS[1]]
        wire = (hi["wire"] - lo["wire"]) / span
        byte = (hi["bytes"] - lo["bytes"]) / span
        calls = {k: (hi["calls"].get(k, 0) - lo["calls"].get(k, 0)) / span for k in hi["calls"]}
        calls_txt = ", ".join(f"{k} {v:g}" for k, v in sorted(calls.items()) if v)
        print(f"{'tp-sp' if sp else 'tp':<8}{byte:>17,.0f}{wire:>15,.0f}{expected_wire:>12,.0f}"
              f"{wire / expected_wire:>8.3f}  {calls_txt}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, choices=(2, 4))
    tp = parser.parse_args().tp
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from paratrain.train.launch import run_workers

    results = run_workers(worker, (), tp, 0, 120.0)[0]
    report(results, tp)


if __name__ == "__main__":
    sys.exit(main())

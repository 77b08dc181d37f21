"""Context parallel memory: per-rank peak activation bytes at one fixed sequence length, cp = 1, 2, 4.

Bytes are counted by a live-tensor tracker (a TorchDispatchMode that adds each new storage an op creates
and subtracts it when the storage is freed) around one forward + loss + backward. Parameters and their
.grad buffers exist before the tracker starts, so only activations, attention/communication buffers and
transient gradients count. cp=1 is the plain model (SDPA); cp=N runs N CPU processes (gloo), each holding
S/N tokens in the load-balanced layout. Target: cp=N <= 1/N + 10% of cp=1.

    python benchmarks/cp_memory.py                       # small model, seq 4096 (about a minute on 2 cores)
    python benchmarks/cp_memory.py --seq-len 2048 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Sum of the bytes of storages created under this mode and still alive; `peak` is its maximum."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = 0, 0
        self._refs: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        # storages keep their Python object while the C++ storage lives, so this fires when it is freed
        self._refs[key] = (weakref.ref(storage, lambda _, k=key: self._free(k)), nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        _, nbytes = self._refs.pop(key, (None, 0))
        self.live -= nbytes


def measure(model_name: str, seq_len: int, impl: str | None, group=None, rank: int = 0, cp: int = 1) -> int:
    """Peak live activation bytes of one training step's forward + backward on this rank."""
    import functools

    from paratrain.models.presets import build_model, get_preset
    from paratrain.parallel.cp.context_parallel import CP_ATTENTION
    from paratrain.parallel.cp.ring_attention import zigzag_positions
    from paratrain.train.step import lm_loss

    args = get_preset(model_name)
    model = build_model(args, "cpu", seed=0)
    for p in model.parameters():  # allocate .grad up front: gradients are not activations
        p.grad = torch.zeros_like(p)
    tokens = torch.randint(0, args.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets, extra = tokens[:, :-1], tokens[:, 1:], {}
    if impl is not None:
        attn_fn = functools.partial(CP_ATTENTION[impl], group=group)
        for block in model.layers.values():
            block.attention.attn_fn = attn_fn
        positions = zigzag_positions(seq_len, cp, rank)
        inputs, targets, extra = inputs[:, positions], targets[:, positions], {"positions": positions}
    with LiveBytes() as tracker:
        lm_loss(model(inputs, **extra), targets).backward()
    return tracker.peak


def cp_worker(model_name: str, seq_len: int, impl: str) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return measure(model_name, seq_len, impl, dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", default="1,2,4", help="comma-separated cp degrees (1 is the baseline)")
    parser.add_argument("--impl", default="ring,ulysses", help="ring, ulysses or both")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args(argv)

    from paratrain.train.launch import run_workers

    torch.set_num_threads(1)
    base = measure(opts.model, opts.seq_len, None)
    rows = [{"cp": 1, "impl": "sdpa", "tokens_per_rank": opts.seq_len, "peak_activation_bytes": base,
             "ratio": 1.0, "target": 1.0, "ok": True}]
    for cp in [int(x) for x in opts.cp.split(",") if int(x) > 1]:
        for impl in opts.impl.split(","):
            per_rank = run_workers(cp_worker, (opts.model, opts.seq_len, impl), cp, 0, 300.0)
            peak, target = max(per_rank.values()), 1 / cp + 0.10
            rows.append({"cp": cp, "impl": impl, "tokens_per_rank": opts.seq_len // cp,
                         "peak_activation_bytes": peak, "per_rank_bytes": [per_rank[r] for r in range(cp)],
                         "ratio": peak / base, "target": target, "ok": peak / base <= target})
    if opts.json:
        print(json.dumps({"model": opts.model, "seq_len": opts.seq_len, "rows": rows}))
    else:
        print(f"model {opts.model}, sequence {opts.seq_len} tokens, batch 1, fp32; max over ranks",
              file=sys.stderr)
        print(f"{'cp':>3} {'impl':>8} {'tokens/rank':>11} {'peak act MiB':>13} {'vs cp=1':>8} "
              f"{'target':>7}  ok")
        for r in rows:
            mib = r["peak_activation_bytes"] / 2**20
            print(f"{r['cp']:>3} {r['impl']:>8} {r['tokens_per_rank']:>11} {mib:>13.1f} "
                  f"{r['ratio']:>8.3f} {r['target']:>7.3f}  {'yes' if r['ok'] else 'NO'}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

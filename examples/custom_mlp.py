"""Your own nn.Module under paratrain: a small residual MLP learning a fixed nonlinear function.

Train it from the command line (the file's `build`, `data` and `loss_fn` are picked up by name):

    paratrain train --script examples/custom_mlp.py:build --strategy zero3 --nproc 2 --steps 40

or from Python, as below. `python examples/custom_mlp.py` is the example's verify: it trains the same model
with the same data under single, ddp and zero3, and checks that the loss curves agree (fp32, 1e-5 relative)
and that the loss fell. Exit 0 on success, 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

IN, HIDDEN = 8, 64
_TARGET = np.random.default_rng(1234).standard_normal((IN, 1)) / np.sqrt(IN)


class ResidualMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
                                    for _ in range(2))
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.layers:
            h = h + block(h)
        return self.out(h).sum(-1)  # (batch,); not squeeze(): FSDP warns about returning a view


def build() -> nn.Module:
    return ResidualMLP()


def data(indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i is a pure function of i, so every strategy sees the same global batches."""
    x = np.stack([np.random.default_rng(int(i)).standard_normal(IN) for i in indices])
    y = np.sin(3.0 * (x @ _TARGET)[:, 0]) + 0.1 * x[:, 0] ** 2
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs, targets)


def main() -> int:
    import paratrain

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    opts = parser.parse_args()
    common = {"steps": opts.steps, "global_batch": 32, "lr": 3e-3, "device": "cpu", "seed": 0, "timeout_s": 120.0}
    runs = {s: paratrain.fit(build, data, loss_fn=loss_fn, strategy=s, nproc=opts.nproc, **common)
            for s in ("single", "ddp", "zero3")}
    ref = runs["single"]["losses"]
    ok = ref[-1] < 0.75 * ref[0]
    print(f"single: loss {ref[0]:.4f} -> {ref[-1]:.4f}", file=sys.stderr)
    for name in ("ddp", "zero3"):
        got = runs[name]["losses"]
        worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref, got))
        ok = ok and len(got) == len(ref) and worst <= 1e-5
        print(f"{name}: loss {got[0]:.4f} -> {got[-1]:.4f}, max rel diff vs single {worst:.2e}", file=sys.stderr)
    print("verify PASSED" if ok else "verify FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

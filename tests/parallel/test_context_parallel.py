"""Context parallel: zigzag layout, ring / Ulysses parity with full causal SDPA, and `paratrain verify` runs.

References: attention parity is against F.scaled_dot_product_attention(is_causal=True) on the full sequence
(fp32, atol 1e-5 on outputs and input gradients); verify runs are against the single-device trainer with the
harness's fp32 tolerances.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from groups import verified
from paratrain.errors import UserError
from paratrain.parallel.cp.context_parallel import sequence_sharder
from paratrain.parallel.cp.cp_comm import CPComm
from paratrain.parallel.cp.cp_technique import check_cp
from paratrain.parallel.cp.ring_attention import ring_attention, zigzag_positions
from paratrain.parallel.cp.ulysses import ulysses_attention
from paratrain.parallel.layout import Layout


def test_zigzag_layout_balances_the_causal_work():
    seq, cp = 16, 4
    shards = [zigzag_positions(seq, cp, r) for r in range(cp)]
    assert shards[0].tolist() == [0, 1, 14, 15] and shards[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    # causal work of a rank = sum over its queries of (position + 1): equal on every rank
    assert len({int((s + 1).sum()) for s in shards}) == 1
    with pytest.raises(UserError, match=r"sequence length \(18\) to be a multiple of 2\*cp=8"):
        zigzag_positions(18, cp, 0)


def test_sequence_sharder_gives_global_positions():
    dims = SimpleNamespace(cp=2, submesh=lambda name: SimpleNamespace(get_local_rank=lambda: 1))
    inputs = torch.arange(16).view(2, 8)
    local_in, local_tg, extra = sequence_sharder(dims)(inputs, inputs + 100)
    assert extra["positions"].tolist() == [2, 3, 4, 5]
    assert local_in.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]] and local_tg[0, 0] == 102


def test_check_cp_names_heads_and_cp():
    args = SimpleNamespace(n_heads=4)
    check_cp(args, Layout(cp=4, cp_impl="ulysses"))
    check_cp(args, Layout(cp=8, cp_impl="ring"))  # ring does not split heads
    with pytest.raises(UserError, match="heads=2 is not divisible by cp=4"):
        check_cp(args, Layout(cp=4, tp=2, cp_impl="ulysses"))  # 4 heads / tp 2 = 2 local heads


@pytest.mark.timeout(500)
def test_ring_and_ulysses_match_full_sdpa_on_four_ranks(four_ranks):
    """cp_parity_worker.py in the shared 4-rank group: cp=2 (two pairs) and cp=4, seq 24 and 48, outputs +
    dq/dk/dv."""
    result = four_ranks["cp_parity"]
    assert result["ok"] is True, result  # every error within 1e-5 (the tiled ring path's too) and bf16 kept
    for impl in ("ring", "ulysses"):
        for cp in (2, 4):
            for seq in (24, 48):
                assert result[f"{impl}_cp{cp}_seq{seq}"] <= 1e-5, result
    assert result["ring_bf16_dtype_ok"] is True
    assert "multiple of 2*cp=8" in result["err_seq"] and "heads=6" in result["err_heads"]


class ThreadComm(CPComm):
    """cp ranks as threads of one process: every transfer is a hand-off through a mailbox per (to, what)."""

    def __init__(self, mail: defaultdict, size: int, rank: int):
        self.mail, self.size, self.rank = mail, size, rank
        self.steps: list[int] = []

    def ring_step(self, step: int) -> None:
        self.steps.append(step)

    def shift(self, tensor, tag):
        self.mail[((self.rank + 1) % self.size, tag)].put(tensor.clone())
        recv = torch.empty_like(tensor)
        box = self.mail[(self.rank, tag)]
        return recv, [SimpleNamespace(wait=lambda: recv.copy_(box.get(timeout=60)))]

    def all_to_all_single(self, out, inp):
        for j in range(self.size):
            self.mail[(j, "a2a", self.rank)].put(inp[j].clone())
        for j in range(self.size):
            out[j].copy_(self.mail[(self.rank, "a2a", j)].get(timeout=60))


@pytest.mark.parametrize("attention", [ring_attention, ulysses_attention])
def test_attention_runs_over_any_cp_comm(attention):
    """Ring and Ulysses take their communication as an object (what the planner stands in for): over 4
    threads handing tensors to each other they match full causal SDPA, outputs and input gradients."""
    cp, seq = 4, 32
    q, k, v = (torch.randn(2, 4, seq, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    mail, results, comms = defaultdict(queue.Queue), {}, [None] * cp

    def rank(r: int) -> None:
        pos = zigzag_positions(seq, cp, r)
        local = [t.detach().index_select(2, pos).requires_grad_() for t in (q, k, v)]
        comms[r] = ThreadComm(mail, cp, r)
        out = attention(*local, group=comms[r])
        out.pow(2).sum().backward()
        results[r] = (pos, out.detach(), [t.grad for t in local])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == cp
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True).detach()
    for pos, out, grads in results.values():
        assert torch.allclose(out, full.index_select(2, pos).to(out.dtype), atol=1e-5)
        for got, ref in zip(grads, want):
            assert torch.allclose(got, ref.index_select(2, pos), atol=1e-5)
    if attention is ring_attention:
        assert comms[0].steps == [0, 1, 2, 3] * 2  # the step hook: the forward's walk, then the backward's


def _verify(cli, *args: str, timeout: float = 280) -> dict:
    res = cli("verify", *args, "--json", timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    report = res.json()
    assert report["passed"] is True, report
    return report


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", ["cp-ring2", "cp-ulysses2"])
def test_verify_cp_two_ranks(two_ranks, case):
    report = verified(two_ranks, case)
    assert report["passed"] is True, report
    assert report["dims"]["cp"] == 2 and report["world_size"] == 2


@pytest.mark.timeout(500)
def test_verify_fsdp_times_cp_four_ranks(four_ranks):
    report = verified(four_ranks, "fsdp2xcp2")
    assert report["passed"] is True, report
    assert report["dims"]["dp_shard"] == 2 and report["dims"]["cp"] == 2


@pytest.mark.timeout(600)
def test_verify_three_d_mesh_eight_ranks(cli_here):
    """dp_shard 2 x cp 2 x tp 2: FSDP over dp_shard_cp, ring attention on each TP rank's local heads."""
    report = _verify(cli_here, "--strategy", "cp-ring", "--dp-shard", "2", "--cp", "2", "--tp", "2",
                     "--nproc", "8", "--steps", "2", "--timeout-s", "300", timeout=580)
    assert report["dims"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "ep": 1, "tp": 2}


def test_bad_cp_layouts_fail_before_launch(monkeypatch):
    """validate_run (what every command runs before starting processes) names the offending numbers."""
    from paratrain.config import load_config
    from paratrain.train.validate import validate_run

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError, match="heads=4 is not divisible by cp=8"):
        validate_run(load_config(None, {"strategy": "cp-ulysses", "nproc": 8}), 8)
    with pytest.raises(UserError, match=r"multiple of 2\*cp=4"):
        validate_run(load_config(None, {"strategy": "cp-ring", "nproc": 2, "seq_len": 66}), 2)
    # pipeline x context parallel is refused, not silently wrong
    with pytest.raises(UserError, match="does not combine with context parallelism"):
        validate_run(load_config(None, {"strategy": "pp", "pp": 2, "cp": 2, "nproc": 4}), 4)

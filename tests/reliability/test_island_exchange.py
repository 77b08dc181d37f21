"""The outer sync of --heal-replicas islands (train/recovery/island_heal.py: exchange_over_quorum), in-process: two
islands on two threads, each with a real torchft Manager around one lighthouse, sync through torchft's quorum and
commit. Reference: the outer all-reduce of a run without --heal-replicas (outer_codec.py: start_mean) over a gloo
group of the same two islands, on the same outer gradients; every --outer-dtype must give both islands its result,
bit for bit. A joiner (contributing nothing) must leave the mean to the island it copied. The SIGKILLed-island run
(test_replica_healing.py) covers the same exchange across processes, with int4."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch

from paratrain.parallel.semi_sync.outer_codec import ROW, decode, encode, start_mean

ISLANDS, VALUES = 2, 3 * ROW + 100  # a last row only partly filled
# torchft's manager logs through a deprecated logging method
pytestmark = pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning")


def _on_threads(fn, count: int = ISLANDS) -> list:
    """fn(i) for i in range(count), each on its own thread (the islands meet in collectives); their results."""
    out, errors = [None] * count, []

    def run(i):
        try:
            out[i] = fn(i)
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out


@pytest.fixture(scope="module")
def managers():
    """One torchft Manager per island, around one loopback lighthouse: as replica_worker.py makes them."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    from paratrain.train.recovery.replica_heal import make_manager

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=ISLANDS, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=1500)
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    made = _on_threads(lambda i: make_manager("cpu", i, address, 30.0))
    yield [manager for manager, _ in made]
    for manager, _ in made:
        manager.shutdown(wait=False)
    lighthouse.shutdown()


def _start_means(flats: list[torch.Tensor], dtype: str) -> list[torch.Tensor]:
    """start_mean's result on each island: a run without --heal-replicas, over a torchft gloo group of them."""
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [ProcessGroupGloo(timeout=timedelta(seconds=30)) for _ in flats]
    _on_threads(lambda i: groups[i].configure(f"127.0.0.1:{store.port}/{dtype}", str(i), i, len(flats)))
    means = _on_threads(lambda i: start_mean(flats[i], groups[i].parent, dtype).mean())
    return means


_steps = iter(range(1, 1000))  # torchft's step: each sync of the module's managers one higher


def _heal_syncs(managers, flats: list[torch.Tensor], dtype: str, contributes: list[bool]) -> list:
    """Each island's (committed, mean, islands counted) of one sync through the quorum."""
    from paratrain.train.recovery.island_heal import exchange_over_quorum

    step = next(_steps)

    def sync(i):
        manager = managers[i]
        manager.load_state_dict({"step": step, "batches_committed": 0})
        manager.start_quorum()
        finish = exchange_over_quorum(manager, flats[i], dtype, i, contributes[i])
        return (manager.should_commit(), *finish())

    return _on_threads(sync)


def _flats(seed: int) -> list[torch.Tensor]:
    return [torch.randn(VALUES, generator=torch.Generator().manual_seed(seed + i)) * (i + 1) for i in range(ISLANDS)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_the_healing_sync_gives_every_island_the_outer_all_reduces_bits(managers, dtype):
    flats = _flats(0)
    expected = _start_means(flats, dtype)
    assert torch.equal(expected[0], expected[1])
    synced = _heal_syncs(managers, flats, dtype, [True] * ISLANDS)
    for committed, mean, counted in synced:
        assert committed and counted == ISLANDS
        assert mean.dtype == torch.float32 and torch.equal(mean, expected[0]), (dtype, (mean - expected[0]).abs().max())
    # the encodings round: their mean is not the exact one, which fp32's is
    exact = (flats[0] + flats[1]) / 2
    assert torch.equal(synced[0][1], exact) == (dtype == "fp32")


@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_a_joiner_adds_nothing_to_the_healing_sync(managers, dtype):
    """Island 1 joins (it copied island 0's state in this sync): whatever it sends, the mean is island 0's own
    outer gradient, through the encoding as the two rounds of start_mean round it."""
    flats = _flats(10)
    flats[1] = torch.full((VALUES,), 1e6)  # a joiner's would-be gradient: must not count
    synced = _heal_syncs(managers, flats, dtype, [True, False])
    padded = torch.cat([flats[0], torch.zeros(4 * ROW - VALUES)])
    alone = flats[0] if dtype == "fp32" else \
        decode(encode(decode(encode(padded, dtype), dtype, 4 * ROW), dtype), dtype, 4 * ROW)[:VALUES]
    for committed, mean, counted in synced:
        assert committed and counted == 1 and torch.equal(mean, alone)

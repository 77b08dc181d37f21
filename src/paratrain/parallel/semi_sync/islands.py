"""Islands: what --semi-sync can run, and one line for what it cannot.

An island is one coordinate of --dp-replicate: its ranks hold one copy of the model between them, split by any
inner layout (FSDP over --dp-shard, --tp, --cp). Inside an island gradients are reduced as usual (the data-parallel
wrapper, parallel/dp/data_parallel.py, takes its groups from the Layout, which keeps them inside the island under
--semi-sync); across islands nothing moves during the inner steps: the outer step (outer_sync.py) is their only
meeting.
"""

from __future__ import annotations

from paratrain.errors import UserError, flag_of
from paratrain.parallel.semi_sync.semi_sync_options import SemiSyncFields

# the options that only mean something under --semi-sync, and the defaults they take without it
_SEMI_SYNC_ONLY = tuple(name for name in SemiSyncFields.model_fields if name != "semi_sync")
_STREAMING_ONLY = ("fragments", "fragment_delay")


def check_semi_sync(cfg, layout) -> None:
    """UserError, in one line, for a --semi-sync run (or a semi-sync option) that cannot work."""
    method = cfg.semi_sync
    if method is None:
        given = [n for n in _SEMI_SYNC_ONLY if n in cfg.model_fields_set
                 and getattr(cfg, n) != SemiSyncFields.model_fields[n].default]
        if given:
            raise UserError(f"{flag_of(given[0])} is an option of semi-synchronous training: add --semi-sync diloco "
                            f"or --semi-sync streaming-diloco")
        return
    flag = f"--semi-sync {method}"
    if layout.dp_replicate < 2:
        raise UserError(f"{flag} needs two or more islands: --dp-replicate N (N >= 2; each island then runs any "
                        f"inner layout, e.g. --dp-shard or --tp)")
    if layout.splits_stages:
        raise UserError(f"{flag} does not run with a pipeline (--pp {layout.pp}): an island is one data-parallel "
                        f"replica holding every stage's parameters")
    if layout.local_sgd_period:
        raise UserError(f"{flag} and --local-sgd-period both average the replicas' parameters: pick one "
                        f"(--semi-sync diloco --outer-lr 1 --outer-momentum 0 is local SGD)")
    if layout.ddp_comm_hook != "none":
        raise UserError(f"{flag} keeps gradients inside each island, so --ddp-comm-hook {layout.ddp_comm_hook} has "
                        f"nothing to compress; --outer-dtype compresses the outer all-reduce")
    if layout.zero_stage == 1:
        raise UserError(f"{flag} does not run with zero1: ZeRO-1 shards the optimizer over every replica, and each "
                        f"island steps its own optimizer; use --dp-shard for sharding inside an island")
    if layout.splits_experts:
        raise UserError(f"{flag} does not run with --ep yet: the experts' FSDP groups span the islands")
    if layout.dp_micro_batches:
        raise UserError(f"{flag} does not run with --dp-batch-split: each island reads an even share")
    if getattr(cfg, "heal_replicas", False):
        check_island_healing(cfg, flag)
    if method == "diloco":
        for name in _STREAMING_ONLY:
            if getattr(cfg, name) != SemiSyncFields.model_fields[name].default:
                raise UserError(f"{flag_of(name)} is an option of --semi-sync streaming-diloco (diloco syncs every "
                                f"parameter at once)")
    fragments, every, delay = cfg.fragments, cfg.sync_every, cfg.fragment_delay
    if every % fragments:
        raise UserError(f"--sync-every {every} must be a multiple of --fragments {fragments}: one fragment syncs "
                        f"every --sync-every / --fragments steps")
    if delay >= every // fragments:
        raise UserError(f"--fragment-delay {delay} must be below --sync-every / --fragments = {every // fragments}: "
                        f"a fragment's all-reduce must land before the next fragment's starts")


def check_island_healing(cfg, flag: str) -> None:
    """--heal-replicas islands (train/recovery/island_heal.py) average through torchft's quorum, sync by sync (any
    --outer-dtype: fp32 as its all-reduce, the others as an all-gather of outer_codec.py's encodings; with
    --fragment-delay the quorum meets where the all-reduce starts, and the mean waits T steps to be applied)."""
    if cfg.ckpt_every or cfg.ckpt_dir or cfg.preempt_signal:
        raise UserError(f"{flag} --heal-replicas keeps each island's state in the islands themselves (a lost one "
                        f"copies a live one's): checkpoints (--ckpt-every, --ckpt-dir, --preempt-signal) need a run "
                        f"without --heal-replicas")

"""The outer all-reduce: the islands' average of a flat buffer of outer gradients, in the numbers --outer-dtype
names. fp32 is one all-reduce. bf16, int8 and int4 run as a reduce-scatter and an all-gather of encoded chunks
(an all-to-all, each island then decodes and sums its chunk in fp32, encodes the mean and all-gathers it), so the
wire carries 2(n-1)/n of the encoded bytes, as a ring all-reduce carries 2(n-1)/n of the fp32 ones; every island
decodes the same gathered bytes, so all end with bit-identical means.

int8 and int4 are symmetric, with one fp32 scale per row of ROW values (the row's largest magnitude over 127,
or over 7); int4 packs two values a byte. What rides beside the values (the scales, and the padding that makes
the buffer n equal chunks of whole rows) is `overhead_bytes()`: benchmarks/semi_sync.py states it.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from paratrain.parallel.collective_hooks import collective

ROW = 256  # values per scale
_LEVELS = {"int8": 127, "int4": 7}
_BYTES_PER_VALUE = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
_SCALE_BYTES = 4
# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); torch 2.6 has only the old one
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def encode(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """A flat fp32 tensor of whole rows as uint8 bytes: the values, then (int8, int4) the rows' scales."""
    if dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    levels = _LEVELS[dtype]
    rows = x.view(-1, ROW)
    scale = rows.abs().amax(dim=1, keepdim=True) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale decodes to 0
    q = torch.round(rows / scale).clamp_(-levels, levels).to(torch.int8).flatten()
    if dtype == "int4":
        nibbles = (q + 8).to(torch.uint8)  # 1..15
        q = (nibbles[0::2] | (nibbles[1::2] << 4)).view(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.float().flatten().view(torch.uint8)])


def decode(data: torch.Tensor, dtype: str, count: int) -> torch.Tensor:
    """encode()'s bytes back to `count` fp32 values."""
    if dtype == "bf16":
        return data.view(torch.bfloat16).float()
    value_bytes = count if dtype == "int8" else count // 2
    q, scale = data[:value_bytes], data[value_bytes:].view(torch.float32)
    if dtype == "int4":
        q = torch.stack([(q & 0xF).to(torch.int8) - 8, (q >> 4).to(torch.int8) - 8], dim=1).flatten()
    else:
        q = q.view(torch.int8)
    return (q.float().view(-1, ROW) * scale.view(-1, 1)).flatten()


def encoded_bytes(count: int, dtype: str) -> int:
    """Bytes encode() makes of `count` values (whole rows)."""
    scales = 0 if dtype in ("fp32", "bf16") else count // ROW * _SCALE_BYTES
    return int(count * _BYTES_PER_VALUE[dtype]) + scales


def chunk_values(length: int, islands: int) -> int:
    """Values in each island's chunk: the buffer split n ways, rounded up to whole rows."""
    return math.ceil(length / (islands * ROW)) * ROW


def overhead_bytes(length: int, islands: int, dtype: str) -> int:
    """Bytes an encoded buffer of `length` values holds beyond the values themselves: scales and padding."""
    if dtype == "fp32":
        return 0
    padded = chunk_values(length, islands) * islands
    return encoded_bytes(padded, dtype) - int(length * _BYTES_PER_VALUE[dtype])


class PendingMean:
    """An outer all-reduce under way; mean() waits for it and returns the islands' mean (fp32, `length` values)."""

    def __init__(self, finish, mean: torch.Tensor | None = None):
        self._finish, self._mean = finish, mean

    def mean(self) -> torch.Tensor:
        if self._mean is None:
            self._mean, self._finish = self._finish(), None
        return self._mean

    @classmethod
    def known(cls, mean: torch.Tensor) -> PendingMean:
        """One whose mean is already known (restored from a checkpoint)."""
        return cls(None, mean)


def start_mean(flat: torch.Tensor, group, dtype: str) -> PendingMean:
    """Start averaging `flat` (fp32) over the islands of `group`; the first phase runs while inner steps go on."""
    n = dist.get_world_size(group)
    if dtype == "fp32":
        buf = flat.clone()
        work = collective("outer_sync", "dp_replicate", "all_reduce", group,
                          functools.partial(dist.all_reduce, buf, group=group, async_op=True), (buf,))
        return PendingMean(functools.partial(_wait_and_divide, work, buf, n))
    chunk = chunk_values(flat.numel(), n)
    padded = torch.zeros(chunk * n, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    sent = torch.cat([encode(part, dtype) for part in padded.split(chunk)])
    received = torch.zeros_like(sent)  # zeros, not garbage, where an interceptor drops the collective
    work = collective("outer_sync", "dp_replicate", "all_to_all", group,
                      functools.partial(dist.all_to_all_single, received, sent, group=group, async_op=True),
                      (received, sent))
    return PendingMean(functools.partial(_gather_means, work, received, group, dtype, chunk, flat.numel()))


def _wait_and_divide(work, buf: torch.Tensor, n: int) -> torch.Tensor:
    if work is not None:
        work.wait()
    return buf.div_(n)


def _gather_means(work, received: torch.Tensor, group, dtype: str, chunk: int, length: int) -> torch.Tensor:
    """The second phase: this island's chunk summed from every island's encoding, its mean encoded and gathered."""
    if work is not None:
        work.wait()
    n = dist.get_world_size(group)
    packed = encode(average_decoded(received.chunk(n), dtype, chunk), dtype)
    gathered = torch.zeros(packed.numel() * n, dtype=torch.uint8, device=packed.device)
    collective("outer_sync", "dp_replicate", "all_gather", group,
               functools.partial(_ALL_GATHER, gathered, packed, group=group), (gathered, packed))
    return torch.cat([decode(part, dtype, chunk) for part in gathered.chunk(n)])[:length]


def average_decoded(parts, dtype: str, count: int) -> torch.Tensor:
    """The mean of encoded buffers of `count` values each, decoded and summed in the order given (fp32): every
    island sums in island order, so all get the same bits."""
    return sum(decode(part, dtype, count) for part in parts) / len(parts)


# --heal-replicas islands (train/recovery/island_heal.py) exchange whole encoded outer gradients through torchft's
# quorum: an all-gather, each island's bytes behind a header of two int32s, its island index and whether it counts
_HEADER_BYTES = 8


def pack_contribution(flat: torch.Tensor, dtype: str, island: int, contributes: bool) -> torch.Tensor:
    """One island's bytes for a healing sync: its header, then `flat` (fp32) encoded in whole rows (zeros after the
    last value)."""
    padded = torch.zeros(math.ceil(flat.numel() / ROW) * ROW, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    header = torch.tensor([island, int(contributes)], dtype=torch.int32, device=flat.device).view(torch.uint8)
    return torch.cat([header, encode(padded, dtype)])


def mean_of_contributions(parts: list[torch.Tensor], dtype: str, length: int) -> tuple[torch.Tensor, int]:
    """The islands' mean from every quorum member's pack_contribution(), and how many islands it averages: those
    that contribute, decoded and summed in island order, the mean then rounded through the encoding as start_mean's
    all-gather rounds it, so that it equals start_mean's bit for bit over the same islands (rows never straddle
    its chunks) and every member computes the same bits from the same gathered bytes."""
    values = math.ceil(length / ROW) * ROW
    islands = [(int(island), bool(on), part[_HEADER_BYTES:]) for part in parts
               for island, on in [part[:_HEADER_BYTES].clone().view(torch.int32).tolist()]]
    counted = [data for _, on, data in sorted(islands, key=lambda entry: entry[0]) if on]
    mean = average_decoded(counted, dtype, values)
    return decode(encode(mean, dtype), dtype, values)[:length], len(counted)

"""The Python API's torch Dataset / IterableDataset: paratrain shards the global batches across data-parallel
ranks (rank slices of one global stream), reads through a DataLoader with worker processes, and resumes at a
step (at any data-parallel size) with the same global batches. Reference: the samples listed by index."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset

from paratrain.train.data.torch_data import TorchData

SEQ = 8


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    row = (torch.arange(SEQ + 1) * 7 + i * 13) % 97
    return row[:-1], row[1:]


class Samples(Dataset):
    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int):
        return sample(i)


class SampleStream(IterableDataset):
    def __iter__(self):
        return (sample(i % 50) for i in range(10_000))


def rows_read(data, dp: int, steps: int, start: int = 0, workers: int = 1) -> list[list[int]]:
    """The first token of each row of each global batch, read through dp rank sources."""
    sources = [TorchData(data).batch_source(4, r, dp, 4 // dp, workers=workers) for r in range(dp)]
    for s in sources:
        s.load_state_dict({"step": start})
    loaders = [s.prefetcher() for s in sources]
    out = []
    for _ in range(steps):
        rows = torch.cat([torch.cat([mb.inputs for mb in loader.next_step()[0]]) for loader in loaders])
        out.append(rows[:, 0].tolist())
    for loader in loaders:
        loader.close()
    return out


def test_global_batches_do_not_depend_on_the_data_parallel_size_and_resume_exactly():
    expected = [[sample(i % 50)[0][0].item() for i in range(t * 4, t * 4 + 4)] for t in range(5)]
    for data in (Samples(), SampleStream()):
        assert rows_read(data, 1, 5) == expected
        assert rows_read(data, 2, 5, workers=0) == expected
        assert rows_read(data, 2, 2) + rows_read(data, 1, 3, start=2) == expected  # saved at 2 ranks, resumed at 1

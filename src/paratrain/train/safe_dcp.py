"""Read DCP checkpoints without running code from them.

Stock DCP unpickles `.metadata` with plain pickle and reads non-tensor entries (optimizer hyperparameters)
with torch.load(weights_only=False): a crafted checkpoint could execute code on load. Here the metadata
goes through an unpickler that only builds DCP's own metadata classes, and every non-tensor entry through
torch.load(weights_only=True). Tensor data is already read with weights_only=True by DCP itself.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module in _METADATA_MODULES or (module, name) in _ALLOWED
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not allowed"
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` can only contain DCP metadata, tensor shapes and dtypes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(
                f"checkpoint metadata is a {type(metadata).__name__}, not DCP Metadata"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that refuses non-tensor entries torch.load(weights_only=True) would refuse."""

    def load_bytes(self, read_item, value) -> None:
        # The restricted load proves the bytes hold only plain data (numbers, strings, containers), so the
        # stock path that follows can build nothing else.
        start = value.tell()
        torch.load(value, weights_only=True)
        value.seek(start)
        super().load_bytes(read_item, value)

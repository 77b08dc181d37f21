"""Read DCP checkpoints without running code from them, and without reading outside their directory.

Stock DCP unpickles `.metadata` with plain pickle and reads non-tensor entries (optimizer hyperparameters)
with torch.load(weights_only=False): a crafted checkpoint could execute code on load. Here the metadata
goes through an unpickler that builds only an exact list of (module, name) pairs (DCP's own metadata
classes, tensor shapes and dtypes); every non-tensor entry is read once, with torch.load(weights_only=True),
and that result is what gets loaded. The file names inside the metadata must stay inside the checkpoint
directory. Tensor data is already read with weights_only=True by DCP itself.
"""

from __future__ import annotations

import pickle
from pathlib import PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_META, "Metadata"),
    (_META, "StorageMeta"),
    (_META, "MetadataIndex"),
    (_META, "TensorStorageMetadata"),
    (_META, "BytesStorageMetadata"),
    (_META, "ChunkStorageMetadata"),
    (_META, "TensorProperties"),
    (_META, "_MEM_FORMAT_ENCODING"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # "." in a name would make pickle walk attributes (protocol 4): e.g. metadata's `os.system`
        if "." in name or not ((module, name) in _ALLOWED or _is_dtype(module, name)):
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")
        return super().find_class(module, name)


def confined_name(name: object) -> bool:
    """True if `name` is a plain relative file name that stays inside its directory (no '..', not absolute)."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts and path.parts == (name,)


def check_storage_data(metadata: Metadata) -> None:
    """Every file the metadata points at is a plain name inside the checkpoint; no stream transforms."""
    storage = metadata.storage_data or {}
    if not isinstance(storage, dict):
        raise pickle.UnpicklingError("checkpoint metadata has no storage map")
    for info in storage.values():
        path = getattr(info, "relative_path", None)
        if not confined_name(path):
            raise pickle.UnpicklingError(f"checkpoint metadata points outside the checkpoint: {path!r}")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise pickle.UnpicklingError(f"checkpoint metadata has a bad byte range for {path!r}")
        if getattr(info, "transform_descriptors", None):
            raise pickle.UnpicklingError(f"checkpoint metadata asks for stream transforms on {path!r}")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` can only contain DCP metadata, tensor shapes and dtypes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"checkpoint metadata is a {type(metadata).__name__}, not DCP Metadata")
        check_storage_data(metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are parsed once, by torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)  # plain data only: numbers, strings, containers, tensors
        if self.flatten_state_dict:  # what DefaultLoadPlanner.load_bytes does with its own (unsafe) load
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

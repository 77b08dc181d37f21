"""How a healing replica (train/recovery/replica_heal.py) receives a live peer's state: torchft's process-group
transport (PGTransport), which sends the tensors over the replicas' own process group, so no server is started for
it (torchft's HTTP transport listens on every interface). One change: the small description it sends ahead of the
tensors (their shapes and dtypes, the state's tree and its numbers) is unpickled by an allow-list of the classes
such a description holds before torchft (0.2 unpickles it unrestricted) reads it: a class outside the list is
refused and never runs."""

from __future__ import annotations

import io
import pickle
import warnings
from datetime import timedelta

import torch
from torchft.checkpointing.pg_transport import PGTransport

# what a state description (pg_transport._StateDictMeta of paratrain's replica state) is made of
_ALLOWED = {
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "set"), ("builtins", "frozenset"),
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("torch", "Size"),
    ("torch.utils._pytree", "TreeSpec"), ("torch.utils._pytree", "LeafSpec"), ("torch.utils._pytree", "MappingKey"),
    ("torch.utils._pytree", "SequenceKey"), ("torchft.checkpointing.pg_transport", "_StateDictMeta"),
    ("torchft.checkpointing.pg_transport", "_TensorMeta"),
}


class _DescriptionUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global in a peer's state description: {module}.{name}")


def load_description(data: bytes):
    """A peer's state description, unpickled through the allow-list (pickle.UnpicklingError otherwise)."""
    with warnings.catch_warnings():  # torch's own pytree, rebuilding a LeafSpec, trips its deprecation of the name
        warnings.filterwarnings("ignore", message=".*LeafSpec.* is deprecated", category=FutureWarning)
        return _DescriptionUnpickler(io.BytesIO(data)).load()


# torchft 0.2's PGTransport protocol: tag 1 carries the description's length, tag 2 the description, 3 on the tensors
_DESCRIPTION_TAG = 2


class _CheckedGroup:
    """The replicas' process group as the transport uses it (send and recv): a description it receives is first
    unpickled through the allow-list, so torchft's own unrestricted unpickling only ever reads one that passed."""

    def __init__(self, group):
        self.group = group

    def send(self, tensors: list, dst_rank: int, tag: int):
        return self.group.send(tensors, dst_rank, tag)

    def recv(self, tensors: list, src_rank: int, tag: int):
        work = self.group.recv(tensors, src_rank, tag)
        return _CheckedWork(work, tensors[0]) if tag == _DESCRIPTION_TAG else work


class _CheckedWork:
    def __init__(self, work, buffer: torch.Tensor):
        self.work, self.buffer = work, buffer

    def wait(self, timeout: timedelta | None = None):
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        load_description(self.buffer.cpu().numpy().tobytes())  # pickle.UnpicklingError: refused, nothing ran
        return done


def peer_checkpoint_transport(group, timeout: timedelta, device: torch.device) -> PGTransport:
    """The Manager's checkpoint transport over `group`, the replicas' torchft process group it reconfigures at every
    quorum (a joiner's recovery source is a rank of it)."""
    return PGTransport(_CheckedGroup(group), timeout=timeout, device=device)

"""How a healing replica (train/recovery/replica_heal.py) receives a live peer's state: torchft's HTTP checkpoint transport,
the Manager's default, with two changes. Its server's access log goes to torchft's logger, not to the user's
terminal (http.server writes `"GET /checkpoint/6/full HTTP/1.1" 200` to stderr for every request). And what
arrives is unpickled with weights_only=True: torchft 0.2 loads it with weights_only=False, while its server
listens on every interface."""

from __future__ import annotations

import logging
import urllib.request
from datetime import timedelta

from torch.distributed._serialization import _streaming_load
from torchft.checkpointing import HTTPTransport

log = logging.getLogger("torchft.checkpointing.http_transport")


class PeerCheckpointTransport(HTTPTransport):
    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        # the state is tensors, numbers, lists and dicts (replica_heal.replica_state and torchft's step count)
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return _streaming_load(f, weights_only=True)


def peer_checkpoint_transport(timeout: timedelta) -> PeerCheckpointTransport:
    transport = PeerCheckpointTransport(timeout=timeout, num_chunks=0)
    # torchft defines its request handler inside __init__: reach it through the server, which reads it per request
    server = transport._server
    handler = server.RequestHandlerClass
    server.RequestHandlerClass = type(handler.__name__, (handler,), {"log_message": _log_request})
    return transport


def _log_request(handler, fmt: str, *args) -> None:
    log.debug("%s: %s", handler.address_string(), fmt % args)

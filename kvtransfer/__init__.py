"""KV transfer between prefill and decode workers: one interface, connectors registered by name.

    connector = CONNECTORS["zmq"](checksum=False, timeout_s=30.0)
    receiver = connector.make_receiver(layout, kv_caches, kv_scales, bind="tcp://0.0.0.0:5600")  # on D
    sender = connector.make_sender(layout, device)                                                # on P

`CONNECTORS` maps a name to a "module:Class" path and imports a connector's module only when that
name is looked up: a process that uses one connector (or only `CacheLayout`) does not pay for, or
depend on, the others (torch.distributed, shared memory). See README.md in this folder for the
protocol, the guarantees and the connectors' trade-offs.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from kvtransfer.base import (
    CacheLayout,
    HandshakeError,
    KVConnector,
    KVReceiver,
    KVSender,
    LayerReceived,
    SenderStats,
    TransferDone,
    TransferEvent,
    TransferFailed,
)


class LazyConnectors(Mapping[str, type[KVConnector]]):
    """Read-only `name -> connector class`; the class's module is imported on first lookup."""

    def __init__(self, paths: dict[str, str]) -> None:
        self._paths = dict(paths)  # name -> "module:Class"
        self._loaded: dict[str, type[KVConnector]] = {}

    def __getitem__(self, name: str) -> type[KVConnector]:
        cls = self._loaded.get(name)
        if cls is None:
            if name not in self._paths:
                raise KeyError(f"unknown KV connector {name!r}; available: {', '.join(sorted(self._paths))}")
            module, _, attr = self._paths[name].partition(":")
            cls = getattr(importlib.import_module(module), attr)
            self._loaded[name] = cls
        return cls

    def __contains__(self, name: object) -> bool:  # Mapping's default would import the module
        return name in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def __repr__(self) -> str:
        return f"LazyConnectors({self._paths!r})"


CONNECTORS = LazyConnectors({
    "zmq": "kvtransfer.zmq_connector:ZmqConnector",
    "shm": "kvtransfer.shm_connector:ShmConnector",
    "torch_dist": "kvtransfer.dist_connector:DistConnector",
})

__all__ = [
    "CONNECTORS", "CacheLayout", "HandshakeError", "KVConnector", "KVReceiver", "KVSender", "LayerReceived",
    "LazyConnectors", "SenderStats", "TransferDone", "TransferEvent", "TransferFailed",
]

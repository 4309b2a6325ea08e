"""KV transfer between prefill and decode workers: one interface, connectors registered by name.

    connector = CONNECTORS["zmq"](checksum=False, timeout_s=30.0)
    receiver = connector.make_receiver(layout, kv_caches, kv_scales, bind="tcp://0.0.0.0:5600")  # on D
    sender = connector.make_sender(layout, device)                                                # on P

See README.md in this folder for the protocol, the guarantees and the connectors' trade-offs.
"""

from __future__ import annotations

from kvtransfer.base import (
    CacheLayout, HandshakeError, KVConnector, KVReceiver, KVSender, LayerReceived, SenderStats,
    TransferDone, TransferEvent, TransferFailed,
)
from kvtransfer.dist_connector import DistConnector
from kvtransfer.shm_connector import ShmConnector
from kvtransfer.zmq_connector import ZmqConnector

CONNECTORS: dict[str, type[KVConnector]] = {
    ZmqConnector.name: ZmqConnector,
    ShmConnector.name: ShmConnector,
    DistConnector.name: DistConnector,
}

__all__ = [
    "CONNECTORS", "CacheLayout", "HandshakeError", "KVConnector", "KVReceiver", "KVSender", "LayerReceived",
    "SenderStats", "TransferDone", "TransferEvent", "TransferFailed",
]

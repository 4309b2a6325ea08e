"""The interfaces tandem's pluggable strategies implement; the engine and the router depend only
on these, and the implementations (plugins/ and third-party packages) import them from here.

- eviction.py      EvictionPolicy: which free cached KV block is reused first
- kv_quantizer.py  KVQuantizer (+ NoQuantizer): the KV cache's storage format (dtype, scales)
- speculator.py    Speculator, SpeculatorContext: speculative-decoding proposers
- routing.py       RoutingPolicy, RouteRequest, WorkerView: the router's worker choice (torch-free)

KV connectors implement `kvtransfer.base.KVConnector`. Names are resolved to implementations by
tandem/engine/strategies.py. Nothing is imported here: the router imports routing.py alone and
must not pay for torch, which kv_quantizer.py and speculator.py need.
"""

"""tandem's built-in strategies (eviction, KV quantization, speculation, routing) and the plugin
manager that loads them beside third-party ones. They implement the interfaces in
tandem/engine/interfaces/ (KV connectors: kvtransfer.base); nothing under tandem/ imports this
package at import time — the engine resolves names through tandem/engine/strategies.py."""

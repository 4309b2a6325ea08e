"""bench/interference's client: a router stand-in on one decode worker's control socket that sends
requests and timestamps every streamed token as it is received."""

from __future__ import annotations

import time

import zmq

from tandem.protocol import messages


class Driver:
    """A router stand-in on one decode worker: sends requests, timestamps every streamed token."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sent: dict[str, float] = {}
        self.times: dict[str, list[float]] = {}  # request id -> receive time of each token
        self.finished: set[str] = set()
        self.stats: dict | None = None  # the last stats_reply

    def add(self, rid: str, prompt: list[int], max_tokens: int, peer: str | None) -> None:
        sampling = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
        self.sent[rid] = time.perf_counter()
        self.times[rid] = []
        self.sock.send(messages.encode("add_request", id=rid, token_ids=prompt, sampling=sampling, prefill_peer=peer))

    def abort(self, rid: str) -> None:
        self.sock.send(messages.encode("abort", id=rid))

    def pump(self, timeout_s: float) -> None:
        """Wait up to timeout_s for a message, then take everything already queued."""
        if not self.sock.poll(max(int(timeout_s * 1000), 0)):
            return
        while self.sock.poll(0):
            msg = messages.decode(self.sock.recv())
            now = time.perf_counter()
            if msg["type"] == "error":
                raise RuntimeError(f"worker error for {msg['id']}: {msg['message']}")
            if msg["type"] == "stats_reply":
                self.stats = msg["stats"]
            if msg["type"] != "output":
                continue
            self.times.setdefault(msg["id"], []).extend([now] * len(msg["token_ids"]))
            if msg["finished"]:
                self.finished.add(msg["id"])

    def wait(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
            self.pump(0.05)

    def request_stats(self) -> dict:
        self.stats = None
        self.sock.send(messages.encode("stats"))
        self.wait(lambda: self.stats is not None, 30, "stats_reply")
        return self.stats

    def close(self) -> None:
        self.sock.close()

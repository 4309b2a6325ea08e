"""A decode engine hands out a prefill worker's first token the moment its KV arrives, before the
step's forward pass: that forward (every running request's next token) would otherwise stand
between the transfer and the client's first token (one decode step of TTFT under P/D)."""

from __future__ import annotations

from tiny_models import make_checkpoint

from tandem.config import EngineConfig
from tandem.engine.kv_connector import Arrived, KVConnector, KVUpdates
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams


class PeerPrefill(KVConnector):
    """Every prompt is prefilled elsewhere; `arrive()` makes the next poll report the pending ones."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.ready = False

    def num_external_tokens(self, req, num_computed: int) -> int:
        return req.num_tokens - num_computed

    def on_allocated(self, req, num_computed: int) -> None:
        self.pending.append(req.request_id)

    def poll(self) -> KVUpdates:
        if not self.ready:
            return KVUpdates()
        arrived, self.pending, self.ready = [Arrived(rid, 7) for rid in self.pending], [], False
        return KVUpdates(arrived=arrived)

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)


def test_first_token_goes_out_before_the_steps_forward(tmp_path):
    engine = LLMEngine(EngineConfig(model=make_checkpoint(str(tmp_path / "m"))))
    forwards = []
    execute = engine.runner.execute
    engine.runner.execute = lambda run: forwards.append(run) or execute(run)  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    local = engine.add_request(None, [5, 6, 7, 8], greedy)  # prefilled here, before the connector
    assert [o.request_id for o in engine.step()] == [local] and len(forwards) == 1
    connector = PeerPrefill()
    engine.set_kv_connector(connector)
    remote = engine.add_request(None, [9, 10, 11, 12, 13], greedy)
    engine.step()  # the remote request gets its blocks and waits; the local one decodes
    assert connector.pending == [remote] and len(forwards) == 2
    connector.ready = True
    outs = engine.step()
    assert [(o.request_id, o.new_token_ids) for o in outs] == [(remote, [7])]
    assert len(forwards) == 2  # no forward ran in that call: the first token did not wait for one
    assert engine.current_schedule is None  # so a worker's step metrics count no step for that call
    outs = engine.step()  # now both decode in one forward
    assert sorted(o.request_id for o in outs) == sorted([local, remote]) and len(forwards) == 3
    assert {s.request.request_id for s in forwards[-1].scheduled} == {local, remote}

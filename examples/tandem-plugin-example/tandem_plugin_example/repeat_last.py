"""`repeat_last` speculator: proposes the request's last token k times. Verification in the engine
is exact, so output never changes; only the number of accepted tokens (speed) depends on it."""

from __future__ import annotations

from typing import Sequence

from tandem.engine.interfaces.speculator import Speculator
from tandem.engine.request import Request


class RepeatLastSpeculator(Speculator):
    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        return {r.request_id: [r.token_ids[-1]] * self.num_to_propose(r) for r in requests}

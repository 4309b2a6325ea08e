"""vLLM's `use_beam_search` on the OpenAI endpoints: the body -> BeamSearchParams, or a 400 naming the
field when it asks for something beam search here does not do.

`n` is the beam width (the n best hypotheses come back as the n choices, best first); `best_of`, if
given, must equal it. `length_penalty` and `early_stopping` (true, false or "never") score and end
the search as transformers does. Beam search is deterministic and answered whole: temperature must be
0 (or unset), and stream, logprobs, echo, stop strings, penalties, truncation (top_p/top_k/min_p) and
structured outputs are refused rather than ignored. Each prompt's search is one request on one decode
worker (tandem/engine/beam_group.py), so it takes one admission slot whatever its width.
"""

from __future__ import annotations

from typing import Any

from router_svc.errors import BadRequest
from tandem.sampling_params import MAX_BEAM_WIDTH, BeamSearchParams

# Fields beam search does not combine with -> the values that mean "not used".
_UNUSED: dict[str, tuple[Any, ...]] = {
    "stream": (None, False), "stream_options": (None,), "logprobs": (None, False), "top_logprobs": (None,),
    "echo": (None, False), "stop": (None, "", []), "stop_token_ids": (None, []), "seed": (None,),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}), "top_p": (None, 1, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0), "response_format": (None, {"type": "text"}), "structured_outputs": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
}


def beam_from_body(body: dict[str, Any], max_tokens: Any, default_max: int) -> BeamSearchParams | None:
    """None unless the body sets use_beam_search: true."""
    use = body.get("use_beam_search")
    if use not in (None, True, False):
        raise BadRequest("use_beam_search must be a boolean", param="use_beam_search")
    if not use:
        for name, neutral in (("length_penalty", (None, 1, 1.0)), ("early_stopping", (None, False))):
            if body.get(name) not in neutral:
                raise BadRequest(f"{name} applies to beam search only: set use_beam_search: true", param=name)
        return None
    temperature = body.get("temperature")
    if temperature not in (None, 0, 0.0):
        raise BadRequest(f"temperature must be 0 with use_beam_search (beam search is deterministic), "
                         f"got {temperature!r}", param="temperature")
    for name, neutral in _UNUSED.items():
        if body.get(name) not in neutral:
            raise BadRequest(f"{name} is not supported with use_beam_search (leave it unset)", param=name)
    width = body.get("n")
    width = 1 if width is None else width
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_BEAM_WIDTH:
        raise BadRequest(f"n is the beam width with use_beam_search: an integer in [1, {MAX_BEAM_WIDTH}], "
                         f"got {width!r}", param="n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != width:
        raise BadRequest(f"best_of must equal n (the beam width, {width}) with use_beam_search, got {best_of!r}",
                         param="best_of")
    kw: dict[str, Any] = {"beam_width": width, "max_tokens": default_max if max_tokens is None else max_tokens}
    for name in ("ignore_eos", "length_penalty", "early_stopping"):
        if body.get(name) is not None:
            kw[name] = body[name]
    try:
        return BeamSearchParams(**kw)
    except (ValueError, TypeError) as exc:
        raise BadRequest.from_exception(exc, frozenset(kw)) from None

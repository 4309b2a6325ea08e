"""The ways clients ask for structured output, mapped onto SamplingParams.structured_outputs:

- OpenAI `response_format`: {"type": "text"} (nothing), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": ...};
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of them per request (400 naming the field otherwise). The router checks the shape only;
whether a grammar compiles is the decode worker's check (its error comes back as a 400).
"""

from __future__ import annotations

from typing import Any

from router_svc.errors import BadRequest

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_from_body(body: dict[str, Any]) -> dict[str, Any] | None:
    asked = [name for name in ("response_format", "structured_outputs", *_GUIDED) if body.get(name) is not None]
    if len(asked) > 1:
        raise BadRequest(f"give one of {asked}, not several", param=asked[1])
    if not asked:
        return None
    name, value = asked[0], body[asked[0]]
    if name in _GUIDED:
        return {_GUIDED[name]: value}
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise BadRequest("structured_outputs must be an object", param=name)
        return dict(value)
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("response_format.type must be 'text', 'json_object' or 'json_schema'", param=name)
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return {"json_object": True}
    schema = value.get("json_schema")
    if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
        raise BadRequest("response_format.json_schema.schema must be a JSON schema object", param=name)
    return {"json": schema["schema"]}

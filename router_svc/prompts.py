"""The served model as the front ends see it: its name, and how a prompt becomes token ids
(text through the tokenizer, chat messages through the model's chat template, ids as given)."""

from __future__ import annotations

import json
import os
from typing import Any

import jinja2.ext  # noqa: F401  tandem.tokenizer uses jinja2.ext.loopcontrols without importing the submodule

from router_svc.errors import BadRequest, ModelNotFound
from router_svc.reasoning import check_parser as check_reasoning
from router_svc.tool_parsers import check_parser
from tandem.sampling_params import model_defaults
from tandem.tokenizer import RESERVED_TEMPLATE_NAMES, Tokenizer


class ServedModel:
    def __init__(self, path: str, name: str | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.path = path
        self.tool_call_parser = check_parser(tool_call_parser)  # how "auto" reads its calls (tool_parsers.py)
        self.reasoning_parser = check_reasoning(reasoning_parser)  # splits off <think> text (reasoning.py)
        self.name = name or os.path.basename(os.path.normpath(path))
        self.tokenizer = Tokenizer(path)
        self.created = int(os.path.getmtime(path))
        self.max_model_len = _max_model_len(path)
        self.sampling_defaults = model_defaults(path)  # generation_config.json: for fields a request leaves unset

    def check_model(self, requested: Any) -> None:
        """OpenAI requires `model`; we accept it missing/empty (single-model server) but not wrong."""
        if requested in (None, ""):
            return
        if not isinstance(requested, str):
            raise BadRequest(f"model must be a string, got {type(requested).__name__}", param="model")
        if requested != self.name and requested != self.path:
            raise ModelNotFound(f"the model {requested!r} does not exist; this server serves {self.name!r}",
                                param="model")

    def encode_text(self, text: Any, param: str = "prompt") -> list[int]:
        if not isinstance(text, str):
            raise BadRequest(f"{param} must be a string, got {type(text).__name__}", param=param)
        if not text:
            raise BadRequest(f"{param} is empty", param=param)
        return self.tokenizer.encode(text)

    def check_ids(self, ids: Any, param: str = "prompt") -> list[int]:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest(f"{param} must be a list of token ids (integers)", param=param)
        if not ids:
            raise BadRequest(f"{param} is empty", param=param)
        bad = [t for t in ids if t < 0]
        if bad:
            raise BadRequest(f"{param} has negative token ids {bad[:5]}", param=param)
        return list(ids)

    def encode_chat(self, messages: Any, param: str = "messages", tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Through the chat template; `tools` (OpenAI's, checked) and the rest go to it as transformers
        passes them (vLLM's request fields of the same names)."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest(f"{param} must be a non-empty list of {{'role', 'content'}} objects", param=param)
        flat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"{param}[{i}] must be an object with a string 'role'", param=param)
            flat.append({"role": m["role"], "content": _content_text(m.get("content"), f"{param}[{i}].content"),
                         **_tool_fields(m, f"{param}[{i}]")})
        reserved = RESERVED_TEMPLATE_NAMES & set(template_kwargs or {})
        if reserved:
            raise BadRequest(f"chat_template_kwargs cannot set {sorted(reserved)}: the request's own fields do",
                             param="chat_template_kwargs")
        try:
            return self.tokenizer.encode_chat(flat, add_generation_prompt, tools, continue_final_message,
                                              **(template_kwargs or {}))
        except ValueError as exc:  # the template's own error, or one naming the field it is about
            named = BadRequest.from_exception(exc, {"continue_final_message", "chat_template_kwargs"}).param
            if named is None and template_kwargs and str(exc).startswith("chat template failed"):
                named = "chat_template_kwargs"  # most likely what broke a template that renders without them
            raise BadRequest(str(exc), param=named or param) from None


def _tool_fields(message: dict, where: str) -> dict[str, Any]:
    """A history's tool traffic for the template: an assistant's `tool_calls` (arguments, a JSON string in
    OpenAI's shape, as an object: templates write them with tojson, as vLLM passes them) and a tool
    result's `tool_call_id` / `name`."""
    out = {k: message[k] for k in ("tool_call_id", "name") if isinstance(message.get(k), str)}
    calls = message.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list", param="messages")
    out["tool_calls"] = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.tool_calls[{j}] must be {{'function': {{'name', 'arguments'}}}}",
                             param="messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise BadRequest(f"{where}.tool_calls[{j}].function.arguments is not JSON", param="messages") from None
        out["tool_calls"].append({**call, "function": {**fn, "arguments": args}})
    return out


def _content_text(content: Any, where: str) -> str:
    """OpenAI content is a string or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}: only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where} must be a string or a list of text parts", param="messages")


def _max_model_len(path: str) -> int | None:
    try:
        with open(os.path.join(path, "config.json")) as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None

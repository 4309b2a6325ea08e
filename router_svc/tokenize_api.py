"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt (text, or chat messages through the template,
as /v1/chat/completions renders them) to the token ids the server would run, and ids back to text, so a
client can count tokens or build id prompts with the server's own tokenizer. Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Any

from router_svc.errors import BadRequest
from router_svc.prompts import ServedModel
from router_svc.tool_calls import tool_plan


def tokenize(body: Any, model: ServedModel) -> dict[str, Any]:
    """{"prompt": str, "add_special_tokens"?: bool} or {"messages": [...], chat fields...}."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model.check_model(body.get("model"))
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise BadRequest("add_special_tokens must be a boolean", param="add_special_tokens")
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest("give either prompt (text) or messages (a chat)", param="prompt")
    if "prompt" in body:
        text = body["prompt"]
        if not isinstance(text, str) or not text:
            raise BadRequest("prompt must be a non-empty string", param="prompt")
        ids = model.tokenizer.encode(text, add_special_tokens=special is not False)
    else:
        for name in ("add_generation_prompt", "continue_final_message"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise BadRequest(f"{name} must be a boolean", param=name)
        if body.get("chat_template_kwargs") is not None and not isinstance(body["chat_template_kwargs"], dict):
            raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
        tools, _ = tool_plan({**body, "tool_choice": "none"}) if body.get("tools") else (None, None)
        continuing = body.get("continue_final_message") is True
        if special:
            raise BadRequest("add_special_tokens applies to prompt: a chat template writes its own special tokens",
                             param="add_special_tokens")
        ids = model.encode_chat(body.get("messages"), tools=tools, continue_final_message=continuing,
                                add_generation_prompt=body.get("add_generation_prompt", not continuing) is not False,
                                template_kwargs=body.get("chat_template_kwargs"))
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": None}


def detokenize(body: Any, model: ServedModel) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model.check_model(body.get("model"))
    ids = model.check_ids(body.get("tokens"), param="tokens") if body.get("tokens") != [] else []
    vocab = model.tokenizer.vocab_size
    outside = [t for t in ids if t >= vocab]
    if outside:
        raise BadRequest(f"tokens {outside[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": model.tokenizer.decode(ids, skip_special_tokens=False)}

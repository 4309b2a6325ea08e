"""OpenAI request shapes: JSON bodies -> (token ids, SamplingParams), checked. Pure functions, no I/O;
the response side (completion objects, streaming chunks, logprobs) is router_svc/openai_responses.py.

Field mapping: max_tokens (chat: max_completion_tokens or max_tokens), temperature, top_p, n (fanned out
at the router: each choice is its own request, with seed + i when a seed is given; best_of only = n),
prompt (a string, token ids, or a batch of either: choices are prompt-major), stop (str or list), seed,
logprobs (+ top_logprobs for chat), stream, stream_options.include_usage,
response_format / structured_outputs / guided_* (router_svc/structured_request.py); tools, tool_choice
and parallel_tool_calls (router_svc/tool_calls.py);
presence_penalty, frequency_penalty, logit_bias; tandem (vLLM) extras: top_k, min_p, ignore_eos, stop_token_ids,
repetition_penalty, min_tokens, include_stop_str_in_output, skip_special_tokens; chat: add_generation_prompt,
continue_final_message, chat_template_kwargs (to the chat template); use_beam_search with n as the beam
width, length_penalty, early_stopping (router_svc/beam_request.py). Parameters tandem does not implement
are accepted only at their neutral value, otherwise a 400 that names them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from router_svc.beam_request import beam_from_body
from router_svc.errors import BadRequest
from router_svc.openai_models import validate_body
from router_svc.prompts import ServedModel
from router_svc.reasoning import Reasoning, reasoning_for
from router_svc.structured_request import structured_from_body
from router_svc.tool_calls import ToolPlan, tool_plan
from tandem.sampling_params import BeamSearchParams, SamplingParams

SAMPLING_NAMES = frozenset(SamplingParams.__dataclass_fields__)
# Parameter -> the values that mean "not used" (anything else is refused, not silently ignored).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),  # the deprecated forms of tools / tool_choice
}
_EXTRAS = ("top_k", "min_p", "ignore_eos", "stop_token_ids", "repetition_penalty", "min_tokens",
           "include_stop_str_in_output", "skip_special_tokens")
_PENALTIES = ("presence_penalty", "frequency_penalty", "logit_bias")
# prompts x n per HTTP request: each choice is a request in flight of its own, so one body cannot
# take more than this many of the router's admission slots.
MAX_CHOICES = 64


@dataclass(slots=True)
class ParsedRequest:
    prompts: list[list[int]]  # one per prompt (a batch on /v1/completions; chat: one)
    params: list[SamplingParams]  # one per choice, prompt-major: choice j answers prompts[j // n]
    n: int
    stream: bool
    include_usage: bool
    chat: bool
    # completions' echo: each prompt's text goes before its completion (and its logprobs before the
    # completion's); with max_tokens 0 nothing is generated (one token is, and dropped)
    echo_texts: list[str] | None = None
    drop_output: bool = False
    # use_beam_search: one request per prompt (params has one entry per prompt), answered with n hypotheses
    beam: BeamSearchParams | None = None
    tools: ToolPlan | None = None  # chat with tool_choice "required", a named function, or "auto" (parsed)
    reasoning: Reasoning | None = None  # chat: how its text splits into reasoning and content (reasoning.py)

    @property
    def token_ids(self) -> list[int]:
        return self.prompts[0]


def parse_completion(body: Any, model: ServedModel) -> ParsedRequest:
    validate_body(body, chat=False)
    body = _common_checks(body, model)
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) not in (None, [], "none"):
            raise BadRequest(f"{name} is only served on /v1/chat/completions", param=name)
    batch = _prompt_batch(body.get("prompt"))
    prompts = [_one_prompt(p, model) for p in batch]
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int)):
        raise BadRequest("logprobs must be an integer (the number of top logprobs) for completions", param="logprobs")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    for ids in prompts:
        _check_context(ids, max_tokens, model)
    beam = beam_from_body(body, max_tokens, default_max=16)
    if beam is not None:
        return _beam_request(prompts, beam, chat=False)
    echo = body.get("echo") is True
    # echo with max_tokens 0 is how lm-eval asks for a prompt's loglikelihood: one token is generated
    # (the engine always generates one) and dropped
    drop = echo and max_tokens == 0
    params = _sampling(body, max_tokens=1 if drop else max_tokens, default_max=16, logprobs=lp,
                       defaults=model.sampling_defaults, prompt_logprobs=lp if echo else None)
    parsed = _fan_out(body, prompts, params, chat=False)
    if echo:
        texts = [p if isinstance(p, str) else model.tokenizer.decode(ids, skip_special_tokens=False)
                 for p, ids in zip(batch, prompts)]
        parsed.echo_texts, parsed.drop_output = [t for t in texts for _ in range(parsed.n)], drop
    return parsed


def _prompt_batch(prompt: Any) -> list[Any]:
    """The prompt field as a list of prompts (each a string or a token-id list), as OpenAI and vLLM take it."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(isinstance(p, list) for p in prompt)):
        return prompt
    raise BadRequest("prompt must be a non-empty string, a list of token ids, or a list of either", param="prompt")


def _one_prompt(prompt: Any, model: ServedModel) -> list[int]:
    return model.encode_text(prompt) if isinstance(prompt, str) else model.check_ids(prompt)


def parse_chat(body: Any, model: ServedModel) -> ParsedRequest:
    validate_body(body, chat=True)
    body = _common_checks(body, model)
    if body.get("echo") not in (None, False):
        raise BadRequest("echo is only served on /v1/completions", param="echo")
    tools, plan = tool_plan(body, model.tool_call_parser)
    continuing = body.get("continue_final_message") is True
    ids = model.encode_chat(body.get("messages"), tools=tools, continue_final_message=continuing,
                            add_generation_prompt=body.get("add_generation_prompt", not continuing) is not False,
                            template_kwargs=body.get("chat_template_kwargs"))
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp not in (None, True, False):
        raise BadRequest("logprobs must be a boolean for chat completions", param="logprobs")
    if top is not None and not lp:
        raise BadRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise BadRequest("top_logprobs must be an integer in [0, 20]", param="top_logprobs")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    _check_context(ids, max_tokens, model)
    beam = beam_from_body(body, max_tokens, default_max=model.max_model_len or 4096)
    if beam is not None:
        if plan is not None:
            raise BadRequest("beam search does not make tool calls: drop use_beam_search or tool_choice",
                             param="tool_choice")
        parsed = _beam_request([ids], beam, chat=True)
        parsed.reasoning = _reasoning(ids, model)
        return parsed
    # OpenAI's chat default is "as long as the context allows": D caps max_tokens at its max_model_len.
    params = _sampling(body, max_tokens=max_tokens, default_max=model.max_model_len or 4096,
                       logprobs=(top or 0) if lp else None, defaults=model.sampling_defaults,
                       structured=None if plan is None else plan.structured)
    if plan is not None and plan.parsed and body.get("skip_special_tokens") is None:
        params = replace(params, skip_special_tokens=False)  # a model's call tags may be special tokens
    reasoning = _reasoning(ids, model)
    block = None if reasoning is None else reasoning.grammar_block
    if params.structured_outputs is not None and block is not None:  # the grammar starts after the thinking
        params = replace(params, structured_outputs={**params.structured_outputs, "reasoning_block": block})
    parsed = _fan_out(body, [ids], params, chat=True)
    parsed.tools, parsed.reasoning = plan, reasoning
    return parsed


def _reasoning(ids: list[int], model: ServedModel) -> Reasoning | None:
    """The server's reasoning split for this prompt (whether the template left the block open)."""
    if model.reasoning_parser is None:
        return None
    return reasoning_for(model.reasoning_parser, model.tokenizer.decode(ids[-32:], skip_special_tokens=False))


def _fan_out(body: dict, prompts: list[list[int]], params: SamplingParams, chat: bool) -> ParsedRequest:
    """n choices per prompt, each its own request; with a seed, choice i samples with seed + i (so the
    request is reproducible and its choices differ)."""
    n = body.get("n")
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"n must be a positive integer, got {n!r}", param="n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        # best_of > n would rank candidates server-side by likelihood: not implemented, so not pretended
        raise BadRequest(f"best_of must equal n ({n}) on this server, got {best_of!r}", param="best_of")
    if len(prompts) * n > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompt(s) x n={n} is {len(prompts) * n} completions; at most "
                         f"{MAX_CHOICES} per request", param="n" if n > 1 else "prompt")
    per_prompt = [params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
                  for i in range(n)]
    return ParsedRequest(prompts, [p for _ in prompts for p in per_prompt], n, _stream(body), _include_usage(body),
                         chat=chat)


def _beam_request(prompts: list[list[int]], beam: BeamSearchParams, chat: bool) -> ParsedRequest:
    if len(prompts) * beam.beam_width > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompt(s) x n={beam.beam_width} is {len(prompts) * beam.beam_width} "
                         f"completions; at most {MAX_CHOICES} per request", param="prompt")
    root = SamplingParams(temperature=0.0, max_tokens=beam.max_tokens, ignore_eos=beam.ignore_eos)
    return ParsedRequest(prompts, [root] * len(prompts), beam.beam_width, False, False, chat=chat, beam=beam)


def _check_context(ids: list[int], max_tokens: Any, model: ServedModel) -> None:
    """An explicit max_tokens that cannot fit is an error, as vLLM answers (a default is capped instead)."""
    limit = model.max_model_len
    if limit and isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and len(ids) + max_tokens > limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                         f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages/prompt, {max_tokens} for the "
                         "completion). Please reduce the length of the prompt or max_tokens.", param="max_tokens")


def _common_checks(body: Any, model: ServedModel) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model.check_model(body.get("model"))
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise BadRequest(f"{name} is not supported by this server (leave it unset)", param=name)
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 2:
        raise BadRequest(f"temperature must be in [0, 2], got {temperature}", param="temperature")
    return body


def _sampling(body: dict, max_tokens: Any, default_max: int, logprobs: int | None,
              defaults: dict[str, Any] | None = None, prompt_logprobs: int | None = None,
              structured: dict[str, Any] | None = None) -> SamplingParams:
    """`defaults`: the checkpoint's generation_config.json values, for the fields the body leaves unset;
    `structured`: a grammar of the server's own (tool calls), else the body's."""
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise BadRequest("stop must be a string or a list of strings", param="stop")
    kw: dict[str, Any] = {**(defaults or {}), "max_tokens": default_max if max_tokens is None else max_tokens,
                          "stop": stop or [], "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
    for name in ("temperature", "top_p", "seed", *_PENALTIES, *_EXTRAS):
        if body.get(name) is not None:
            kw[name] = body[name]
    if structured is None:
        structured = structured_from_body(body)  # response_format / structured_outputs / guided_*
    if structured is not None:
        kw["structured_outputs"] = structured
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as exc:
        raise BadRequest.from_exception(exc, SAMPLING_NAMES) from None


def _stream(body: dict) -> bool:
    stream = body.get("stream", False)
    if stream not in (None, True, False):
        raise BadRequest("stream must be a boolean", param="stream")
    return bool(stream)


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    if not body.get("stream"):
        raise BadRequest("stream_options is only allowed with stream: true", param="stream_options")
    return bool(opts.get("include_usage"))

"""Offline API in the vLLM style: `LLM(model=PATH).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import Iterator, Sequence

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from tandem.sampling_params import BeamSearchParams, SamplingParams, model_defaults

Prompt = str | list[int]


class LLM:
    """One in-process engine (role `both`). `model=None` uses the built-in default model."""

    def __init__(self, model: str | None = None, **engine_options) -> None:
        if model is None:
            from tandem.default_model import default_model_path

            model = default_model_path()
        unknown = set(engine_options) - set(EngineConfig.option_names())
        if unknown:
            raise ValueError(f"unknown engine option(s) {sorted(unknown)}; known: {EngineConfig.option_names()}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self.sampling_defaults = model_defaults(model)  # generation_config.json (as vLLM's "auto")

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults: what params=None uses."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion in one continuous batch; outputs in prompt order."""
        prompts = self._prompt_list(prompts)
        params_list = self._params_for(len(prompts), params)
        # Validate everything first: one bad prompt must not leave the others half-queued.
        reqs = [self.engine.make_request(None, p, sp) for p, sp in zip(prompts, params_list)]
        for r in reqs:
            self.engine.track(r)
            self.engine.scheduler.add(r)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(reqs):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in reqs]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search of each prompt in the engine (tandem/engine/beam_group.py): all prompts' groups
        in one continuous batch; per prompt, its beam_width hypotheses best first."""
        prompts = self._prompt_list(prompts)
        reqs = [self.engine.make_beam_request(None, p, params) for p in prompts]  # all validated first
        for r in reqs:
            self.engine.enqueue(r)
        ids = {r.request_id for r in reqs}
        final: dict[str, RequestOutput] = {}
        while len(final) < len(reqs):
            for out in self.engine.step():
                if out.finished and out.request_id in ids:
                    final[out.request_id] = out
        results = []
        for r in reqs:
            out = final[r.request_id]
            results.append(BeamSearchOutput([
                BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.cumulative_logprob or 0.0, c.text,
                                   c.finish_reason, c.stop_reason if isinstance(c.stop_reason, int) else None,
                                   len(out.prompt_token_ids)) for c in out.outputs]))
        return results

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput per step for one prompt (text_delta holds the new text)."""
        rid = self.engine.add_request(None, prompt, params or self.get_default_sampling_params())
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None, *,
             tools: list[dict] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation or several, rendered by the model's chat template (vLLM's keyword names)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.tokenizer.encode_chat(m, add_generation_prompt, tools, continue_final_message,
                                              **(chat_template_kwargs or {})) for m in conversations]
        return self.generate(prompts, params)

    def score(self, token_ids: list[int]) -> list[float]:
        """Log-prob of each token after the first, given its prefix (for perplexity)."""
        ids = self.engine.tokenize(token_ids)
        if len(ids) > self.engine.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed max_model_len={self.engine.max_model_len}")
        return self.engine.runner.score(ids)

    @staticmethod
    def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]  # type: ignore[list-item]
        return list(prompts)

    def _params_for(self, n: int, params) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params

"""LLMEngine: the loop every role runs — add requests, `step()` (schedule → run → update), stream
RequestOutputs with incremental text, stop strings, aborts.

1. `add_request` validates (prompt length, parameters) and queues; bad input raises ValueError and
   leaves the engine untouched.
2. `step` applies what its KV connector reports (remote prompts whose KV and first token arrived,
   failed transfers to recompute, held blocks to free), asks the speculator (if any) for proposals
   for the decoding requests, schedules one batch, runs it (verifying proposals), advances every
   request by the computed-tokens rule, and detokenizes what was sampled; a stop string ends its
   request in the same step.

The engine allocates its KV memory once, where `kv_allocator` puts it (a transport's, e.g. shared
memory for the shm connector); `set_kv_connector` plugs in the disaggregation seam
(tandem/engine/kv_connector.py).
"""

from __future__ import annotations

import functools
import itertools
import os
from typing import Any

from kvtransfer.base import allocate_kv_caches
from tandem.config import EngineConfig
from tandem.engine import spec_decode, warm_up
from tandem.engine.beam_group import BeamGroups
from tandem.engine.beam_search import BeamSearch
from tandem.engine.kv_cache_manager import KVCacheManager, release_window
from tandem.engine.kv_connector import KVConnector
from tandem.engine.kv_layout import KVAllocator, cache_layout, hidden_state_layers
from tandem.engine.model_runner import ModelRunner
from tandem.engine.output_builder import OutputBuilder
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.engine.strategies import resolve_eviction, resolve_quantizer
from tandem.engine.thread_backoff import ThreadBackoff
from tandem.models.config import ModelConfig
from tandem.outputs import RequestOutput
from tandem.sampling_params import BeamSearchParams, SamplingParams
from tandem.tokenizer import Tokenizer

_MAX_MODEL_LEN_DEFAULT_CAP = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_allocator: KVAllocator | None = None) -> None:
        self.config = config
        model_cfg = ModelConfig.from_dir(config.model)
        self.model_config = model_cfg
        self.tokenizer = Tokenizer(config.model)
        self.max_model_len = model_cfg.resolve_max_model_len(config.max_model_len, _MAX_MODEL_LEN_DEFAULT_CAP)
        self.runner = ModelRunner(config.model, config.torch_dtype, config.torch_device, self.max_model_len,
                                  config.block_size, config.seed, cuda_graphs=not config.enforce_eager,
                                  # --kv-cache-dtype: sizes the blocks below and allocates scales
                                  kv_quantizer=resolve_quantizer(config.kv_cache_dtype))
        # An EAGLE-style speculator reads the target's hidden states: they get cache layers of their own,
        # so they are there for prefix-cache hits and cross from a prefill worker with the K/V.
        self.runner.hidden_layers = hidden_state_layers(model_cfg) if spec_decode.wants_hidden_states(config) else 0
        self.kv_layout = cache_layout(config, model_cfg, self.runner.kv_quantizer, self.runner.hidden_layers)
        budget = int(config.kv_cache_memory_gb * 2**30)
        num_blocks = config.num_kv_blocks or budget // self.kv_layout.bytes_per_block
        window = release_window(model_cfg, config.role)
        one_sequence = self.max_model_len
        if window is not None and config.enable_chunked_prefill:  # holds a window and a chunk at most
            one_sequence = min(one_sequence, window + config.max_num_batched_tokens + 2 * config.block_size)
        if num_blocks * config.block_size < one_sequence:
            raise ValueError(f"the KV cache ({num_blocks} blocks of {config.block_size} tokens) cannot hold one "
                             f"sequence of {one_sequence} tokens (max_model_len={self.max_model_len}); raise "
                             "kv_cache_memory_gb / num_kv_blocks or lower max_model_len")
        self.num_kv_blocks = num_blocks
        # Allocated once, here, where the transport wants it (shm) or in plain memory.
        allocate = kv_allocator or allocate_kv_caches
        self.runner.kv_caches, self.runner.kv_scales = allocate(self.kv_layout, num_blocks, config.torch_device)
        self.kv = KVCacheManager(num_blocks, config.block_size, resolve_eviction(config.eviction, num_blocks),
                                 config.enable_prefix_caching, window)
        batched = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            # An unchunked prompt must fit one step *beside* a full batch of decodes (each up to
            # 1 + 15 speculated tokens), or a max_model_len prompt would wait for every stream to end.
            batched = max(batched, self.max_model_len + config.max_num_seqs * 16)
        self.scheduler = Scheduler(self.kv, batched, config.max_num_seqs, config.enable_chunked_prefill)
        runner = self.runner
        self.beams = BeamGroups(self.kv, self.scheduler, lambda: [*runner.kv_caches, *(runner.kv_scales or [])],
                                self.tokenizer.decode)
        self.eos_token_ids = set(model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.outputs = OutputBuilder(self.tokenizer, self.scheduler.finish)
        self._ids, self.current_schedule, self.kv_connector = itertools.count(), None, KVConnector()
        self.speculator, self.spec_active, self.spec_switches = None, False, 0  # active: off above spec_max_batch
        self.thread_backoff = ThreadBackoff() if config.torch_device.type == "cpu" else None
        if config.role != "prefill":  # a prefill worker never proposes: its speculator waits for a switch
            self.ensure_speculator()
        spec = config.num_speculative_tokens if config.speculator else 0  # GPU: kernels compiled, graphs captured
        self.warm_up_seconds = warm_up.warm_up(self.runner, tuple(range(1, spec + 2)), config.spec_max_batch or 1,
                                               extra=tuple(self.speculator.warm_modules() if self.speculator else ()))

    def ensure_speculator(self) -> None:
        """Build the configured speculator, once: at start, or when a prefill worker starts decoding."""
        if self.speculator is None and self.config.speculator is not None:
            self.speculator = spec_decode.build_speculator(self.config, self.model_config, self.max_model_len,
                                                           self.runner)
            self.spec_active = True

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode_prompt(prompt, self.model_config.vocab_size)

    def make_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams) -> Request:
        """Validate and build a Request without queueing it (the decode service queues it itself)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        params.validate()
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model accepts at most {self.max_model_len - 1}"
                             f" (max_model_len={self.max_model_len}, one token is left to generate)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        if params.logit_bias and max(params.logit_bias) >= self.model_config.vocab_size:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is outside the vocabulary "
                             f"({self.model_config.vocab_size} tokens)")
        req = Request(rid, ids, params, self.eos_token_ids, max_tokens)
        if params.structured_outputs is not None:
            resume = params.structured_outputs.get("resume_tokens", 0)
            req.grammar = self.grammars.state(params.structured_outputs, ids[len(ids) - resume:] if resume else None)
        if params.prompt_logprobs is not None:  # vLLM's shape: None for the first token (it has no prefix)
            req.prompt_logprobs = [None, *self.runner.prompt_logprobs(ids, params.prompt_logprobs)]
        return req

    def make_beam_request(self, request_id: str | None, prompt: str | list[int], params: BeamSearchParams) -> Request:
        """A beam search's root request (its prompt), validated like any; `enqueue` starts the group."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError("params must be a BeamSearchParams")
        params.validate()
        if self.speculator is not None:
            raise ValueError(f"use_beam_search: beam search is not served by an engine with a speculator "
                             f"({self.config.speculator!r}); serve it from workers started without --speculator")
        req = self.make_request(request_id, prompt, SamplingParams(max_tokens=params.max_tokens, temperature=0.0,
                                                                   ignore_eos=params.ignore_eos))
        # Worst case (no block shared): every hypothesis as long as the prompt plus max_tokens.
        need = params.beam_width * self.kv.num_blocks_for(len(req.token_ids) + req.max_tokens)
        if need > self.num_kv_blocks:
            raise ValueError(f"beam search of width {params.beam_width} over {len(req.token_ids)} + {req.max_tokens} "
                             f"tokens may need {need} KV blocks; the cache has {self.num_kv_blocks}: lower beam_width "
                             "or max_tokens, or raise kv_cache_memory_gb / num_kv_blocks")
        req.beam = BeamSearch(params, self.eos_token_ids, req.max_tokens)
        return req

    @functools.cached_property
    def grammars(self) -> Any:
        """Structured outputs' grammar compiler for this model's tokenizer (built on first use)."""
        from tandem.engine.structured import Grammars

        with open(os.path.join(self.config.model, "tokenizer.json"), encoding="utf-8") as f:
            return Grammars(f.read(), self.model_config.vocab_size, sorted(self.eos_token_ids),
                            threads=self.config.torch_device.type != "cpu")

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams) -> str:
        req = self.make_request(request_id, prompt, params)
        self.track(req)
        self.scheduler.add(req)
        return req.request_id

    def enqueue(self, req: Request) -> None:
        """Queue a request built by `make_request` or `make_beam_request` (a service sets its `kv_peer` first)."""
        if req.beam is not None:  # its output is the group's, made by BeamGroups
            self.beams.add(req, req.beam)
        else:
            self.track(req)
        self.scheduler.add(req)

    def has_runnable(self) -> bool:
        """Requests to compute now (remote-KV waits and held blocks are the connector's to poll)."""
        return bool(self.scheduler.running or self.scheduler.waiting or self.beams.num_computing())

    def stats(self) -> dict:
        """Scheduler and KV-cache counters for a worker's stats and metrics, and whether the KV block
        accounting holds (`kv_invariant_ok`: every block free, cached or held by a live request)."""
        sched, kv = self.scheduler, self.kv.stats()
        try:
            self.check_invariants()
            invariant_ok = True
        except AssertionError:
            invariant_ok = False
        return {"running": len(sched.running) + self.beams.num_computing(), "waiting": len(sched.waiting),
                "waiting_for_kv": len(sched.remote),
                "kv_blocks_total": kv.num_blocks, "kv_blocks_used": kv.used_blocks, "kv_usage": kv.usage,
                "prefix_queried_tokens": kv.prefix_queried_tokens, "prefix_hit_tokens": kv.prefix_hit_tokens,
                "preemptions": sched.num_preemptions, "kv_invariant_ok": invariant_ok}

    def track(self, req: Request) -> None:
        self.outputs.track(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        beams = self.beams.abort(request_id)
        if beams is not None:
            return beams
        req = self.scheduler.abort(request_id)
        return self._output(req, []) if req is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.beams.groups)

    def set_kv_connector(self, connector: KVConnector) -> None:
        """Plug in a connector: the scheduler consults its scheduler half, `step` polls its worker
        half, and the forward pass hands it each layer as soon as the layer's K/V is stored."""
        self.kv_connector = self.scheduler.connector = connector
        runner, sends = self.runner, type(connector).save_layer is not KVConnector.save_layer
        runner.layer_hook = None if not sends else (  # a role switch drops a sender's hook with its connector
            lambda layer: connector.save_layer(layer, self.current_schedule, runner.kv_caches, runner.kv_scales))

    def _apply_kv_updates(self) -> list[RequestOutput]:
        updates, outputs = self.kv_connector.poll(), []
        sched = self.scheduler
        for a in updates.arrived:
            req = sched.remote.get(a.request_id)
            if req is None:
                continue
            if req.beam is not None:  # P's first token is not a beam search's: this worker computes the
                req.num_computed_tokens = req.num_tokens - 1  # last prompt token again for the logits row
                sched.compute_locally(a.request_id)  # (after the line above: the window's blocks suffice)
                self.kv.cache_computed_blocks(req)
                continue
            before = req.num_tokens
            sched.remote_kv_arrived(a.request_id, a.first_token)
            if req.logprobs is not None:  # P sampled the first token: its logprobs came with the KV
                req.logprobs.append({int(t): float(lp) for t, lp in a.logprobs or []} or {a.first_token: float("nan")})
            outputs.append(self._output(req, req.token_ids[before:]))
        for rid, _reason in updates.failed:
            if rid in sched.remote:
                sched.compute_locally(rid)
        for rid in updates.released:
            sched.release(rid)
        return outputs

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.thread_backoff is not None:  # fewer threads while another process takes cores
            self.thread_backoff.tick()
        outputs = self._apply_kv_updates()
        if outputs:  # first tokens sampled by a prefill worker go out now, not after this step's forward
            self.current_schedule = None  # (a decode step later: TTFT + one step); no step ran: none to count
            return outputs  # the next call runs the step
        if self.speculator is not None:
            active = spec_decode.attach_proposals(self.speculator, self.scheduler.running, self.runner,
                                                  self.config.spec_max_batch)
            if active != self.spec_active:
                self.spec_active, self.spec_switches = active, self.spec_switches + 1
        beam_rows = self.beams.schedule()  # beam groups' hypotheses, first: a group runs whole or not at all
        beam_tokens = sum(s.num_new_tokens for s in beam_rows)
        seats = self.scheduler.max_num_seqs if self.beams.starved else len(beam_rows)
        out = self.scheduler.schedule(beam_tokens, seats)
        run = out if not beam_rows else SchedulerOutput(beam_rows + out.scheduled, out.preempted,
                                                        out.num_tokens + beam_tokens)
        self.current_schedule = run  # what the connector's save_layer pushes, layer by layer
        if run.empty:
            return outputs
        result = self.runner.execute(run)
        if result.hidden:  # before `update`, so a request finishing this step is dropped after it
            self.speculator.observe_hidden_states(result.hidden)  # type: ignore[union-attr]
        roots = self.beams.take_roots(result.sampled) if self.beams.groups else []
        before = {s.request.request_id: s.request.num_tokens for s in out.scheduled}
        if self.speculator is not None:
            prompts = spec_decode.prompts_completed(out.scheduled)  # before `update` moves what they computed
            spec_decode.cut_runs_at_stop_strings(result.sampled, result.logits, self.scheduler.requests,
                                                 self.outputs.detok, self.outputs.text)
        changed = self.scheduler.update(out, result.sampled)
        for req in changed:
            new_ids = req.token_ids[before[req.request_id]:]
            if req.logprobs is not None:
                self.outputs.record_logprobs(req, result.logits[req.request_id], new_ids)
            outputs.append(self._output(req, new_ids))
        if beam_rows or roots:
            outputs += self.beams.advance(beam_rows, roots, result.logits)
        if self.speculator is not None and len(self.scheduler.running) <= self.config.spec_max_batch:
            self.speculator.catch_up([r for r in prompts if not r.finished])
        return outputs

    def speculator_stats(self) -> dict:
        """Speculative decoding counters (for the metrics endpoint); {} without a speculator."""
        if self.speculator is None:
            return {}
        return {"speculator": self.config.speculator, "num_speculative_tokens": self.config.num_speculative_tokens,
                "active": self.spec_active, "num_switches": self.spec_switches, **self.runner.spec_stats.as_dict(),
                **self.speculator.stats()}

    def _output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        out = self.outputs.build(req, new_ids)
        if req.finished:
            self.kv_connector.request_finished(req)
            if self.speculator is not None:
                self.speculator.on_request_finished(req.request_id)
        return out

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.scheduler.live_requests() + self.beams.live_requests())

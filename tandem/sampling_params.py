"""SamplingParams: what a request asks for, validated once when it enters the system."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping options of one request (vLLM's names and meanings).

    temperature 0 means greedy. `stop` strings end generation and are cut from the output text;
    `stop_token_ids` end it and are kept in `token_ids` (their text is not emitted).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (plus the chosen token's)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token after the first (an extra prompt pass)
    # Logits processing (tandem/engine/logits_processors.py), vLLM's and OpenAI's meanings.
    presence_penalty: float = 0.0  # [-2, 2]: minus this for a token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # > 0: tokens of the prompt or output have positive logits divided by it
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are forbidden until this many tokens were generated
    # Constrain the output to a grammar (tandem/engine/structured.py): exactly one of {"json": schema},
    # {"json_object": True}, {"regex": str}, {"choice": [str, ...]}, {"grammar": lark}; plus
    # "resume_tokens": n when the prompt's last n tokens were generated under it (a migrated request).
    structured_outputs: dict | None = None
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) that ended it stays in the text
    skip_special_tokens: bool = True  # special tokens (EOS, a template's markers) are left out of the text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, minimum=0)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.structured_outputs is not None:
            check_structured(self.structured_outputs)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            self._check_logit_bias()
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
                if getattr(self, name) > 20:
                    raise ValueError(f"{name} must be at most 20, got {getattr(self, name)}")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise TypeError(f"logit_bias must be a map of token id to bias, got {type(self.logit_bias).__name__}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        bias = {}
        for token, value in self.logit_bias.items():
            if isinstance(token, str) and token.strip().isdigit():  # JSON object keys are strings
                token = int(token)
            _check_int("logit_bias token id", token, minimum=0)
            _check_number("logit_bias value", value)
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token}")
            bias[token] = float(value)
        self.logit_bias = bias

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        """Build from a wire/JSON dict; unknown keys are an error naming the known ones."""
        return cls(**_known_fields(cls, data, "sampling"))

    def to_dict(self) -> dict:
        """A wire/JSON dict (logit_bias keys as strings: msgpack and JSON maps keep string keys)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.logit_bias:
            out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return out


MAX_BEAM_WIDTH = 16


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search of one prompt (vLLM's names; `early_stopping` as transformers has it).

    The `beam_width` best hypotheses are returned best first, scored the transformers way:
    cumulative log-prob / (generated tokens ** length_penalty). Deterministic: temperature must be 0.
    `early_stopping`: True ends the search once beam_width hypotheses finished; False and "never" keep
    going while a live beam could still beat the worst finished one (transformers' heuristics).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_int("beam_width", self.beam_width, minimum=1)
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be at most {MAX_BEAM_WIDTH}, got {self.beam_width}")
        _check_int("max_tokens", self.max_tokens, minimum=1)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        _check_number("temperature", self.temperature)
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0 with beam search (it is deterministic), got {self.temperature}")
        _check_number("length_penalty", self.length_penalty)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")

    @classmethod
    def from_dict(cls, data: dict) -> "BeamSearchParams":
        return cls(**_known_fields(cls, data, "beam search"))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _known_fields(cls: type, data: dict, what: str) -> dict:
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown {what} parameter(s) {sorted(unknown)}; known: {sorted(known)}")
    return data


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value != value:  # NaN
        raise ValueError(f"{name} must not be NaN")


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# structured_outputs.reasoning_block: the grammar applies after a <think> block the output starts inside
# ("open") or may start with ("optional"); tandem/engine/grammar_text.py after_reasoning
REASONING_BLOCKS = ("open", "optional")
MAX_LOGIT_BIAS = 300


def check_structured(spec: object) -> dict:
    """A structured_outputs spec's shape (ValueError naming the field); whether the grammar compiles
    is the engine's check (tandem/engine/structured.py)."""
    if not isinstance(spec, dict) or len([k for k in spec if k in STRUCTURED_KINDS]) != 1:
        raise ValueError(f"structured_outputs must name exactly one of {list(STRUCTURED_KINDS)}, got {spec!r:.200}")
    unknown = set(spec) - set(STRUCTURED_KINDS) - {"resume_tokens", "reasoning_block"}
    if unknown:
        raise ValueError(f"structured_outputs: unknown field(s) {sorted(unknown)}; known: {list(STRUCTURED_KINDS)}")
    kind, value = next((k, v) for k, v in spec.items() if k in STRUCTURED_KINDS)
    if kind == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
    if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
    if kind == "json" and not isinstance(value, (dict, str, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema (an object, or its text)")
    if kind == "json_object" and value is not True:
        raise ValueError("structured_outputs.json_object must be true")
    if "resume_tokens" in spec:
        _check_int("structured_outputs.resume_tokens", spec["resume_tokens"], minimum=0)
    if spec.get("reasoning_block", "open") not in REASONING_BLOCKS:
        raise ValueError(f"structured_outputs.reasoning_block must be one of {list(REASONING_BLOCKS)}")
    return spec


# generation_config.json keys a checkpoint may use to set default sampling (vLLM's list), by our name
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty"}


def model_defaults(model_dir: str) -> dict:
    """The sampling defaults a checkpoint's generation_config.json sets (as transformers and vLLM
    read it): used for every field a request leaves unset. {} without the file."""
    import json
    import os

    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    out = {ours: raw[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items() if raw.get(theirs) is not None}
    try:
        SamplingParams(**out)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return out

"""Tokenizer from a checkpoint directory (`tokenizer.json` + `tokenizer_config.json`): encode/decode,
the chat template (rendered with jinja2 the way transformers does), and incremental detokenization.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# Names the template gets from the request itself: chat_template_kwargs cannot set them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                     "bos_token", "eos_token", "self"})
# transformers' marker for continue_final_message: the same mark makes the same cut.
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "
_CONTEXT_TOKENS = 6  # prompt tokens decoded with the output so leading spaces/merges come out right


def _token_text(tok: object) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


class Tokenizer:
    def __init__(self, path: str) -> None:
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(f"checkpoint {path!r} has no tokenizer.json (tandem needs a fast tokenizer file)")
        try:
            self._tok = HFTokenizer.from_file(tok_file)
        except Exception as exc:  # tokenizers raises plain Exception on corrupt files
            raise ValueError(f"cannot read {tok_file}: {exc}") from exc
        cfg_file = os.path.join(path, "tokenizer_config.json")
        cfg = {}
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                cfg = json.load(f)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        self.chat_template: str | None = template
        self._compiled = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, prompt: str | list[int], vocab_size: int) -> list[int]:
        """A request's prompt (text, or token ids checked against the model's vocabulary) as token ids;
        ValueError/TypeError naming what is wrong."""
        if isinstance(prompt, str):
            ids = self.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        else:
            raise TypeError("a prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            **template_kwargs: object) -> str:
        """The chat template rendered as transformers renders it: `tools` (OpenAI-style function specs)
        and `template_kwargs` (e.g. enable_thinking) go to the template; `continue_final_message` ends
        the text right after the last message's content, so generation continues that message."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer_config.json has no chat_template; send a plain prompt instead")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError("messages must be a list of {'role': str, 'content': str} objects")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                             "continues the last message, the second starts a new one")
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled = env.from_string(self.chat_template)
        if continue_final_message and not messages:
            raise ValueError("continue_final_message: there is no message to continue")
        final = messages[-1]["content"] if messages else ""
        if continue_final_message:  # marked, so the cut lands after the content however the template ends a turn
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_MARK}]
        try:
            text = self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **template_kwargs)
        except Exception as exc:  # a template error, or one its variables cause (e.g. str + int)
            raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return _cut_at_mark(text, final) if continue_final_message else text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, continue_final_message: bool = False,
                    **template_kwargs: object) -> list[int]:
        # The template writes the special tokens itself (as transformers does).
        text = self.apply_chat_template(messages, add_generation_prompt, tools, continue_final_message,
                                        **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _cut_at_mark(text: str, final: str) -> str:
    """The rendered chat up to the final message's content (marked with _CONTINUE_MARK), cut as
    transformers cuts it: at the mark, or at the mark less trailing space if the template trimmed it."""
    mark = _CONTINUE_MARK.strip()
    at = text.rfind(mark)
    if at < 0 or final.strip() not in text:
        raise ValueError("continue_final_message: the last message's content does not appear in the rendered "
                         "chat (the template drops or rewrites it)")
    return text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class IncrementalDetokenizer:
    """Text deltas for a growing token list. A token that ends inside a multi-byte character decodes
    to U+FFFD; such text is held back until the character is complete (or the request finishes)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip)
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset:], skip)
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text):]
        return ""

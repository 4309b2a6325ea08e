"""vLLM's chat-template fields: `add_generation_prompt`, `continue_final_message` and
`chat_template_kwargs` render exactly as transformers' apply_chat_template renders them, offline and
through the front door, HTTP and gRPC (a colocated worker: the prompt it was sent is the one rendered
here, and the continuation equals the offline engine's), and misuse is a 400 naming the field. Also vLLM's
/tokenize (text, or a chat rendered as above) and /detokenize."""

from __future__ import annotations

import grpc
import pytest
from service_procs import grpc_stub, post, start_serving, stop_all
from tiny_models import make_checkpoint, set_chat_template

# Reads a template variable (as Qwen3's reads enable_thinking) and keeps the content's spacing.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return a "}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return set_chat_template(make_checkpoint(str(tmp_path_factory.mktemp("template") / "ckpt")), TEMPLATE)


@pytest.mark.parametrize("kw", [
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"add_generation_prompt": True, "enable_thinking": False},
    {"add_generation_prompt": True, "enable_thinking": True},
])
def test_rendering_equals_transformers(ckpt, kw):
    from transformers import AutoTokenizer

    from tandem.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(CHAT, tokenize=False, **kw)
    ours = Tokenizer(ckpt).apply_chat_template(CHAT, **kw)
    assert ours == hf
    if kw.get("continue_final_message"):
        assert ours.endswith("    return a ")  # the content's trailing space is kept: the template keeps it
    assert ("<think></think>" in ours) == (kw.get("enable_thinking") is False)


@pytest.mark.parametrize("final", ["end", "|>", "d", "", "  spaced  "])
def test_continuing_cuts_right_after_the_content_whatever_it_holds(ckpt, final):
    """The content may also occur in the template's own turn markers ("end" in "<|end|>"): the cut is
    still right after the content, where transformers makes it."""
    from transformers import AutoTokenizer

    from tandem.tokenizer import Tokenizer

    chat = [CHAT[0], {"role": "assistant", "content": final}]
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    ours = Tokenizer(ckpt).apply_chat_template(chat, **kw)
    assert ours == AutoTokenizer.from_pretrained(ckpt).apply_chat_template(chat, tokenize=False, **kw)
    assert ours.endswith("<|assistant|>\n" + final)


def test_a_template_that_fails_on_a_variable_is_a_value_error(tmp_path):
    from tandem.tokenizer import Tokenizer

    path = set_chat_template(make_checkpoint(str(tmp_path / "ckpt")),
                             "{{ 'Reasoning: ' + reasoning_effort }}{{ messages[0]['content'] }}")
    tok = Tokenizer(path)
    assert tok.apply_chat_template(CHAT[:1], reasoning_effort="low") == "Reasoning: lowdef add(a, b):"
    with pytest.raises(ValueError, match="chat template failed: TypeError"):
        tok.apply_chat_template(CHAT[:1], reasoning_effort=1)


def test_continuing_a_message_the_template_strips_cuts_where_transformers_does(tmp_path):
    from transformers import AutoTokenizer

    from tandem.tokenizer import Tokenizer

    stripping = TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    path = set_chat_template(make_checkpoint(str(tmp_path / "ckpt")), stripping)
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    ours = Tokenizer(path).apply_chat_template(CHAT, **kw)
    assert ours == AutoTokenizer.from_pretrained(path).apply_chat_template(CHAT, tokenize=False, **kw)
    assert ours.endswith("return a")


@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    procs, ep = start_serving(ckpt, tmp_path_factory.mktemp("template-serve"), disaggregated=False, num_kv_blocks=64)
    try:
        yield ep
    finally:
        stop_all(procs)


@pytest.mark.slow
def test_continue_final_message_through_the_front_door(ckpt, served):
    from tandem import LLM, SamplingParams
    from tandem.protocol import generation_pb2 as pb

    http = served["http"]
    body = {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False, "temperature": 0,
            "max_tokens": 8, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    status, _, out = post(f"{http}/v1/chat/completions", body)
    assert status == 200, out
    llm = LLM(ckpt, num_kv_blocks=64)
    ids = llm.tokenizer.encode_chat(CHAT, add_generation_prompt=False, continue_final_message=True)
    assert out["usage"]["prompt_tokens"] == len(ids)
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text
    assert out["choices"][0]["message"]["content"] == want
    # offline, vLLM's LLM.chat keywords give the same prompt
    offline = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), add_generation_prompt=False,
                       continue_final_message=True, chat_template_kwargs={"enable_thinking": False})[0]
    assert offline.prompt_token_ids == ids and offline.text == want
    status, _, out = post(f"{http}/v1/chat/completions", {**body, "continue_final_message": None,
                                                           "add_generation_prompt": None})
    thinking = llm.tokenizer.encode_chat(CHAT, enable_thinking=False)
    assert status == 200 and out["usage"]["prompt_tokens"] == len(thinking), out
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT], continue_final_message=True,
                           chat_template_kwargs='{"enable_thinking": false}')
    sampling = pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    replies = list(grpc_stub(served["grpc"]).Generate(pb.GenerateRequest(chat=chat, sampling=sampling), timeout=60))
    assert "".join(r.text for r in replies) == want and replies[-1].usage.prompt_tokens == len(ids)
    bad = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT], chat_template_kwargs="[1]")
    with pytest.raises(grpc.RpcError) as err:
        list(grpc_stub(served["grpc"]).Generate(pb.GenerateRequest(chat=bad, sampling=sampling), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat_template_kwargs" in err.value.details()


@pytest.mark.slow
@pytest.mark.parametrize("extra,param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"continue_final_message": "yes"}, "continue_final_message"),
])
def test_misuse_is_a_400_naming_the_field(served, extra, param):
    http = served["http"]
    status, _, out = post(f"{http}/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **extra})
    assert status == 400 and out["error"]["param"] == param, out
    status, _, out = post(f"{http}/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
    assert status == 200, out




@pytest.mark.slow
def test_tokenize_and_detokenize(ckpt, served):
    from tandem.tokenizer import Tokenizer

    http = served["http"]
    tok = Tokenizer(ckpt)
    status, _, out = post(f"{http}/tokenize", {"prompt": "def f(x):"})
    assert status == 200 and out["tokens"] == tok.encode("def f(x):") and out["count"] == len(out["tokens"]), out
    assert out["max_model_len"] == 1024 and out["tokens"][0] == tok.bos_token_id
    status, _, out = post(f"{http}/tokenize", {"prompt": "def f(x):", "add_special_tokens": False})
    assert status == 200 and out["tokens"] == tok.encode("def f(x):", add_special_tokens=False)
    status, _, out = post(f"{http}/tokenize", {"messages": CHAT, "continue_final_message": True,
                                               "chat_template_kwargs": {"enable_thinking": False}})
    want = tok.encode_chat(CHAT, add_generation_prompt=False, continue_final_message=True)
    assert status == 200 and out["tokens"] == want, out
    status, _, out = post(f"{http}/detokenize", {"tokens": want})
    assert status == 200 and out["prompt"] == tok.apply_chat_template(CHAT, False, continue_final_message=True)
    for path, body, param in [("/tokenize", {"prompt": ""}, "prompt"),
                              ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
                              ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
                              ("/tokenize", {"messages": CHAT, "continue_final_message": 1}, "continue_final_message"),
                              ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")]:
        status, _, out = post(f"{http}{path}", body)
        assert status == 400 and out["error"]["param"] == param, (path, body, out)

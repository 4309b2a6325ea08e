"""Talk to tandem with the official `openai` client: a streamed chat completion and a completion.

    tandem up                          # in another terminal
    pip install openai
    python examples/openai_client.py [--url http://127.0.0.1:8000]
"""

import argparse

from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP address")
parser.add_argument("--max-tokens", type=int, default=32)
args = parser.parse_args()

client = OpenAI(base_url=f"{args.url}/v1", api_key="unused")  # tandem does not check keys
model = client.models.list().data[0].id  # the one model the router serves

# Chat completion, streamed as server-sent events.
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Write a haiku about the sea."}],
    max_tokens=args.max_tokens, temperature=0, stream=True)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

# Plain completion, in one response.
completion = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=args.max_tokens,
                                       temperature=0)
print(completion.choices[0].text)
print(f"[{completion.choices[0].finish_reason}, {completion.usage.completion_tokens} tokens]")

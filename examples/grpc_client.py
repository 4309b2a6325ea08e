"""Stream one completion and one chat reply from tandem's gRPC API (`tandem.v1.Generation/Generate`).

    tandem up                          # in another terminal
    python examples/grpc_client.py [--url 127.0.0.1:50051]
"""

import argparse

import grpc

from tandem.protocol import generation_pb2 as pb
from tandem.protocol import generation_pb2_grpc

parser = argparse.ArgumentParser()
parser.add_argument("--url", default="127.0.0.1:50051", help="the router's gRPC address")
parser.add_argument("--max-tokens", type=int, default=32)
args = parser.parse_args()

stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(args.url))
sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)  # temperature 0: greedy

# A plain-text prompt: the server streams tokens as they are generated; the last message has
# finished=True, the finish reason and the token usage.
for response in stub.Generate(pb.GenerateRequest(text="def fibonacci(n):", sampling=sampling)):
    print(response.text, end="", flush=True)
    if response.finished:
        print(f"\n[{response.finish_reason}, {response.usage.completion_tokens} tokens]")

# A chat: the router applies the model's chat template to the messages.
chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Write a haiku about the sea.")])
for response in stub.Generate(pb.GenerateRequest(chat=chat, sampling=sampling)):
    print(response.text, end="", flush=True)
print()

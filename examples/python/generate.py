"""Stream a completion, or a chat reply, from a splitserve frontend: grpcio and the stubs generated from
``protos/splitserve/frontend/v1/generation.proto`` that ship in the splitserve package, nothing else of it.

    .venv/bin/python examples/python/generate.py --address localhost:50051 "The capital of France is"
    .venv/bin/python examples/python/generate.py --chat "Write a haiku about autumn." --max-tokens 40
    .venv/bin/python examples/python/generate.py --ssl-ca-certs ca.pem --api-key KEY "Hello"

Prints the text as it streams, then a newline; the finish reason and the token counts go to stderr. Exits 1 with
the call's status code and message when the call fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc

from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="the prompt; with --chat, the user's message")
    parser.add_argument("--address", default="localhost:50051", help="the frontend, HOST:PORT")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a chat message (Chat, not Generate)")
    parser.add_argument("--max-tokens", type=int, default=64, help="at most this many new tokens (default 64)")
    parser.add_argument("--lora", default="", help="generate with this loaded LoRA adapter (default: the base model)")
    parser.add_argument(
        "--temperature", type=float, default=None, help="0 is greedy (default: the model's generation config)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SPLITSERVE_API_KEY"),
        help="sent as 'authorization: Bearer KEY' (default: $SPLITSERVE_API_KEY)",
    )
    parser.add_argument("--tls", action="store_true", help="TLS, checking the server against the system's CAs")
    parser.add_argument("--ssl-ca-certs", default=None, help="TLS, checking the server against this CA (PEM)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the whole call (default: no limit)")
    return parser.parse_args(argv)


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext unless ``--tls`` or ``--ssl-ca-certs`` is given."""
    if args.ssl_ca_certs is None and not args.tls:
        return grpc.insecure_channel(args.address)
    root_certificates = Path(args.ssl_ca_certs).read_bytes() if args.ssl_ca_certs else None
    return grpc.secure_channel(args.address, grpc.ssl_channel_credentials(root_certificates=root_certificates))


def start_call(stub: api_grpc.GenerationStub, args: argparse.Namespace) -> Iterator[api.GenerateResponse]:
    """A streaming Generate (or Chat) whose messages each hold the text that is new since the previous one."""
    params = api.SamplingParams(max_tokens=args.max_tokens, output_kind=api.OUTPUT_KIND_DELTA)
    if args.temperature is not None:
        params.temperature = args.temperature
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    if args.chat:
        message = api.ChatMessage(role="user", content=[api.ContentPart(text=args.prompt)])
        request = api.ChatRequest(messages=[message], sampling_params=params, lora_name=args.lora)
        return stub.Chat(request, metadata=metadata, timeout=args.timeout)
    request = api.GenerateRequest(prompt=args.prompt, sampling_params=params, lora_name=args.lora)
    return stub.Generate(request, metadata=metadata, timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    finish_reason, usage, printed = "", api.Usage(), False
    try:
        with open_channel(args) as channel:
            for response in start_call(api_grpc.GenerationStub(channel), args):
                for output in response.outputs:  # one completion (n = 1)
                    sys.stdout.write(output.text)
                    sys.stdout.flush()
                    printed = printed or bool(output.text)
                    finish_reason = output.finish_reason or finish_reason
                usage = response.usage
    except grpc.RpcError as e:
        if printed:
            print(flush=True)  # ends the text's line before the error
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving the channel cancels the call: the server aborts the request
        print()
        return 130
    print()
    print(
        f"[finish_reason {finish_reason}, {usage.prompt_tokens} prompt tokens, {usage.completion_tokens} completion "
        "tokens]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

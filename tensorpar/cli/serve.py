"""`tensorpar serve`: an OpenAI-compatible server of a sharded model (docs/serving.md)."""
from __future__ import annotations

import json
import sys

from tensorpar.cli.progress import reporting_rank


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model split over local ranks through an OpenAI-compatible HTTP API")
    p.add_argument("--model", metavar="DIR", required=True,
                   help="a local Hugging Face checkpoint of a Llama, Mistral or Qwen2 model")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: ranks to split over (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--max-batch", type=int, default=32,
                   help="requests decoded together: slots of the preallocated KV cache (default 32)")
    p.add_argument("--max-tokens-in-flight", type=int, default=512,
                   help="tokens one engine step runs: a token per running stream, the rest prompt chunks "
                        "(default 512; at least --max-batch)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot; past it a request gets 429 (default 256)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="positions per request, prompt and completion (default: the model's)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, bfloat16, float16")
    p.add_argument("--backend", default="auto", help="auto (default), shm, gloo, nccl")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the folder's)")
    p.add_argument("--json", action="store_true",
                   help="one JSON line on stdout when listening (url, port, rank pids) and one when stopped")
    p.set_defaults(func=main)


def main(args) -> int:
    from tensorpar.jobs.serve import ServeOptions, serve

    opts = ServeOptions(args.model, tp=args.tp, host=args.host, port=args.port, max_batch=args.max_batch,
                        max_tokens_in_flight=args.max_tokens_in_flight, max_queue=args.max_queue,
                        max_model_len=args.max_model_len, api_key=args.api_key, dtype=args.dtype,
                        backend=args.backend, name=args.served_model_name)

    def ready(info: dict) -> None:
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            print(f"tensorpar serve: {info['model']} (tp {info['tp']}, {info['dtype']}) listening on {info['url']}",
                  file=sys.stderr, flush=True)
    summary = serve(opts, on_ready=ready)
    if not reporting_rank():  # under torchrun every process holds rank 0's summary: rank 0 prints it
        return 130 if summary["forced"] else 0
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        print(f"tensorpar serve: stopped after {summary['requests']} requests, {summary['generated_tokens']} "
              f"tokens generated{' (forced)' if summary['forced'] else ''}", file=sys.stderr)
    return 130 if summary["forced"] else 0

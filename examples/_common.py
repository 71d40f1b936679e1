"""What the examples share: pick a backend from the command line."""

from __future__ import annotations

import argparse


def backend_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running `radixkv serve` (default: the embedded model in this process)")
    parser.add_argument("--api-key", help="the server's --api-key, if it has one")


def make_backend(args):
    """RuntimeEndpoint for --url, else an in-process engine on the embedded model."""
    from radixkv.frontend import EngineBackend, RuntimeEndpoint

    if args.url:
        return RuntimeEndpoint(args.url, api_key=args.api_key)
    return EngineBackend(attention_backend="torch", kv_cache_tokens=16384)

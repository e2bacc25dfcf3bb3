"""A split client in its own process, for the concurrency section (`python -m bench.client_worker`).

It loads the client bundle once, connects, then reads one command per line on stdin and answers one JSON
line on stdout:

    {"prompt": "...", "tokens": 32}   ->  {"start": t, "end": t, "generated": n, "ttft": s, "tps": x, "cpu": s}

Times are `time.perf_counter()` (CLOCK_MONOTONIC, comparable across processes on one machine); `cpu` is
the CPU seconds this process spent on that turn. An empty line or EOF ends the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this client")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from infemeral.client.client import Client
    from infemeral.client.sampling import SamplingParams

    client = Client(args.server, args.bundle, timeout=600, client_device="cpu")
    client.eos_ids = set()  # exactly the requested number of tokens
    client.new_session().chat("Hello!", SamplingParams(max_new_tokens=2))  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        cmd = json.loads(line)
        session = client.new_session()
        cpu, start = time.process_time(), time.perf_counter()
        r = session.chat(cmd["prompt"], SamplingParams(max_new_tokens=cmd["tokens"], speculate="off"))
        end = time.perf_counter()
        cpu = time.process_time() - cpu
        session.delete()
        print(json.dumps({"start": start, "end": end, "generated": r.generated_tokens, "ttft": r.time_to_first_token,
                          "tps": r.tokens_per_second, "cpu": cpu}), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

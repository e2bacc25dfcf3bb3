"""How closely a reduced client half follows the float32 one: the study behind docs/benchmarks/client_agreement.md.

The definitions and the measure are infemeral/eval/client_precision.py. On the default model the continuations
are float32 greedy generations (the real split: client bundle, float32 server layers). On a random-weight model
greedy falls into a short cycle within a few tokens, so there the positions are a fixed random token sequence
instead, and the server is an identity stand-in (the client's layer output goes straight to the final norm and
head): 32 layers of an 8B model cannot run in float32 on a laptop CPU, and only the client half is under test.

    python scripts/studies/client_precision.py                          # default model, 512 greedy positions
    python scripts/studies/client_precision.py --model random-8b        # 8B-shaped random client half
    python scripts/studies/client_precision.py --write docs/benchmarks/client_agreement.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from infemeral.client_half.half import ClientModel
from infemeral.eval.client_precision import (MODES, PROMPTS, RANDOM_8B, ClientComparison, IdentityServer, measure,
                                             random_client_tensors)
from infemeral.eval.metrics import Sequence, chat_ids, greedy_sequences
from infemeral.eval.systems import Split

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the studies package, run as a file too
from studies.docs_block import put_block  # noqa: E402

MARKER = "<!-- agreement {} {} -->"  # start/end, model: regenerated blocks in the markdown file


# -- the two settings: the default model (real split), an 8B-shaped random client half ----------------

def default_model_setup(num_positions: int, work: Path):
    """Bundles of the packaged model; float32 client and server; greedy continuations of chat prompts."""
    from infemeral.cloak.bundle import ClientBundle, ServerBundle
    from infemeral.cloak.prepare import prepare
    from infemeral.layers.stack import LayerStack

    bundles = prepare(None, work, progress=False)
    bundle = ClientBundle.open(bundles.client_dir)
    server_bundle = ServerBundle.open(bundles.server_dir)
    first = server_bundle.first_layer
    server = LayerStack(server_bundle.config, first,
                        [server_bundle.layer_weights(i) for i in range(first, first + server_bundle.num_layers)])
    reference = ClientModel(bundle, dtype="float32", device="cpu")
    tokenizer = bundle.tokenizer()
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    stop = {tokenizer.eos_token_id, *_eos_ids(bundle)}
    per_prompt = -(-num_positions // 4)
    sequences = greedy_sequences(Split(reference, server), prompts, num_positions, stop, per_prompt=per_prompt)
    candidates = {label: (lambda kw=kw: ClientModel(bundle, device="cpu", **kw)) for label, kw in MODES.items()}
    return reference, candidates, server, sequences


def _eos_ids(bundle) -> set[int]:
    eos = bundle.generation_config().eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def random_model_setup(num_positions: int, shape: dict = RANDOM_8B, seed: int = 0):
    from transformers import LlamaConfig

    from infemeral.cloak.basis import random_orthogonal

    config = LlamaConfig(**shape, rope_theta=500000.0, rms_norm_eps=1e-5)
    tensors = random_client_tensors(config, seed)
    basis = random_orthogonal(config.hidden_size, bytes(32)).float()
    reference = ClientModel.from_tensors(config, 1, tensors, basis, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (num_positions + 1,), generator=g).tolist()
    sequences = [Sequence(ids[:1], ids[1:])]
    candidates = {label: (lambda kw=kw: ClientModel.from_tensors(config, 1, tensors, basis, device="cpu", **kw))
                  for label, kw in MODES.items()}
    return reference, candidates, IdentityServer(), sequences


# -- report ---------------------------------------------------------------------------------------------

def table(results: list[ClientComparison]) -> str:
    lines = ["| client | positions | top-1 agreement | first divergence | max logit error | mean logit error | "
             "median top-2 gap (fp32) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        a = r.agreement
        first = "none" if a.first_divergence is None else str(a.first_divergence)
        lines.append(f"| {r.label} | {a.positions} | {a.top1_rate:.4f} | {first} | {r.max_logit_error:.3f} | "
                     f"{r.mean_logit_error:.4f} | {r.median_top2_gap:.3f} |")
    return "\n".join(lines)


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace (or append) the block for `heading` between this module's markers."""
    put_block(path, MARKER.format("start", heading), MARKER.format("end", heading), body, "Client agreement with float32")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/studies/client_precision.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["default", "random-8b"], default="default")
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--write", type=Path, help="markdown file to put the table in")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        if args.model == "default":
            setup = default_model_setup(args.positions, Path(work))
            what = ("Default model (SmolLM2-135M-Instruct), real split with float32 server layers; "
                    "float32 greedy continuations of chat prompts")
        else:
            setup = random_model_setup(args.positions)
            what = ("Llama-3-8B-shaped client half with random weights, identity stand-in for the server; "
                    "a fixed random token sequence")
        reference, candidates, server, sequences = setup
        results = measure(reference, candidates, server, sequences)
    count = sum(len(s.continuation) for s in sequences)
    body = f"{what}: {count} positions in {len(sequences)} sequence{'s' if len(sequences) > 1 else ''}.\n\n"
    body += table(results)
    print(body)
    for r in results:
        print(asdict(r), file=sys.stderr)
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.write:
        write_section(args.write, args.model, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a draft-head training run does (`train.py`), and its command-line flags: no torch here, so the
command line answers `--help` at once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path("~/.cache/infemeral/train-drafter")


@dataclass
class TrainSettings:
    """What a training run does; the defaults train a head for the default model on a quiet 2-core AVX2 CPU in
    about 27 minutes: answers 12.7 (~160 tokens/s in float32), training 14, the held-out measurement under 1.
    More answers and more steps both help a head this small (it fits its training answers far better than
    new ones): 320 answers of 128 tokens (in bfloat16) and 10 minutes gave a first draft right 42% of the time
    on the held-out answers these defaults measure 48% on; these defaults' answers with 5 minutes of training,
    42%. Unrolling two drafts (`unroll`) halves the steps the budget buys: on a CPU it traded the first
    draft's accuracy (43%) for the later ones' (tokens per step unchanged, 1.81); where training is cheap
    (CUDA) it may be the better use."""

    prompts: int = 512            # chat prompts the model answers (training data)
    max_new_tokens: int = 192     # per answer
    draft_vocab: int = 8192       # tokens of the draft vocabulary (0: the whole vocabulary)
    minutes: float = 14.0         # training time
    max_steps: int = 0            # stop after this many steps even within the time (0: no limit)
    batch_tokens: int = 2048      # positions per optimiser step
    lr: float = 2e-3
    feature_weight: float = 1.0   # EAGLE's weights of the two losses
    token_weight: float = 0.1
    unroll: int = 1               # drafts in a row trained as drafting runs them (EAGLE-3's training-time test)
    unroll_weight: float = 0.8    # weight of the s-th of those drafts' loss: unroll_weight ** s
    noise: float = 0.2            # uniform noise on input features, relative to their RMS
    held_out: int = 16            # prompts kept out of training, for the acceptance measurement
    eval_drafts: int = 5          # k of that measurement
    generate_batch: int = 64
    in_flight: int = 8            # answers from a pod: turns at once (its per-address limit is 8 by default)
    generate_dtype: str = "auto"  # of the answers and their features (auto: on a CPU float32 unless bf16 is native)
    device: str = "auto"
    threads: int = 0              # CPU threads (0: the faster of one and all, measured on the model)
    eval_positions: int = 64      # answer positions per held-out prompt that are measured
    seed: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainSettings()
    parser.add_argument("--model", default="default",
                        help="the checkpoint `prepare` reads: 'default' (the packaged SmolLM2), a .gguf file or a "
                             "model directory")
    parser.add_argument("--output", "-o", type=Path, default=None,
                        help="directory to write the head to (default: draft-head/ beside the default bundles)")
    parser.add_argument("--prompts", type=int, default=d.prompts, help="chat prompts the model answers")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens per answer")
    parser.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                        help="tokens of the reduced draft vocabulary (0: the whole vocabulary)")
    parser.add_argument("--minutes", type=float, default=d.minutes, help="training time, after the data is made")
    parser.add_argument("--max-steps", type=int, default=d.max_steps, help="stop after this many steps (0: none)")
    parser.add_argument("--unroll", type=int, default=d.unroll,
                        help="drafts in a row trained as drafting runs them (EAGLE-3's training-time test; each "
                             "costs a pass: worth it where training is cheap, e.g. on CUDA)")
    parser.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    parser.add_argument("--threads", type=int, default=d.threads,
                        help="CPU threads (0: the faster of one and all, measured on the model)")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE),
                        help="where the model's answers and features are kept between runs ('none': nowhere)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--in-flight", type=int, default=d.in_flight,
                        help="with --server: prompts answered at once, for the pod to batch (at most its "
                             "per-client limit)")



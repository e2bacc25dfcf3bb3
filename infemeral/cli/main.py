"""`infemeral-client`: its commands and their flags; `main` runs one (the commands are in `commands.py`).

Every flag comes from a settings class (`flags.py`), so flags, INFEMERAL_*
variables and their help never drift apart.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from infemeral import logs
from infemeral.cli import commands, server_errors
from infemeral.cli.fast_exit import exit_now
from infemeral.settings_flags import add_settings_flags
from infemeral.client.settings import ClientSettings
from infemeral.endpoint.settings import ServeSettings
from infemeral.errors import InfemeralError
from infemeral.speculation.head.settings import add_arguments as add_head_training_arguments

CONNECTION = ("server", "client_bundle", "timeout", "tls_ca", "tls_client_cert", "tls_client_key", "tls_server_name",
              "api_key", "api_key_file")
LOCAL_COMPUTE = ("client_dtype", "client_device", "client_quant", "wire")
SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop")
SPECULATION = ("speculate", "max_draft", "draft_model", "draft_head", "answer_index", "answer_index_dir",
               "answer_index_tokens")

# chat and generate sample where the model's generation config does not (see sampling.CHAT_SAMPLING)
ANSWER_SAMPLING = ("Without --temperature, answers are sampled as the model's generation config says, or where it "
                   "does not sample at temperature 0.7, top-p 0.9 and repetition penalty 1.1. --greedy (or "
                   "--temperature 0) decodes greedily, token for token what transformers would answer.")
ANSWER_DEFAULTS = {"temperature": "the model's, else 0.7", "top_p": "the model's, else 0.9",
                   "repetition_penalty": "the model's, else 1.1 (1 with --greedy)"}

# int4 served layers against bf16: the 8B shape's server bundle, as docs/benchmarks/server_quant.md measures it
INT4_OF_BF16 = "0.29x"

EPILOG = f"""\
first steps:
  infemeral-client prepare                       # split the packaged SmolLM2 into bundles
  infemeral-server --bundle ~/.local/share/infemeral/bundles/default/server &
  infemeral-client generate "What is the capital of France?"
  infemeral-client chat --session work           # resumable chat
  infemeral-client chat --from work --session q2  # a second conversation from where `work` is
  infemeral-client audit "My SSN is 078-05-1120"  # what could the pod learn from this prompt?
  infemeral-client train-drafter                 # a draft head for the model: faster open chat over a WAN
  infemeral-client prepare --server-quant int4   # served layers in int4 (~{INT4_OF_BF16} of bf16); warns if
                                                 # top-1 agreement with float32 is poor
  infemeral-client eval server-quant             # what that costs in perplexity and agreement
  infemeral-client serve                         # OpenAI-compatible API on http://127.0.0.1:8080/v1

Every flag can also be set as an INFEMERAL_* environment variable, e.g.
INFEMERAL_SERVER=pod.example.com:50051 or INFEMERAL_TEMPERATURE=0.7.
"""


def _local_compute(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("laptop half (speed against exactness; see README)")
    add_settings_flags(group, ClientSettings, LOCAL_COMPUTE)


def _connection_and_sampling(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, ClientSettings, CONNECTION)
    _local_compute(parser)
    group = parser.add_argument_group("sampling", ANSWER_SAMPLING)
    add_settings_flags(group, ClientSettings, SAMPLING, shown_defaults=ANSWER_DEFAULTS)
    group.add_argument("--greedy", action="store_true",
                       help="greedy decoding: always the most likely token (the same as --temperature 0)")
    group = parser.add_argument_group("speculative decoding (several tokens per round trip; same output)")
    add_settings_flags(group, ClientSettings, SPECULATION)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print timings, token counts and tokens per round trip to stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infemeral-client", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Chat with a large model on a remote GPU. Text, token ids and logits stay on this machine; "
                    "`infemeral-client audit` shows what the GPU's operator could still recover during a turn.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare", help="split a model into a private client bundle and a rotated server bundle",
                       description="Split a model into a client bundle (keep it private; it holds the secret basis) "
                                   "and a server bundle (upload it to the GPU pod).")
    p.add_argument("model", nargs="?", default="default",
                   help="Hugging Face model id, local model directory or .gguf file "
                        "(default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--output", type=Path, default=None,
                   help="write <output>/client and <output>/server (default: ~/.local/share/infemeral/bundles/default)")
    p.add_argument("--client-dir", type=Path, help="client bundle directory (overrides --output)")
    p.add_argument("--server-dir", type=Path, help="server bundle directory (overrides --output)")
    p.add_argument("--client-layers", type=int, default=1, help="decoder layers run on the client (default: 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the bundles are stored in (default: float32)")
    p.add_argument("--client-quant", default="none", choices=["none", "int8"],
                   help="int8: store the client's layers, embedding and LM head as int8 with per-row scales "
                        "(a client bundle ~4x smaller than float32; it then always runs with int8 weights)")
    p.add_argument("--server-quant", default="none", choices=["none", "int8", "int4"],
                   help="store the served layers quantised: int8 (a scale per row, ~0.5x bf16) or int4 (groups of "
                        f"--group-size input columns, ~{INT4_OF_BF16} bf16 at 64); measure the cost on your model with "
                        "`infemeral-client eval server-quant`")
    p.add_argument("--group-size", type=int, default=None,
                   help="int4: input columns per scale and zero, 32, 64, 128 or 256 (default: 64)")
    p.add_argument("--quant-method", default=None, choices=["rtn", "hqq", "gptq"],
                   help="how codes are chosen: rtn (round to nearest), hqq (data-free fit, int4 only; needs "
                        "infemeral[quant]) or gptq (calibrated here on a few thousand tokens of chat text); default: rtn for "
                        "int8, gptq for int4")
    p.add_argument("--no-agreement-check", action="store_true",
                   help="quantized served layers: skip the closing check of how often the bundle's next token agrees "
                        "with float32's (a few seconds; the default model's)")
    p.add_argument("--force", action="store_true",
                   help="replace existing bundles: a new secret basis, so sessions stored under the old one become "
                        "unreadable and a server serving the old server bundle refuses the new client bundle")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    g = sub.add_parser("generate", help="answer one prompt, streaming the text",
                       description="Answer one prompt in a fresh session and stream the answer to stdout.")
    g.add_argument("prompt", help="the question or instruction ('-' reads it from stdin)")
    g.add_argument("--system", help="system prompt")
    g.add_argument("--raw", action="store_true",
                   help="continue the prompt as raw text, without the chat template (base models, "
                        "template-free prompts)")
    g.add_argument("--truncate", action="store_true",
                   help="answer a prompt longer than the server's context by letting its window drop the start "
                        "(default: refuse it)")
    _connection_and_sampling(g)

    c = sub.add_parser("chat", help="interactive chat; resumable with --session",
                       description="Interactive chat with line editing and history. Type a message and press "
                                   "Enter; /help lists the commands, /exit or Ctrl-D quits, /reset starts over. "
                                   "End a line with \\ (or wrap the message in \"\"\") for several lines. "
                                   "Ctrl-C stops an answer and keeps the conversation as it was. With --session "
                                   "NAME the conversation is saved after every turn and resumed next time; without "
                                   "it, it is deleted on the server when the chat ends. A turn that fails (network, "
                                   "server) is reported and leaves the conversation as it was. Answers are sampled "
                                   "(see below); --greedy decodes greedily.")
    c.add_argument("--session", help="name of a saved session to resume or create")
    c.add_argument("--from", dest="from_session", metavar="NAME",
                   help="continue a copy of the saved session NAME, made on the server: its conversation is not "
                        "uploaded again, and NAME stays as it was; saved as --session if given, which must be new")
    c.add_argument("--system", help="system prompt for a new session")
    add_settings_flags(c, ClientSettings, ("sessions_dir", "chat_history"))
    _connection_and_sampling(c)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP endpoint on this machine",
                       description="Serve the OpenAI API (/v1/models, /v1/chat/completions, /v1/completions) on "
                                   "this machine, forwarding to the infemeral server: point any OpenAI client at "
                                   "http://HOST:PORT/v1. Text stays in this process; the server sees what every "
                                   "infemeral turn sends. Loopback only unless --api-key is set. Sampling flags "
                                   "are defaults for requests that leave a value out.")
    add_settings_flags(s, ServeSettings)
    upstream = s.add_argument_group("infemeral server")
    add_settings_flags(upstream, ClientSettings, tuple(n for n in CONNECTION if n not in ("api_key", "api_key_file"))
                       + ("sessions_dir",))
    upstream.add_argument("--server-api-key", help="API key the infemeral server asks for (env INFEMERAL_API_KEY; "
                                                        "or a file: INFEMERAL_API_KEY_FILE)")
    _local_compute(s)
    group = s.add_argument_group("sampling defaults")
    add_settings_flags(group, ClientSettings, SAMPLING)
    group = s.add_argument_group("speculative decoding (several tokens per round trip; same output)")
    add_settings_flags(group, ClientSettings, SPECULATION)

    i = sub.add_parser("info", help="show what the server serves and how the laptop's half computes",
                       description="Ask the server what it serves (model shape, dtype, device, context and step "
                                   "limits, window) and check that the client bundle belongs to it (exit status 1 "
                                   "if it does not); --laptop-half also shows how this machine's half computes.")
    add_settings_flags(i, ClientSettings, CONNECTION)
    i.add_argument("--json", action="store_true",
                   help="print the server's info as JSON (with client_bundle_matches), for scripts")
    i.add_argument("--laptop-half", action="store_true",
                   help="also load the laptop's half as configured below and show how it computes and its memory "
                        "(loads torch and the weights: a few seconds)")
    _local_compute(i)

    f = sub.add_parser("forget-answers", help="clear the answer index (earlier answers kept for drafting)",
                       description="Delete the answer index: the token ids of earlier answers this client keeps "
                                   "on this machine to draft from (see --answer-index). A chat or serve running now "
                                   "forgets them too. Turn it off for good with --no-answer-index or "
                                   "INFEMERAL_ANSWER_INDEX=false.")
    add_settings_flags(f, ClientSettings, ("answer_index_dir",))

    a = sub.add_parser("audit", help="measure what the pod could learn from a prompt (runs locally)",
                       description="Run the attacks a curious pod operator could run on exactly what the server "
                                   "would receive for this prompt, and report how much of it each recovers. "
                                   "Runs on this machine with the client bundle; sends nothing anywhere.")
    a.add_argument("prompt", nargs="?", default=None,
                   help="the text to audit, as a user message ('-' reads it from stdin; default: a built-in "
                        "sample with an SSN, a password, a diagnosis and a card number)")
    a.add_argument("--system", help="system prompt")
    add_settings_flags(a, ClientSettings, ("client_bundle",))
    a.add_argument("--server-bundle", type=Path,
                   help="the matching server bundle (default: the server/ directory next to the client bundle); "
                        "needed for K/V inversion and for solving Q")
    a.add_argument("--public-model", metavar="DIR|GGUF",
                   help="the public model the bundles were prepared from: attack with its weights and solve Q from "
                        "the server bundle, instead of simulating that operator with the client's own Q")
    a.add_argument("--wire-dtype", default="float32",
                   choices=["float32", "bfloat16", "float16", "int8", "float8_e4m3fn"],
                   help="dtype of the hidden states on the wire (the server's dtype; int8 for --wire int8 or int8-up, "
                        "float8_e4m3fn for --wire e4m3 or e4m3-up; default: float32)")
    a.add_argument("--json", action="store_true", help="print the report as JSON")
    a.add_argument("--show-tokens", action="store_true",
                   help="also print what each attack recovers of your text (that is your secret: mind your screen)")
    a.add_argument("--quiet", action="store_true", help="no progress bar")

    e = sub.add_parser("eval", help="measure what a setting costs in quality (runs locally)")
    evals = e.add_subparsers(dest="eval", required=True, metavar="WHAT")
    q = evals.add_parser("server-quant", help="a (quantised) server bundle against the float32 model",
                         description="Perplexity on held text and greedy agreement with the float32 model (which the "
                                     "float32 split matches token for token) of your client and server bundle, the "
                                     "served layers run through the kernels the server uses. Runs on this machine.")
    q.add_argument("--model", help="the model the bundles were prepared from (default: the packaged SmolLM2)")
    add_settings_flags(q, ClientSettings, ("client_bundle",))
    q.add_argument("--server-bundle", type=Path,
                   help="the matching server bundle (default: the server/ directory next to the client bundle)")
    q.add_argument("--text", type=Path, help="held text for perplexity (default: a Genesis excerpt in the package)")
    q.add_argument("--tokens", type=int, default=1024, help="tokens of it to score (default: 1024)")
    q.add_argument("--positions", type=int, default=512, help="greedy positions compared (default: 512)")
    q.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="activations of the served layers (default: float32)")
    q.add_argument("--quiet", action="store_true", help="no progress bar")

    t = sub.add_parser("train-drafter", help="train a draft head for a model (faster open chat over a WAN)",
                       description="Train a draft head (EAGLE-style: one decoder layer over the model's own top-layer "
                                   "features) by self-distillation: the model answers a set of chat prompts here, "
                                   "or with --server the pod and the laptop's half answer them (a model too big "
                                   "for this machine), and the head learns to predict its next features and "
                                   "tokens. Trains on this machine (CUDA if there is one); writes the EAGLE "
                                   "layout (config.json, model.safetensors), by default beside the default "
                                   "bundles, where --speculate auto finds it.")
    add_head_training_arguments(t)
    pod = t.add_argument_group("answers from a pod (--server, instead of --model: a model too big for this machine)")
    add_settings_flags(pod, ClientSettings, CONNECTION, shown_defaults={
        "server": "none: the model answers here, whatever INFEMERAL_SERVER says"})
    _local_compute(t)

    d = sub.add_parser("delete", help="delete a saved session here and on the server",
                       description="Delete a session saved by `chat --session NAME`: its file on this machine and "
                                   "its encrypted KV cache on the server (a chat without --session deletes its own "
                                   "when it ends).")
    d.add_argument("--session", required=True, help="name of the saved session")
    add_settings_flags(d, ClientSettings, CONNECTION + ("sessions_dir",))
    return parser


COMMANDS = {"prepare": commands.prepare, "generate": commands.generate, "chat": commands.chat, "info": commands.info,
            "audit": commands.audit, "delete": commands.delete, "forget-answers": commands.forget_answers,
            "serve": commands.serve, "eval": commands.evaluate, "train-drafter": commands.train_drafter}


def _server_address(args: argparse.Namespace) -> str:
    return getattr(args, "server", None) or ClientSettings().server


def main(argv: list[str] | None = None) -> int:
    """Run one command. Without `argv` (as `infemeral-client` and `python -m infemeral.cli` call it) it reads
    sys.argv and ends the process itself when the command is done, skipping the interpreter's teardown."""
    if argv is None:
        exit_now(main(sys.argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s",
                        handlers=[logs.StderrHandler()])
    logs.route_library_messages()  # stdout holds answers alone
    try:
        return COMMANDS[args.command](args)
    except InfemeralError as e:
        if server_errors.is_unreachable(e):  # not a usage error: the same command works once a server is there
            print(f"infemeral-client: {server_errors.describe(e, _server_address(args))}", file=sys.stderr)
            return 1
        print(f"infemeral-client: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"infemeral-client: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)  # the shell's prompt on a line of its own, not after the answer's last word
        return 130

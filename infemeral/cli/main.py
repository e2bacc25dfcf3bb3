"""`infemeral-client`: prepare bundles, then generate or chat through an infemeral server."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

from infemeral.cli.flags import add_settings_flags, settings_from_args
from infemeral.config import ClientSettings, ServeSettings
from infemeral.errors import InfemeralError

CONNECTION = ("server", "client_bundle", "timeout", "tls_ca", "tls_client_cert", "tls_client_key", "tls_server_name",
              "api_key")
LOCAL_COMPUTE = ("client_dtype", "client_device", "client_quant")
SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop")
SPECULATION = ("speculate", "max_draft", "draft_model", "answer_index", "answer_index_dir", "answer_index_tokens")

EPILOG = """\
first steps:
  infemeral-client prepare                       # split the packaged SmolLM2 into bundles
  infemeral-server --bundle ~/.local/share/infemeral/bundles/default/server &
  infemeral-client generate "What is the capital of France?"
  infemeral-client chat --session work           # resumable chat
  infemeral-client audit "My SSN is 078-05-1120"  # what could the pod learn from this prompt?
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
    group = parser.add_argument_group("sampling")
    add_settings_flags(group, ClientSettings, SAMPLING)
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
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    g = sub.add_parser("generate", help="answer one prompt, streaming the text",
                       description="Answer one prompt in a fresh session and stream the answer to stdout.")
    g.add_argument("prompt", help="the question or instruction ('-' reads it from stdin)")
    g.add_argument("--system", help="system prompt")
    g.add_argument("--raw", action="store_true",
                   help="continue the prompt as raw text, without the chat template (base models, "
                        "template-free prompts)")
    _connection_and_sampling(g)

    c = sub.add_parser("chat", help="interactive chat; resumable with --session",
                       description="Interactive chat with line editing and history. Type a message and press "
                                   "Enter; /help lists the commands, /exit or Ctrl-D quits, /reset starts over. "
                                   "End a line with \\ (or wrap the message in \"\"\") for several lines. "
                                   "Ctrl-C stops an answer and keeps the conversation as it was. With --session "
                                   "NAME the conversation is saved after every turn and resumed next time. A turn "
                                   "that fails (network, server) is reported and leaves the conversation as it "
                                   "was. Sampling defaults come from the model's generation config when it has "
                                   "them; flags and INFEMERAL_* variables override them.")
    c.add_argument("--session", help="name of a saved session to resume or create")
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
    add_settings_flags(upstream, ClientSettings, tuple(n for n in CONNECTION if n != "api_key"))
    upstream.add_argument("--server-api-key", help="API key the infemeral server asks for (env INFEMERAL_API_KEY)")
    _local_compute(s)
    group = s.add_argument_group("sampling defaults")
    add_settings_flags(group, ClientSettings, SAMPLING)
    group = s.add_argument_group("speculative decoding (several tokens per round trip; same output)")
    add_settings_flags(group, ClientSettings, SPECULATION)

    i = sub.add_parser("info", help="show what the server serves and how the laptop's half computes")
    add_settings_flags(i, ClientSettings, CONNECTION)
    _local_compute(i)

    f = sub.add_parser("forget-answers", help="clear the answer index (earlier answers kept for drafting)",
                       description="Delete the answer index: the token ids of earlier answers this client keeps "
                                   "on this machine to draft from (see --answer-index). Turn it off for good with "
                                   "--no-answer-index or INFEMERAL_ANSWER_INDEX=false.")
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
    a.add_argument("--wire-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the hidden states on the wire (the server's dtype; default: float32)")
    a.add_argument("--json", action="store_true", help="print the report as JSON")
    a.add_argument("--show-tokens", action="store_true",
                   help="also print what each attack recovers of your text (that is your secret: mind your screen)")
    a.add_argument("--quiet", action="store_true", help="no progress bar")

    d = sub.add_parser("delete", help="delete a saved session here and on the server")
    d.add_argument("--session", required=True, help="name of the saved session")
    add_settings_flags(d, ClientSettings, CONNECTION + ("sessions_dir",))
    return parser


def session_path(settings: ClientSettings, name: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name.startswith("."):
        raise InfemeralError("session names may use letters, digits, '.', '_' and '-' (at most 64)")
    return settings.sessions_dir / f"{name}.session"


def cmd_prepare(args) -> int:
    from infemeral.cloak.heap import map_large_allocations
    from infemeral.cloak.prepare import prepare
    from infemeral.config import DATA_HOME

    map_large_allocations()  # this process only prepares: freed layers go straight back to the OS
    output = args.output or DATA_HOME / "bundles" / "default"
    result = prepare(None if args.model == "default" else args.model, output, client_dir=args.client_dir,
                     server_dir=args.server_dir, client_layers=args.client_layers, dtype=args.dtype,
                     progress=not args.quiet, client_quant=args.client_quant)
    print(f"client bundle (keep private): {result.client_dir}")
    print(f"server bundle (upload to the pod): {result.server_dir}")
    print(f"server fingerprint: {result.fingerprint}")
    return 0


def _client(settings: ClientSettings):
    from infemeral.speculation.answer_index import AnswerIndex
    from infemeral.client.client import Client

    if settings.speculate == "draft" and settings.draft_model is None:
        raise InfemeralError("--speculate draft needs --draft-model PATH (a small local model with the served "
                             "model's tokenizer)")
    client = Client(settings.server, settings.client_bundle, timeout=settings.timeout, tls_ca=settings.tls_ca,
                    tls_client_cert=settings.tls_client_cert, tls_client_key=settings.tls_client_key,
                    tls_server_name=settings.tls_server_name, api_key=settings.api_key,
                    client_dtype=settings.client_dtype, client_device=settings.client_device,
                    client_quant=settings.client_quant)
    try:
        if settings.speculate != "off" and settings.answer_index:
            client.answer_index = AnswerIndex.for_tokenizer(settings.answer_index_dir, client.tokenizer,
                                                            max_tokens=settings.answer_index_tokens)
        if settings.speculate == "draft":
            from infemeral.speculation.draft_model import DraftModel

            client.draft_model = DraftModel.load(settings.draft_model, client.tokenizer)
    except BaseException:
        client.close()
        raise
    return client


def _report(result, verbose: bool) -> None:
    if verbose:
        drafts = (f" ({result.accepted_drafts} of {result.drafted_tokens} drafts accepted)"
                  if result.drafted_tokens else "")
        print(f"[{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated, "
              f"finish={result.finish_reason}, first token {result.time_to_first_token:.2f}s, "
              f"{result.tokens_per_second:.1f} tokens/s, {result.tokens_per_round_trip:.2f} tokens per round trip"
              f"{drafts}, session version {result.version}]", file=sys.stderr)
        if result.evicted_tokens:
            print(f"[context window full: the oldest {result.evicted_tokens} tokens were dropped "
                  f"({result.cache_length} kept)]", file=sys.stderr)


def _sampling(settings: ClientSettings, client):
    """Flags and INFEMERAL_* variables first, then the model's generation config, then the settings' defaults."""
    from infemeral.client.sampling import generation_defaults

    return settings.sampling(generation_defaults(client.bundle.generation_config()))


def cmd_generate(args) -> int:
    settings = settings_from_args(ClientSettings, args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.raw and args.system:
        raise InfemeralError("--system needs the chat template; with --raw put everything in the prompt")
    with _client(settings) as client:
        session = client.new_session(system_prompt=args.system)
        try:
            deltas = (session.stream_raw(prompt, _sampling(settings, client)) if args.raw
                      else session.stream(prompt, _sampling(settings, client)))
            for delta in deltas:
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            _report(session.last_result, args.verbose)
        finally:
            if session.version:
                session.delete()
    return 0


def cmd_chat(args) -> int:
    from infemeral.cli.chat_repl import ChatRepl, say_loading

    settings = settings_from_args(ClientSettings, args)
    path = session_path(settings, args.session) if args.session else None
    say_loading(settings.client_bundle)  # before the heavy imports: the first sign of life comes at once
    with _client(settings) as client:
        return ChatRepl(client, settings, session_name=args.session, session_path=path, system=args.system,
                        verbose=args.verbose, report=_report).run()


def cmd_serve(args) -> int:
    from infemeral.endpoint.serve import serve

    serve_settings = settings_from_args(ServeSettings, args)
    given = {k: v for k, v in vars(args).items() if k != "api_key"}  # --api-key is the endpoint's own key
    if args.server_api_key:
        given["api_key"] = args.server_api_key
    settings = settings_from_args(ClientSettings, argparse.Namespace(**given))
    return serve(serve_settings, lambda: _client(settings), lambda client: _sampling(settings, client),
                 settings.server)


def cmd_info(args) -> int:
    from google.protobuf import json_format

    settings = settings_from_args(ClientSettings, args)
    with _client(settings) as client:
        info = client.server_info()
        print(json_format.MessageToJson(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
        match = info.bundle_fingerprint == client.bundle.server_fingerprint
        print(f"client bundle matches server bundle: {'yes' if match else 'NO'}")
        print(f"laptop half: {client.model.describe()}, {client.model.memory_bytes() / 2**20:.0f} MiB")
    return 0 if match else 1


def cmd_audit(args) -> int:
    from infemeral.audit import audit

    settings = settings_from_args(ClientSettings, args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    report = audit(prompt, settings.client_bundle, system=args.system, server_bundle=args.server_bundle,
                   public_model=args.public_model, wire_dtype=args.wire_dtype, progress=not args.quiet)
    print(report.to_json(args.show_tokens) if args.json else report.text(args.show_tokens))
    return 0


def cmd_delete(args) -> int:
    from infemeral.client.session import Session

    settings = settings_from_args(ClientSettings, args)
    path = session_path(settings, args.session)
    if not path.exists():
        raise InfemeralError(f"no saved session named {args.session!r} in {settings.sessions_dir}")
    with _client(settings) as client:
        session = Session.load(client, path)
        if session.version:
            session.delete()
    path.unlink()
    print(f"deleted session {args.session!r}")
    return 0


def cmd_forget_answers(args) -> int:
    settings = settings_from_args(ClientSettings, args)
    files = sorted(settings.answer_index_dir.glob("*.tokens")) if settings.answer_index_dir.is_dir() else []
    for path in files:
        path.unlink()
    print(f"forgot {len(files)} answer index file(s) in {settings.answer_index_dir}")
    return 0


COMMANDS = {"prepare": cmd_prepare, "generate": cmd_generate, "chat": cmd_chat, "info": cmd_info,
            "audit": cmd_audit, "delete": cmd_delete, "forget-answers": cmd_forget_answers, "serve": cmd_serve}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except InfemeralError as e:
        print(f"infemeral-client: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"infemeral-client: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

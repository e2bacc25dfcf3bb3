"""What each `infemeral-client` command does, once `main.py` has parsed its flags.

Heavy imports (torch, transformers, the model) happen inside the commands, so
`--help` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from infemeral.cli.flags import settings_from_args
from infemeral.client.settings import ClientSettings
from infemeral.endpoint.settings import ServeSettings
from infemeral.errors import InfemeralError


def session_path(settings: ClientSettings, name: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name.startswith("."):
        raise InfemeralError("session names may use letters, digits, '.', '_' and '-' (at most 64)")
    return settings.sessions_dir / f"{name}.session"


def prepare(args) -> int:
    from infemeral.cloak.heap import map_large_allocations
    from infemeral.cloak.prepare import prepare as prepare_bundles
    from infemeral.paths import DATA_HOME

    map_large_allocations()  # this process only prepares: freed layers go straight back to the OS
    output = args.output or DATA_HOME / "bundles" / "default"
    result = prepare_bundles(None if args.model == "default" else args.model, output, client_dir=args.client_dir,
                     server_dir=args.server_dir, client_layers=args.client_layers, dtype=args.dtype,
                     progress=not args.quiet, client_quant=args.client_quant, server_quant=args.server_quant,
                     group_size=args.group_size, quant_method=args.quant_method)
    print(f"client bundle (keep private): {result.client_dir}")
    print(f"server bundle (upload to the pod): {result.server_dir}")
    print(f"server fingerprint: {result.fingerprint}")
    return 0


def open_client(settings: ClientSettings):
    from infemeral.client.client import Client
    from infemeral.speculation.answer_index import AnswerIndex

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


def generate(args) -> int:
    settings = settings_from_args(ClientSettings, args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.raw and args.system:
        raise InfemeralError("--system needs the chat template; with --raw put everything in the prompt")
    with open_client(settings) as client:
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


def chat(args) -> int:
    from infemeral.cli.chat_repl import ChatRepl, say_loading

    settings = settings_from_args(ClientSettings, args)
    path = session_path(settings, args.session) if args.session else None
    say_loading(settings.client_bundle)  # before the heavy imports: the first sign of life comes at once
    with open_client(settings) as client:
        return ChatRepl(client, settings, session_name=args.session, session_path=path, system=args.system,
                        verbose=args.verbose, report=_report).run()


def serve(args) -> int:
    from infemeral.endpoint.serve import serve as serve_endpoint

    serve_settings = settings_from_args(ServeSettings, args)
    given = {k: v for k, v in vars(args).items() if k != "api_key"}  # --api-key is the endpoint's own key
    if args.server_api_key:
        given["api_key"] = args.server_api_key
    settings = settings_from_args(ClientSettings, argparse.Namespace(**given))
    return serve_endpoint(serve_settings, lambda: open_client(settings), lambda client: _sampling(settings, client),
                 settings.server)


def info(args) -> int:
    from google.protobuf import json_format

    from infemeral.client.server_link import ServerLink

    settings = settings_from_args(ClientSettings, args)
    with ServerLink.from_settings(settings) as link:  # no torch, no model: the server's answer at once
        info = link.server_info()
        print(json_format.MessageToJson(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
        match = info.bundle_fingerprint == link.server_fingerprint
        print(f"client bundle matches server bundle: {'yes' if match else 'NO'}")
    if args.laptop_half:
        _describe_laptop_half(settings)
    return 0 if match else 1


def _describe_laptop_half(settings: ClientSettings) -> None:
    """Build the laptop's half as `generate` would (torch, the weights) and say how it computes."""
    from infemeral.client.model.half import ClientModel
    from infemeral.cloak.bundle import ClientBundle

    model = ClientModel(ClientBundle.open(settings.client_bundle), dtype=settings.client_dtype,
                        device=settings.client_device, quant=settings.client_quant)
    print(f"laptop half: {model.describe()}, {model.memory_bytes() / 2**20:.0f} MiB")


def audit(args) -> int:
    from infemeral.audit import audit

    settings = settings_from_args(ClientSettings, args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    report = audit(prompt, settings.client_bundle, system=args.system, server_bundle=args.server_bundle,
                   public_model=args.public_model, wire_dtype=args.wire_dtype, progress=not args.quiet)
    print(report.to_json(args.show_tokens) if args.json else report.text(args.show_tokens))
    return 0


def evaluate(args) -> int:
    """`eval server-quant`: the bundles' served layers against the float32 model, in perplexity and agreement."""
    from infemeral.cloak.bundle import ClientBundle
    from infemeral.eval import server_quant

    settings = settings_from_args(ClientSettings, args)
    client_dir = Path(settings.client_bundle).expanduser()
    server_dir = args.server_bundle or ClientBundle.open(client_dir).directory.parent / "server"
    report = server_quant.run_bundle(args.model, client_dir, server_dir, args.text or server_quant.DEFAULT_TEXT,
                                     args.tokens, args.positions, args.dtype)
    print(report.describe())
    return 0


def delete(args) -> int:
    from infemeral.client import session_file
    from infemeral.client.server_link import ServerLink

    settings = settings_from_args(ClientSettings, args)
    path = session_path(settings, args.session)
    if not path.exists():
        raise InfemeralError(f"no saved session named {args.session!r} in {settings.sessions_dir}")
    with ServerLink.from_settings(settings) as link:  # the session file's header and one call: no model
        session_id, key, version = session_file.identity(path, link.server_fingerprint)
        if version:
            link.delete_session(session_id, key)
    path.unlink()
    print(f"deleted session {args.session!r}")
    return 0


def forget_answers(args) -> int:
    settings = settings_from_args(ClientSettings, args)
    files = sorted(settings.answer_index_dir.glob("*.tokens")) if settings.answer_index_dir.is_dir() else []
    for path in files:
        path.unlink()
    print(f"forgot {len(files)} answer index file(s) in {settings.answer_index_dir}")
    return 0

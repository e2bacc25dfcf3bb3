"""What each `infemeral-client` command does, once `main.py` has parsed its flags.

Heavy imports (torch, transformers, the model) happen inside the commands, so
`--help` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from infemeral.settings_flags import settings_from_args
from infemeral.client.session_store import SUFFIX, check_name
from infemeral.client.settings import ClientSettings
from infemeral.endpoint.settings import ServeSettings
from infemeral.errors import InfemeralError, UsageError

log = logging.getLogger(__name__)
DRAFT_HEAD_DIR = "draft-head"  # beside a prepared client bundle: where train-drafter writes and auto looks


def session_path(settings: ClientSettings, name: str) -> Path:
    return settings.sessions_dir / f"{check_name(name)}{SUFFIX}"


def prepare(args) -> int:
    if not args.quiet:  # the first sign of life, before seconds of imports
        print("loading torch and transformers...", file=sys.stderr, flush=True)
    from infemeral.cloak.heap import map_large_allocations
    from infemeral.cloak.prepare import prepare as prepare_bundles
    from infemeral.paths import DATA_HOME

    map_large_allocations()  # this process only prepares: freed layers go straight back to the OS
    output = args.output or DATA_HOME / "bundles" / "default"
    result = prepare_bundles(None if args.model == "default" else args.model, output, client_dir=args.client_dir,
                     server_dir=args.server_dir, client_layers=args.client_layers, dtype=args.dtype,
                     progress=not args.quiet, client_quant=args.client_quant, server_quant=args.server_quant,
                     group_size=args.group_size, quant_method=args.quant_method, force=args.force,
                     agreement_check=not args.no_agreement_check)
    print(f"client bundle (keep private): {result.client_dir}")
    print(f"server bundle (upload to the pod): {result.server_dir}")
    print(f"server fingerprint: {result.fingerprint}")
    if result.agreement is not None:
        print(f"quantized served layers against float32 on held text: {result.agreement.describe()}")
    return 0


def draft_head_path(settings: ClientSettings) -> Path | None:
    """The draft head to load: --draft-head, or under --speculate auto the one `train-drafter` writes beside the
    client bundle, if it is there."""
    if settings.speculate not in ("head", "auto"):
        return None
    if settings.draft_head is not None:
        return settings.draft_head
    beside = settings.client_bundle.parent / DRAFT_HEAD_DIR
    return beside if settings.speculate == "auto" and (beside / "config.json").exists() else None


def open_client(settings: ClientSettings, interceptors: list | None = None):
    """The SDK's Client for these settings, with its answer index and draft sources (and `interceptors` on its
    channel)."""
    from infemeral.cli.gc_paused import gc_paused

    with gc_paused():  # the heavy imports and the model's load
        return _open_client(settings, interceptors)


def _open_client(settings: ClientSettings, interceptors: list | None = None):
    from infemeral.client.client import Client
    from infemeral.speculation.answer_index import AnswerIndex

    if settings.speculate == "draft" and settings.draft_model is None:
        raise InfemeralError("--speculate draft needs --draft-model PATH (a small local model with the served "
                             "model's tokenizer)")
    head = draft_head_path(settings)
    if settings.speculate == "head" and head is None:
        raise InfemeralError("--speculate head needs --draft-head PATH (`infemeral-client train-drafter` trains one "
                             "for your model)")
    client = Client.from_settings(settings, interceptors)
    try:
        if settings.speculate != "off" and settings.answer_index:
            client.answer_index = AnswerIndex.for_tokenizer(settings.answer_index_dir, client.tokenizer,
                                                            max_tokens=settings.answer_index_tokens)
        if settings.speculate == "draft" or (settings.speculate == "auto" and settings.draft_model is not None):
            from infemeral.speculation.draft_model import DraftModel

            client.draft_model = DraftModel.load(settings.draft_model, client.tokenizer)
        if head is not None:
            client.draft_head = _load_head(head, client, is_found=settings.draft_head is None)
    except BaseException:
        client.close()
        raise
    return client


def _load_head(path: Path, client, *, is_found: bool):
    """The draft head at `path` for this client's model. One that was only found (not asked for) and does not fit
    is left out with a warning: --speculate auto then drafts without it."""
    from infemeral.errors import FailedPrecondition
    from infemeral.speculation.head.drafter import DraftHead

    try:
        return DraftHead.load(path, client.model)
    except FailedPrecondition as e:
        if not is_found:
            raise
        log.warning("not drafting with %s: %s", path, e)
        return None


def train_drafter(args) -> int:
    """Train a draft head; by default it goes beside the client bundle (INFEMERAL_CLIENT_BUNDLE), where
    `--speculate auto` finds it. With --server the pod and the laptop's half answer the training prompts, for a
    model this machine cannot run whole (INFEMERAL_SERVER alone, set for chat, leaves the answering here)."""
    from infemeral.speculation.head.train import check_arguments, run

    settings = settings_from_args(ClientSettings, args)
    if args.output is None:
        args.output = settings.client_bundle.parent / DRAFT_HEAD_DIR
    check_arguments(args)
    if args.server is None:
        return run(args)
    if args.model != "default":
        raise UsageError(f"--model {args.model} answers here, --server {settings.server} on the pod: give one "
                         "(with --server the model is the pod's, and --client-bundle its laptop half)")
    from infemeral.client.client import Client
    from infemeral.client.head_answers import PodAnswers

    args.model = f"served at {settings.server}"
    with Client.from_settings(settings) as client:
        return run(args, PodAnswers(client, args.in_flight))


def _report(result, verbose: bool) -> None:
    if verbose:
        drafts = (f" ({result.accepted_drafts} of {result.drafted_tokens} drafts accepted)"
                  if result.drafted_tokens else "")
        print(f"[{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated, "
              f"finish={result.finish_reason}, first token {result.time_to_first_token:.2f}s, "
              f"{result.tokens_per_second:.1f} tokens/s, {result.tokens_per_round_trip:.2f} tokens per round trip"
              f"{drafts}, session version {result.version}]", file=sys.stderr)
    if result.evicted_tokens:  # always: the model no longer sees the start of the conversation
        print(f"[context window full: the oldest {result.evicted_tokens} tokens were dropped "
              f"({result.cache_length} kept)]", file=sys.stderr)


def _sampling(settings: ClientSettings, client, *, is_answer: bool = False):
    """Flags and INFEMERAL_* variables first, then the model's generation config, then (`is_answer`: chat and
    generate) sampling.CHAT_SAMPLING unless greedy decoding was asked for, then the settings' defaults."""
    from infemeral.client.sampling import chat_defaults, generation_defaults

    config = client.bundle.generation_config()
    if not is_answer:
        return settings.sampling(generation_defaults(config))
    is_greedy = "temperature" in settings.model_fields_set and settings.temperature == 0
    return settings.sampling(chat_defaults(config, is_greedy=is_greedy))


def _answer_settings(args) -> ClientSettings:
    """The settings of `chat` and `generate`: --greedy is --temperature 0."""
    if args.greedy:
        if args.temperature is not None:
            raise UsageError("--greedy is --temperature 0: give one of them")
        args.temperature = "0"
    return settings_from_args(ClientSettings, args)


def _check_prompt_fits(client, prompt_ids: list[int], truncate: bool) -> None:
    """Refuse a prompt the server cannot hold whole, as the OpenAI endpoint does: with its window on the server
    would drop the prompt's start, and the model would answer what is left of it as if that were the question."""
    info = client.server_info()
    if len(prompt_ids) < info.max_context or (truncate and info.window):
        return
    limit = f"the prompt is {len(prompt_ids)} tokens, and the server at {client.address} holds at most " \
            f"{info.max_context} (its --max-context)"
    if not info.window:
        raise UsageError(f"{limit}: shorten the prompt")
    raise UsageError(f"{limit}: shorten the prompt, or pass --truncate to let the server's window drop its start")


def generate(args) -> int:
    from infemeral.cli.upload_line import UploadLine

    settings = _answer_settings(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.raw and args.system:
        raise InfemeralError("--system needs the chat template; with --raw put everything in the prompt")
    if not prompt.strip():
        raise UsageError("the prompt is empty: give the question as an argument, or '-' to read it from stdin")
    with open_client(settings) as client:
        session = client.new_session(system_prompt=args.system)
        try:
            _check_prompt_fits(client, client.text_ids(prompt) if args.raw else client.chat_ids(
                session.messages + [{"role": "user", "content": prompt}]), args.truncate)
            params = _sampling(settings, client, is_answer=True)
            line = UploadLine()  # a long prompt's upload, on stderr and cleared before the answer
            deltas = (session.stream_raw(prompt, params, on_progress=line) if args.raw
                      else session.stream(prompt, params, on_progress=line))
            try:
                for delta in deltas:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
            finally:
                line.close()
            sys.stdout.write("\n")
            _report(session.last_result, args.verbose)
        finally:
            if session.version:
                session.delete()
    return 0


def chat(args) -> int:
    from infemeral.cli.chat_repl import ChatRepl, say_loading

    settings = _answer_settings(args)
    path = session_path(settings, args.session) if args.session else None
    source = _fork_source(settings, args, path)
    say_loading(settings.client_bundle)  # before the heavy imports: the first sign of life comes at once
    with open_client(settings) as client:
        params = _sampling(settings, client, is_answer=True)
        return ChatRepl(client, settings, session_name=args.session, session_path=path, system=args.system,
                        verbose=args.verbose, report=_report, params=params, fork_of=source).run()


def _fork_source(settings: ClientSettings, args, path: Path | None) -> Path | None:
    """The saved session `chat --from NAME` continues a copy of; refused before anything loads if it does not
    exist, or if --session names one that does (a fork starts a new session)."""
    if not args.from_session:
        return None
    source = session_path(settings, args.from_session)
    if not source.exists():
        raise UsageError(f"--from: no saved session named {args.from_session!r} in {settings.sessions_dir}")
    if path is not None and path.exists():
        raise UsageError(f"--from makes a new session, and a session named {args.session!r} is saved already: "
                         "pick a new name for --session")
    if args.system:
        raise UsageError("--from continues the saved session's conversation, its system prompt included: drop "
                         "--system")
    return source


def serve(args) -> int:
    from infemeral.endpoint.serve import serve as serve_endpoint
    from infemeral.endpoint.wire_meter import WireMeter

    serve_settings = settings_from_args(ServeSettings, args)
    given = {k: v for k, v in vars(args).items() if k != "api_key"}  # --api-key is the endpoint's own key
    if args.server_api_key:
        given["api_key"] = args.server_api_key
    settings = settings_from_args(ClientSettings, argparse.Namespace(**given))
    return serve_endpoint(serve_settings, lambda: open_client(settings, [WireMeter()]),
                          lambda client: _sampling(settings, client), settings.server, settings.sessions_dir)


def info(args) -> int:
    from infemeral.client.server_link import ServerLink

    settings = settings_from_args(ClientSettings, args)
    with ServerLink.from_settings(settings) as link:  # no torch, no model: the server's answer at once
        info = link.server_info()
        match = info.bundle_fingerprint == link.server_fingerprint
        if args.json:
            print(json.dumps(dict(_info_fields(info), client_bundle_matches=match), indent=2))
        else:
            print(describe_server_info(info, settings.server))
            print(f"client bundle matches server bundle: {'yes' if match else 'NO'}")
    if args.laptop_half:
        _describe_laptop_half(settings)
    return 0 if match else 1


def _info_fields(info) -> dict:
    """The server's info as JSON fields, counts as numbers (proto3 JSON writes 64-bit integers as strings)."""
    from google.protobuf import json_format

    fields = json_format.MessageToDict(info, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True)
    for field in info.DESCRIPTOR.fields:
        if field.cpp_type in (field.CPPTYPE_INT64, field.CPPTYPE_UINT64):
            fields[field.name] = int(fields[field.name])
    return fields


def describe_server_info(info, address: str) -> str:
    """What `info` prints for a person: what the server serves and the limits a client meets."""
    last = info.first_layer + info.num_layers - 1
    window = (f"a window slides over longer conversations (keeping the first {info.sink_tokens} tokens, evicting "
              f"pages of {info.page_size})" if info.window else "longer conversations are refused")
    idle = (f"a turn idle {info.turn_idle_seconds:g} s or open {info.max_turn_seconds:g} s is aborted"
            if info.turn_idle_seconds else "no idle limit on turns")
    return "\n".join([
        f"server {address}: infemeral {info.server_version or '?'}, protocol {info.protocol_version}",
        f"  model: {info.model_type}, hidden size {info.hidden_size}, layers {info.first_layer}-{last} of "
        f"{info.total_layers} served (the laptop runs the ones before)",
        f"  computes in {info.dtype} on {info.device}",
        f"  context: {info.max_context} tokens; {window}",
        f"  steps of at most {info.max_step_tokens} tokens, messages of at most "
        f"{info.max_message_bytes / 2**20:g} MiB; {idle}",
        f"  server bundle fingerprint: {info.bundle_fingerprint}",
    ])


def _describe_laptop_half(settings: ClientSettings) -> None:
    """Build the laptop's half as `generate` would (torch, the weights) and say how it computes."""
    from infemeral.client_half.half import ClientModel
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
    report = server_quant.run_bundle(args.model, client_dir, server_dir, args.text, args.tokens, args.positions,
                                     args.dtype, progress=not args.quiet)
    print(report.describe())
    return 0


def delete(args) -> int:
    from infemeral.client.server_link import ServerLink
    from infemeral.client.session_store import SessionStore

    settings = settings_from_args(ClientSettings, args)
    session_path(settings, args.session)  # a bad name is refused before anything connects
    with ServerLink.from_settings(settings) as link:  # the session file's header and one call: no model
        SessionStore(settings.sessions_dir, link.server_fingerprint).delete(args.session, link)
    print(f"deleted session {args.session!r}")
    return 0


def forget_answers(args) -> int:
    from infemeral.speculation import answer_index

    settings = settings_from_args(ClientSettings, args)
    count = answer_index.forget_answers(settings.answer_index_dir)
    print(f"forgot {count} answer index file(s) in {settings.answer_index_dir}")
    return 0

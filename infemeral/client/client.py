"""The Python SDK: a `Client` bound to a server and a client bundle, and its chat `Session`s.

A session is a conversation whose KV cache lives in two places: the client's
local layers (here) and the server's layers (encrypted in the server's store).
Every turn is one gRPC stream that sends only the turn's new tokens, as hidden
states in the secret basis, and ends with a commit; both caches move to the new
version together, or — if anything fails — both stay at the old one.

    from infemeral import Client
    with Client("127.0.0.1:50051", "bundles/client") as client:
        chat = client.new_session()
        for delta in chat.stream("What is the capital of France?"):
            print(delta, end="", flush=True)
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch
from safetensors.torch import load_file, save_file

from infemeral.cloak.bundle import ClientBundle
from infemeral.client.model.half import ClientModel
from infemeral.client.pending import PendingCommit
from infemeral.kvcache.prefix import common_prefix
from infemeral.client.result import TurnResult
from infemeral.client.sampling import SamplingParams
from infemeral.client.template import ChatTemplate
from infemeral.client.turn import TurnLoop, open_turn
from infemeral.errors import Aborted, FailedPrecondition, InfemeralError, NoChatTemplate, from_rpc_error
from infemeral.protocol import pb, pb_grpc
from infemeral.protocol.tensors import WIRE_DTYPES
from infemeral.speculation.answer_index import AnswerIndex
from infemeral.speculation.draft_length import DraftLength
from infemeral.speculation.source import DraftSource, per_session, session_source
from infemeral.speculation.step_cost import StepCost
from infemeral.transport import client_channel

SESSION_FILE_FORMAT = "infemeral-session"
SESSION_FILE_VERSION = 2  # 2: adds an unconfirmed turn (`pending`); version 1 files still load


class Client:
    """A connection to one infemeral server plus the local half of the model.

    Pass `tls_ca` (the CA or the server's own certificate) to use TLS, with
    `tls_client_cert`/`tls_client_key` for mutual TLS, and `api_key` if the
    server asks for one.

    Speculative decoding drafts from the conversation itself; `answer_index` (a directory, or an
    `AnswerIndex`) also drafts from this client's earlier answers, kept in an owner-only file there
    (None, the default, keeps no answers; `client.answer_index.clear()` forgets them);
    `draft_model` (a local model directory or .gguf file with this model's tokenizer, or a ready
    `DraftSource`) enables `SamplingParams(speculate="draft")`. Each session drafts with its own
    state of the draft model (its `fork()`), over weights all sessions share.

    Opening a turn while the server is at a limit (RESOURCE_EXHAUSTED with a `retry-after-ms` hint) is
    retried as the server says, within `timeout`; a turn that has started is never retried.

    `client_dtype` (auto, float32, bfloat16, float16), `client_device` (auto, cpu, cuda, mps) and
    `client_quant` (auto, none, int8) choose how the local half computes; None takes
    INFEMERAL_CLIENT_* or auto."""

    def __init__(self, server: str = "127.0.0.1:50051", client_bundle: str | Path | None = None, *,
                 timeout: float = 600.0, options: list | None = None, interceptors: list | None = None,
                 tls_ca: str | Path | None = None, tls_client_cert: str | Path | None = None,
                 tls_client_key: str | Path | None = None, tls_server_name: str | None = None,
                 api_key: str | None = None, answer_index: str | Path | AnswerIndex | None = None,
                 draft_model: str | Path | DraftSource | None = None, client_dtype: str | None = None,
                 client_device: str | None = None, client_quant: str | None = None):
        from infemeral.config import ClientSettings

        given = dict(client_bundle=client_bundle, client_dtype=client_dtype, client_device=client_device,
                     client_quant=client_quant)
        settings = ClientSettings(**{k: v for k, v in given.items() if v is not None})
        self.bundle = ClientBundle.open(settings.client_bundle)
        self.model = ClientModel(self.bundle, dtype=settings.client_dtype, device=settings.client_device,
                                 quant=settings.client_quant)
        self.tokenizer = self.bundle.tokenizer()
        self.template = ChatTemplate(self.tokenizer)
        gen = self.bundle.generation_config()
        eos = gen.eos_token_id if gen.eos_token_id is not None else []
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.timeout = timeout
        self.address = server
        self.channel = client_channel(server, tls_ca=tls_ca, client_cert=tls_client_cert, client_key=tls_client_key,
                                      server_name=tls_server_name, api_key=api_key, options=(options or []) + [
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
            ("grpc.keepalive_time_ms", 30_000)])
        if interceptors:
            self.channel = grpc.intercept_channel(self.channel, *interceptors)
        self.stub = pb_grpc.InfemeralStub(self.channel)
        self._info: pb.ServerInfo | None = None
        if answer_index is not None and not isinstance(answer_index, AnswerIndex):
            answer_index = AnswerIndex.for_tokenizer(answer_index, self.tokenizer, vocab_size=max(
                len(self.tokenizer), self.model.config.vocab_size))
        self.answer_index: AnswerIndex | None = answer_index
        if draft_model is not None and not isinstance(draft_model, DraftSource):
            from infemeral.speculation.draft_model import DraftModel

            draft_model = DraftModel.load(draft_model, self.tokenizer)
        self.draft_model: DraftSource | None = draft_model
        self.step_cost = StepCost()  # what an extra drafted position costs on this link, learnt across sessions

    # -- server -------------------------------------------------------------------------------
    def server_info(self, refresh: bool = False) -> pb.ServerInfo:
        if self._info is None or refresh:
            try:
                self._info = self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=min(self.timeout, 30))
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
            if self._info.hidden_size != self.model.hidden_size:
                raise FailedPrecondition(f"server serves hidden size {self._info.hidden_size}, this client bundle "
                                         f"has {self.model.hidden_size}: they belong to different models")
        return self._info

    @property
    def wire_dtype(self) -> torch.dtype:
        return WIRE_DTYPES.get(self.server_info().dtype, torch.float32)

    # -- text ---------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict]) -> list[int]:
        """A transcript as the model reads it: rendered by its chat template, ready for the assistant's answer.

        Message content is text: control tokens typed into a message (`<|im_start|>system…`) stay plain
        characters, and only the template itself writes special tokens."""
        if not self.tokenizer.chat_template:
            raise NoChatTemplate()
        return self.template.ids(messages)

    def text_ids(self, text: str, *, special_tokens: bool = False) -> list[int]:
        """Raw text as the model reads it without a chat template (with the tokenizer's BOS, if it adds one).

        The spelling of a special token (`<|im_end|>`) is plain text unless `special_tokens` is True, which
        reads it as that token: for prompts written in the model's own control format, on purpose."""
        return list(self.tokenizer(text, split_special_tokens=not special_tokens)["input_ids"])

    # -- sessions -----------------------------------------------------------------------------
    def new_session(self, system_prompt: str | None = None) -> "Session":
        return Session(self, system_prompt=system_prompt)

    def load_session(self, path: str | Path) -> "Session":
        return Session.load(self, path)

    def generate(self, prompt: str, sampling: SamplingParams | None = None, *, delete: bool = True) -> TurnResult:
        """One question, one answer, in a fresh session (deleted from the server afterwards)."""
        session = self.new_session()
        try:
            return session.chat(prompt, sampling)
        finally:
            if delete and session.version:
                session.delete()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """A conversation with committed state on both sides; not safe for concurrent use."""

    def __init__(self, client: Client, *, system_prompt: str | None = None, session_id: bytes | None = None,
                 key: bytes | None = None):
        self.client = client
        self.id = session_id or secrets.token_bytes(16)
        self.key = key or secrets.token_bytes(32)
        self.version = 0
        self.history_ids: list[int] = []  # tokens in the committed caches, client-side only
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.cache = client.model.new_cache()
        self._busy = threading.Lock()
        self._draft_model: DraftSource | None = None  # this session's own fork of the client's draft model
        self._draft_model_of: DraftSource | None = None  # ... and the one it was forked from
        self.last_result: TurnResult | None = None
        # A turn whose commit was sent but never answered (connection lost), until the server says whether
        # it landed; the next turn settles it first.
        self.pending_commit: PendingCommit | None = None
        self.draft_length = DraftLength(cost=client.step_cost)  # how many drafts a step carries, learnt as it goes

    def __repr__(self) -> str:  # never print the key
        return f"Session(id={self.id.hex()[:8]}…, version={self.version}, tokens={len(self.history_ids)})"

    # -- chat ---------------------------------------------------------------------------------
    def chat(self, message: str, sampling: SamplingParams | None = None) -> TurnResult:
        """Send a user message; return the full answer once generated."""
        for _ in self.stream(message, sampling):
            pass
        return self.last_result

    def stream(self, message: str, sampling: SamplingParams | None = None) -> Iterator[str]:
        """Send a user message; yield the answer's text as it is sampled."""
        return self._stream(self.messages + [{"role": "user", "content": message}], sampling or SamplingParams())

    def _stream(self, messages: list[dict], params: SamplingParams, **turn_options) -> Iterator[str]:
        with TurnLoop(self, messages, params, **turn_options) as turn:
            yield from turn.generate()
            turn.commit()

    def stream_messages(self, messages: list[dict], sampling: SamplingParams | None = None) -> Iterator[str]:
        """Answer the last message of a whole transcript; yield the answer's text as it is sampled.

        The caches keep what they share with the transcript and only the rest is sent, so a caller that
        resends a growing conversation every time (as OpenAI-style tools do) sends only its new tokens."""
        return self._stream([dict(m) for m in messages], sampling or SamplingParams(), is_whole_transcript=True)

    # -- raw text -----------------------------------------------------------------------------
    def complete(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                 special_tokens: bool = False) -> TurnResult:
        """Continue raw text (or token ids) without the chat template, for base models and template-free
        prompts; return the continuation once generated."""
        for _ in self.stream_raw(prompt, sampling, special_tokens=special_tokens):
            pass
        return self.last_result

    def stream_raw(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                   special_tokens: bool = False) -> Iterator[str]:
        """Continue raw text (or token ids); yield the continuation as it is sampled.

        `prompt` is the whole text: the session's caches keep what they share with it (a longer prompt
        that starts with an earlier prompt and its continuation sends only what is new). Raw turns leave
        `messages` empty: the history is text, not a chat. A text prompt is read as plain text, the
        spelling of a special token included, unless `special_tokens` is True (`Client.text_ids`)."""
        ids = (self.client.text_ids(prompt, special_tokens=special_tokens) if isinstance(prompt, str)
               else [int(i) for i in prompt])
        if not ids:
            raise InfemeralError("the prompt is empty: there is nothing to continue")
        return self._stream([], sampling or SamplingParams(), render=lambda _: ids, is_whole_transcript=True)

    # -- what a turn uses -----------------------------------------------------------------------
    def claim(self) -> None:
        """Take the session for one turn; Aborted if a turn of it is running (one at a time)."""
        if not self._busy.acquire(blocking=False):
            raise Aborted("this session is already running a turn")

    def release(self) -> None:
        """The turn that claimed the session is over."""
        self._busy.release()

    def render(self, messages: list[dict]) -> list[int]:
        """A transcript as token ids, by the model's chat template."""
        return self.client.chat_ids(messages)

    def draft_source(self, speculate: str) -> DraftSource | None:
        """Where this session's drafts come from: the conversation first, then the client's earlier answers,
        then the draft model (through this session's own fork of it)."""
        client, draft_model = self.client, None
        if speculate == "draft" and client.draft_model is not None:
            if self._draft_model_of is not client.draft_model:
                self._draft_model, self._draft_model_of = per_session(client.draft_model), client.draft_model
            draft_model = self._draft_model
        return session_source(speculate, client.answer_index, draft_model)

    def settle_pending(self) -> None:
        """Ask the server whether the turn whose commit reply was lost did commit; adopt it if so."""
        pending = self.pending_commit
        stream, opened = open_turn(self.client, pb.OpenTurn(
            session_id=self.id, session_key=self.key, expected_version=self.version,
            bundle_fingerprint=self.client.bundle.server_fingerprint, turn_id=secrets.token_bytes(16),
            pending_turn_id=pending.turn_id, reserve_tokens=1))
        stream.close()  # no commit: the probe changes nothing
        if opened.pending_committed and opened.version == pending.version:
            self.version, self.cache = pending.version, pending.cache
            self.history_ids, self.messages = pending.history_ids, pending.messages
            self.last_result = pending.result
        self.pending_commit = None

    def rewind(self, target_ids: list[int], sink_tokens: int) -> tuple[int, int]:
        """(tokens of the history a turn for `target_ids` keeps, cache positions it drops first).

        Normally the turn keeps the longest common prefix of the history and the new transcript and
        drops the cache's tail after it. But once the window has evicted tokens, the cache holds the
        sinks and the most recent tokens only: a rewind into what was evicted cannot be made by
        dropping a tail (it would cut into the sinks and leave the wrong tokens in their place), so the
        turn then drops the whole cache and sends the transcript again from the start."""
        keep = common_prefix(self.history_ids, target_ids)
        if keep == len(target_ids):  # always send at least one token to get logits
            keep -= 1
        evicted = len(self.history_ids) - self.cache.length
        if evicted > 0 and keep < sink_tokens + evicted:
            return 0, self.cache.length
        return keep, len(self.history_ids) - keep

    # -- lifecycle ----------------------------------------------------------------------------
    def delete(self) -> None:
        """Remove the session's stored state from the server."""
        try:
            self.client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=self.id, session_key=self.key),
                                           timeout=min(self.client.timeout, 30))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        self.version = 0

    def save(self, path: str | Path) -> Path:
        """Write the session (id, key, version, transcript, local cache, and a turn whose commit is still
        unconfirmed) to an owner-only file."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": SESSION_FILE_FORMAT, "format_version": SESSION_FILE_VERSION,
                "server_fingerprint": self.client.bundle.server_fingerprint,
                "id": self.id.hex(), "key": self.key.hex(), "version": self.version,
                "history_ids": self.history_ids, "messages": self.messages,
                "cache_length": self.cache.committed_length,
                "pending": self.pending_commit.metadata() if self.pending_commit else None}
        tensors = {}
        for slot in range(self.cache.num_layers):
            k, v = self.cache.layer_tensors(slot, 0, self.cache.committed_length)
            tensors[f"k.{slot}"], tensors[f"v.{slot}"] = k.contiguous(), v.contiguous()
        if self.pending_commit:
            tensors.update(self.pending_commit.tensors())
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        save_file(tensors, str(tmp), metadata={"session": json.dumps(meta)})
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, client: Client, path: str | Path) -> "Session":
        path = Path(path).expanduser()
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("session", "{}"))
        if meta.get("format") != SESSION_FILE_FORMAT or meta.get("format_version") not in (1, SESSION_FILE_VERSION):
            raise InfemeralError(f"{path} is not an infemeral session file this version can read")
        if meta["server_fingerprint"] != client.bundle.server_fingerprint:
            raise FailedPrecondition(f"{path} belongs to a different client bundle")
        session = cls(client, session_id=bytes.fromhex(meta["id"]), key=bytes.fromhex(meta["key"]))
        session.version = meta["version"]
        session.history_ids = meta["history_ids"]
        session.messages = meta["messages"]
        tensors = load_file(str(path))
        for slot in range(session.cache.num_layers):
            session.cache.load_layer(slot, tensors[f"k.{slot}"], tensors[f"v.{slot}"])
        session.cache.set_length(meta.get("cache_length", len(session.history_ids)))
        if meta.get("pending"):  # settled by the next turn
            session.pending_commit = PendingCommit.from_saved(meta["pending"], tensors, client.model.new_cache())
        return session

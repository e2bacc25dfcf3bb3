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
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch
from safetensors.torch import load_file, save_file

from infemeral.cloak.bundle import ClientBundle
from infemeral.client.local_model import ClientModel
from infemeral.client.pending import PendingCommit
from infemeral.client.result import TurnResult
from infemeral.client.sampling import Sampler, SamplingParams
from infemeral.errors import Aborted, FailedPrecondition, InfemeralError, StatusError, from_rpc_error
from infemeral.kvcache.cache import KVCache
from infemeral.kvcache.window import WindowPolicy, apply_window
from infemeral.protocol import pb, pb_grpc
from infemeral.protocol.tensors import WIRE_DTYPES, from_proto, to_proto
from infemeral.transport import client_channel

SESSION_FILE_FORMAT = "infemeral-session"
SESSION_FILE_VERSION = 2  # 2: adds an unconfirmed turn (`pending`); version 1 files still load


class Client:
    """A connection to one infemeral server plus the local half of the model.

    Pass `tls_ca` (the CA or the server's own certificate) to use TLS, with
    `tls_client_cert`/`tls_client_key` for mutual TLS, and `api_key` if the
    server asks for one."""

    def __init__(self, server: str = "127.0.0.1:50051", client_bundle: str | Path | None = None, *,
                 timeout: float = 600.0, options: list | None = None, interceptors: list | None = None,
                 tls_ca: str | Path | None = None, tls_client_cert: str | Path | None = None,
                 tls_client_key: str | Path | None = None, tls_server_name: str | None = None,
                 api_key: str | None = None):
        from infemeral.config import ClientSettings

        bundle_dir = client_bundle if client_bundle is not None else ClientSettings().client_bundle
        self.bundle = ClientBundle.open(bundle_dir)
        self.model = ClientModel(self.bundle)
        self.tokenizer = self.bundle.tokenizer()
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


class _TurnStream:
    """One bidirectional Turn RPC: put requests, read responses in order."""

    def __init__(self, client: Client):
        self._requests: queue.Queue = queue.Queue()
        self._responses = client.stub.Turn(iter(self._requests.get, None), timeout=client.timeout)

    def call(self, request: pb.TurnRequest, expect: str):
        self._requests.put(request)
        try:
            response = next(self._responses)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except StopIteration:
            raise StatusError("server ended the turn unexpectedly") from None
        kind = response.WhichOneof("kind")
        if kind != expect:
            raise StatusError(f"protocol error: expected {expect}, got {kind}")
        return getattr(response, kind)

    def close(self) -> None:
        """End the stream. Half-close first and wait for the server to finish the call, so that the
        session is released on the server before the next turn opens; then make sure it is over."""
        self._requests.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass
        self._responses.cancel()


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
        self.last_result: TurnResult | None = None
        # A turn whose commit was sent but never answered (connection lost), until the server says whether
        # it landed; the next turn settles it first.
        self.pending_commit: PendingCommit | None = None

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
        messages = self.messages + [{"role": "user", "content": message}]
        return self._turn(self._render(messages), messages, sampling or SamplingParams())

    def _render(self, messages: list[dict]) -> list[int]:
        ids = self.client.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def _settle_pending(self) -> None:
        """Ask the server whether the turn whose commit reply was lost did commit; adopt it if so."""
        pending, stream = self.pending_commit, _TurnStream(self.client)
        try:
            opened = stream.call(pb.TurnRequest(open=pb.OpenTurn(
                session_id=self.id, session_key=self.key, expected_version=self.version,
                bundle_fingerprint=self.client.bundle.server_fingerprint, turn_id=secrets.token_bytes(16),
                pending_turn_id=pending.turn_id, reserve_tokens=1)), "opened")
        finally:
            stream.close()  # no commit: the probe changes nothing
        if opened.pending_committed and opened.version == pending.version:
            self.version, self.cache = pending.version, pending.cache
            self.history_ids, self.messages = pending.history_ids, pending.messages
            self.last_result = pending.result
        self.pending_commit = None

    def _rewind(self, target_ids: list[int], sink_tokens: int) -> tuple[int, int]:
        """(tokens of the history this turn keeps, cache positions it drops first).

        Normally the turn keeps the longest common prefix of the history and the new transcript and
        drops the cache's tail after it. But once the window has evicted tokens, the cache holds the
        sinks and the most recent tokens only: a rewind into what was evicted cannot be made by
        dropping a tail (it would cut into the sinks and leave the wrong tokens in their place), so the
        turn then drops the whole cache and sends the transcript again from the start."""
        keep = _common_prefix(self.history_ids, target_ids)
        if keep == len(target_ids):  # always send at least one token to get logits
            keep -= 1
        evicted = len(self.history_ids) - self.cache.length
        if evicted > 0 and keep < sink_tokens + evicted:
            return 0, self.cache.length
        return keep, len(self.history_ids) - keep

    def _turn(self, target_ids: list[int], messages: list[dict], params: SamplingParams) -> Iterator[str]:
        if not self._busy.acquire(blocking=False):
            raise Aborted("this session is already running a turn")
        try:
            if self.pending_commit is not None:
                self._settle_pending()
                messages = self.messages + messages[-1:]  # the new user message on the settled transcript
                target_ids = self._render(messages)
        except BaseException:
            self._busy.release()
            raise
        client, model = self.client, self.client.model
        undo: list[KVCache] = []  # a copy of the committed local cache, taken before it is first rewritten

        def keep_undo() -> None:
            if not undo:
                undo.append(self.cache.clone())

        result = TurnResult()
        stream = None
        committed = commit_sent = False
        turn_id = secrets.token_bytes(16)
        try:
            info = client.server_info()
            wire = client.wire_dtype
            keep, drop = self._rewind(target_ids, info.sink_tokens)
            new_prompt = target_ids[keep:]
            result.truncated_tokens, result.prompt_tokens = drop, len(new_prompt)
            stream = _TurnStream(client)
            opened = stream.call(pb.TurnRequest(open=pb.OpenTurn(
                session_id=self.id, session_key=self.key, expected_version=self.version,
                bundle_fingerprint=client.bundle.server_fingerprint, turn_id=turn_id,
                reserve_tokens=len(new_prompt) + params.max_new_tokens)), "opened")
            if opened.cache_length != self.cache.length:
                raise Aborted(f"server holds {opened.cache_length} tokens for this session but the client holds "
                              f"{self.cache.length}; the session file is out of date")
            if drop:
                keep_undo()
                stream.call(pb.TurnRequest(truncate=pb.Truncate(tokens=drop, cache_length=self.cache.length)),
                            "truncated")
                self.cache.truncate(drop)

            window = WindowPolicy(info.max_context, info.sink_tokens, info.page_size or 1, enabled=info.window)

            def step(ids: list[int]) -> torch.Tensor:
                before = self.cache.length
                evict = window.tokens_to_evict(before, len(ids))
                if evict:
                    keep_undo()
                    apply_window(self.cache, window, len(ids), model.inv_freq)
                    result.evicted_tokens += evict
                hidden = model.cloak(ids, self.cache).to(wire)
                out = stream.call(pb.TurnRequest(step=pb.Step(hidden=to_proto(hidden), cache_length=before,
                                                              evict=evict)), "step")
                if out.cache_length != self.cache.length or out.evicted != evict:
                    raise Aborted(f"server cache length {out.cache_length} (evicted {out.evicted}) != client's "
                                  f"{self.cache.length} (evicted {evict})")
                return model.logits(from_proto(out.hidden, model.hidden_size, 1, "server residual"))[-1]

            started = time.perf_counter()
            chunk = max(1, min(info.max_step_tokens, window.max_step))
            for i in range(0, len(new_prompt), chunk):
                logits = step(new_prompt[i:i + chunk])
            fed = target_ids[:]  # what the caches hold (and the window dropped) once the prompt is in
            sampler = Sampler(params)
            generated: list[int] = []
            emitted = ""
            hold = max((len(s) for s in params.stop), default=1) - 1
            first_at = decode_from = None
            while True:
                token = sampler(logits, fed)
                if first_at is None:
                    first_at = decode_from = time.perf_counter()
                    result.time_to_first_token = first_at - started
                if token in client.eos_ids:
                    result.finish_reason = "eos"
                    break
                generated.append(token)
                text = client.tokenizer.decode(generated, skip_special_tokens=True)
                stop_at = _find_stop(text, params.stop)
                if stop_at is not None:
                    text = text[:stop_at]
                    result.finish_reason = "stop"
                ready = text if result.finish_reason else text[:max(len(emitted), len(text) - hold)]
                if ready.endswith("\ufffd") and not result.finish_reason:
                    ready = emitted
                if len(ready) > len(emitted):
                    yield ready[len(emitted):]
                    emitted = ready
                result.text = text
                if result.finish_reason:
                    break
                if len(generated) >= params.max_new_tokens:
                    result.finish_reason = "length"
                    break
                if not window.enabled and self.cache.length + 1 > info.max_context:
                    result.finish_reason = "context"
                    break
                logits = step([token])
                fed.append(token)
            if len(result.text) > len(emitted):
                yield result.text[len(emitted):]
            result.token_ids = generated
            result.generated_tokens = len(generated)
            result.decode_seconds = time.perf_counter() - decode_from
            result.cache_length = self.cache.length
            commit_sent = True
            done = stream.call(pb.TurnRequest(commit=pb.Commit()), "committed")
            committed = True
            self.version = result.version = done.version
            self.cache.commit()
            self.history_ids = fed
            self.messages = messages + [{"role": "assistant", "content": result.text}]
            self.last_result = result
        finally:
            if stream is not None:
                stream.close()
            if commit_sent and not committed:  # the outcome is unknown until the server is asked
                result.version = self.version + 1
                self.pending_commit = PendingCommit.of_turn(
                    turn_id, self.version + 1, self.cache, fed,
                    messages + [{"role": "assistant", "content": result.text}], result)
            if not committed:
                if undo:
                    self.cache = undo[0]
                else:
                    self.cache.rollback()
            self._busy.release()

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


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None

"""The Python SDK's entry: a `Client` bound to a server and a client bundle, which opens chat `Session`s.

The client holds what every session shares: the link to the server, the laptop's
half of the model, the tokenizer and chat template, and the draft sources.

    from infemeral import Client
    with Client("127.0.0.1:50051", "bundles/client") as client:
        chat = client.new_session()
        for delta in chat.stream("What is the capital of France?"):
            print(delta, end="", flush=True)
"""

from __future__ import annotations

from pathlib import Path

from infemeral.client_half.half import ClientModel
from infemeral.client.result import TurnResult
from infemeral.client.sampling import SamplingParams
from infemeral.client.server_link import ServerLink
from infemeral.client.session import Session
from infemeral.client.settings import ClientSettings
from infemeral.client.upload import ProgressCallback
from infemeral.client.template import ChatTemplate
from infemeral.cloak.bundle import ClientBundle
from infemeral.errors import FailedPrecondition, NoChatTemplate
from infemeral.protocol import pb
from infemeral.protocol.tensors import Wire
from infemeral.speculation.answer_index import AnswerIndex
from infemeral.speculation.draft_length import SourceHistory
from infemeral.speculation.source import DraftSource
from infemeral.speculation.step_cost import StepCost

# A turn's stream carries a prompt's hidden states in few messages, and stays open between a slow laptop's steps.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.keepalive_time_ms", 30_000)]


class Client:
    """A connection to one infemeral server plus the local half of the model.

    Pass `tls_ca` (the CA or the server's own certificate) to use TLS, with
    `tls_client_cert`/`tls_client_key` for mutual TLS, and `api_key` if the
    server asks for one.

    Speculative decoding drafts from the conversation itself; `answer_index` (a directory, or an
    `AnswerIndex`) also drafts from this client's earlier answers, kept in an owner-only file there
    (None, the default, keeps no answers; `client.answer_index.clear()` forgets them);
    `draft_model` (a local model directory or .gguf file with this model's tokenizer, or a ready
    `DraftSource`) enables `SamplingParams(speculate="draft")`; `draft_head` (a directory in the EAGLE
    layout, e.g. from `infemeral-client train-drafter`, or a ready `DraftHead`) enables
    `speculate="head"`. Each session drafts with its own state of the draft model and head (their
    `fork()`), over weights all sessions share. The default, `speculate="auto"`, drafts from whichever
    of these sources measures fastest on this link, step by step.

    Opening a turn while the server is at a limit (RESOURCE_EXHAUSTED with a `retry-after-ms` hint) is
    retried as the server says, within `timeout`; a turn that has started is never retried.

    `client_dtype` (auto, float32, bfloat16, float16), `client_device` (auto, cpu, cuda, mps) and
    `client_quant` (auto, none, int8) choose how the local half computes; None takes
    INFEMERAL_CLIENT_* or auto. `wire` (server, int8, int8-up, e4m3, e4m3-up; None takes INFEMERAL_WIRE or server)
    chooses how hidden states travel (`ClientSettings.wire`)."""

    def __init__(self, server: str = "127.0.0.1:50051", client_bundle: str | Path | None = None, *,
                 timeout: float = 600.0, options: list | None = None, interceptors: list | None = None,
                 tls_ca: str | Path | None = None, tls_client_cert: str | Path | None = None,
                 tls_client_key: str | Path | None = None, tls_server_name: str | None = None,
                 api_key: str | None = None, answer_index: str | Path | AnswerIndex | None = None,
                 draft_model: str | Path | DraftSource | None = None, draft_head=None,
                 client_dtype: str | None = None, client_device: str | None = None, client_quant: str | None = None,
                 wire: str | None = None):
        given = dict(client_bundle=client_bundle, client_dtype=client_dtype, client_device=client_device,
                     client_quant=client_quant, wire=wire)
        settings = ClientSettings(**{k: v for k, v in given.items() if v is not None})
        self.wire_mode = settings.wire
        self.bundle = ClientBundle.open(settings.client_bundle)
        self.model = ClientModel(self.bundle, dtype=settings.client_dtype, device=settings.client_device,
                                 quant=settings.client_quant)
        self.tokenizer = self.bundle.laptop_tokenizer()
        self.template = ChatTemplate(self.tokenizer)
        gen = self.bundle.generation_config()
        eos = gen.eos_token_id if gen.eos_token_id is not None else []
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.timeout = timeout
        self.link = ServerLink(server, settings.client_bundle, timeout=timeout, tls_ca=tls_ca,
                               tls_client_cert=tls_client_cert, tls_client_key=tls_client_key,
                               tls_server_name=tls_server_name, api_key=api_key,
                               options=(options or []) + CHANNEL_OPTIONS, interceptors=interceptors)
        self._info: pb.ServerInfo | None = None
        if answer_index is not None and not isinstance(answer_index, AnswerIndex):
            answer_index = AnswerIndex.for_tokenizer(answer_index, self.tokenizer, vocab_size=max(
                len(self.tokenizer), self.model.config.vocab_size))
        self.answer_index: AnswerIndex | None = answer_index
        if draft_model is not None and not isinstance(draft_model, DraftSource):
            from infemeral.speculation.draft_model import DraftModel

            draft_model = DraftModel.load(draft_model, self.tokenizer)
        self.draft_model: DraftSource | None = draft_model
        if draft_head is not None and not hasattr(draft_head, "fork"):
            from infemeral.speculation.head.drafter import DraftHead

            draft_head = DraftHead.load(draft_head, self.model)
        self.draft_head = draft_head  # a DraftHead: each session drafts through its own fork
        self.step_cost = StepCost()  # what a step of each size costs on this link, learnt across sessions
        self.draft_history: dict[str, SourceHistory] = {}  # each draft source's acceptance and cost, ditto

    @classmethod
    def from_settings(cls, settings: ClientSettings, interceptors: list | None = None) -> "Client":
        """From a `ClientSettings` (the command line's and the endpoint's): its server, bundle, connection and
        how the laptop's half computes; `interceptors` go on its channel. Draft sources and the answer index are
        the caller's to add."""
        return cls(settings.server, settings.client_bundle, **settings.connection(), interceptors=interceptors,
                   client_dtype=settings.client_dtype, client_device=settings.client_device,
                   client_quant=settings.client_quant, wire=settings.wire)

    # -- server -------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self.link.address

    @property
    def channel(self):
        """The link's gRPC channel: the one every call of this client travels on."""
        return self.link.channel

    @property
    def stub(self):
        """The link's stub: a turn's stream is opened on it."""
        return self.link.stub

    def server_info(self, refresh: bool = False) -> pb.ServerInfo:
        """The server's info, fetched once (again with `refresh`) and checked against this client's model."""
        if self._info is None or refresh:
            self._info = self.link.server_info()
            if self._info.hidden_size != self.model.hidden_size:
                raise FailedPrecondition(f"server serves hidden size {self._info.hidden_size}, this client bundle "
                                         f"has {self.model.hidden_size}: they belong to different models")
        return self._info

    @property
    def wire(self) -> Wire:
        """How this client's turns send hidden states to the server and ask for its answers (`wire_mode`)."""
        return Wire.choose(self.wire_mode, self.server_info().dtype)

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
    def new_session(self, system_prompt: str | None = None) -> Session:
        return Session(self, system_prompt=system_prompt)

    def load_session(self, path: str | Path) -> Session:
        return Session.load(self, path)

    def generate(self, prompt: str, sampling: SamplingParams | None = None, *, delete: bool = True,
                 on_progress: ProgressCallback | None = None) -> TurnResult:
        """One question, one answer, in a fresh session (deleted from the server afterwards); `on_progress` as
        for `Session.chat`."""
        session = self.new_session()
        try:
            return session.chat(prompt, sampling, on_progress=on_progress)
        finally:
            if delete and session.version:
                session.delete()

    def close(self) -> None:
        self.link.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

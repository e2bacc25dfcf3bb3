"""Upload: time to first token of long prompts over a home uplink, by how hidden states travel.

Every prompt token goes up as a hidden state (d x bytes per element), so over a home uplink the time to the
first token of a long prompt is mostly the upload. The link is `scripts/delay_proxy.py`: 80 ms round trip,
20 or 100 Mbit/s up, 100 Mbit/s down, token-bucket paced. Four parts, each its own rows:

* transport: a turn's prompt steps (max_step_tokens each, each waiting for its answer: the wire alone, with no
  overlap of upload and prefill) through the proxy to a stand-in pod that decodes every step as the server
  does and answers its last row in the wire asked for, without running layers: the real encoding, message
  sizes and gRPC framing, against the floor of the upload's bytes over the link rate. At the default model's
  width (576) with its own hidden states, and at Llama-3-8B's (4,096) with random rows of that width (sizes
  and encoding time do not depend on the values);
* end to end: the real split (client half and a bfloat16 server of the default model) through the proxy,
  time to first token as the client measures it, laptop and pod compute included;
* agreement: each 8-bit wire against the bfloat16 wire on the default model, in process through the real
  encoders (`to_proto`/`from_proto`) and the served layers in bfloat16 (`infemeral.eval`'s systems and
  measures): top-1 agreement teacher-forced over the bfloat16 wire's greedy answers, the first divergence
  (where free greedy decoding would part), and perplexity on held text;
* lossless coding of the bfloat16 wire: compression ratio and speed of deflate (what gRPC's gzip sends) on
  the default model's real hidden states, and whether it pays at each link rate;
* a document uploaded once: the real split through the proxy at 20 Mbit/s, a first conversation about a
  4,096-token document (its time to first token), then a second about the same document, forked from the
  first on the pod (`Session.fork`): the fork and the second question's time to first token, together;
* upload overlapped with prefill: the client's own prefill (TurnLink's pipelined steps) at the 8B width to a
  stand-in pod whose prefill takes as long as the link's upload, against the upload alone and against one step
  at a time, each waiting for its answer (the client before pipelining).

The compute of the 8B shape is not run here (a CPU takes minutes per layer at these lengths; a pod's GPU
prefills in well under a second): what the wire changes is the transport, which is measured.
"""

from __future__ import annotations

import queue
import zlib
from dataclasses import dataclass

import torch

from bench.harness import at_most, fmt, log, now
from infemeral.protocol import pb_grpc
from bench.sections import Result

NAME = "upload"
TITLE = "Long prompts over a home uplink: the wire's encoding"
RTT_MS = 80
DOWN_MBIT = 100
UP_MBIT = (20, 100)
PROMPTS = (512, 2048, 4096, 8192)
QUICK_PROMPTS = (512, 4096)
END_TO_END_PROMPTS = (512, 2048)        # the real split's compute on this CPU grows fast past these
WIDTHS = {"default": 576, "llama-3-8b": 4096}
WIRES = ("bfloat16", "int8", "int8-up", "e4m3", "e4m3-up")  # the server wire of a bfloat16 pod, and the 8-bit ones
TARGET_TOKENS, TARGET_MBIT, TARGET_RATIO, TARGET_TOP1 = 4096, 20, 0.55, 0.99
AGREEMENT_POSITIONS, HELD_TOKENS = 512, 1024
DEFLATE_LEVELS = (1, 6)                  # fastest, and zlib's default (gRPC's gzip)
FORK_TOKENS, FORK_RATIO = 4096, 0.1      # a second conversation about the document starts in <= 0.1x the first's


@dataclass
class TransportRow:
    shape: str
    wire: str
    prompt_tokens: int
    up_mbit: float
    upload_bytes: int          # serialized step requests, as gRPC sends them (framing not counted)
    encode_seconds: float      # to_proto of every step on the laptop
    ttft_seconds: float        # open, every step up and its answer back, through the proxy; no layers run

    @property
    def floor_seconds(self) -> float:
        return self.upload_bytes * 8 / (self.up_mbit * 1e6)

    @property
    def over_floor(self) -> float:
        return self.ttft_seconds / self.floor_seconds if self.floor_seconds else float("nan")


@dataclass
class EndToEndRow:
    wire: str
    prompt_tokens: int
    up_mbit: float
    ttft_seconds: float        # the client's time to first token: its layers, the upload, the pod's, the answer


@dataclass
class AgreementRow:
    wire: str
    positions: int
    top1_matches: int
    first_divergence: int | None
    perplexity: float
    reference_perplexity: float  # the bfloat16 wire's, on the same held text

    @property
    def top1_rate(self) -> float:
        return self.top1_matches / self.positions if self.positions else float("nan")

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.reference_perplexity


@dataclass
class ForkRow:
    document_tokens: int
    up_mbit: float
    first_ttft_seconds: float   # the first conversation: the document and its question go up
    fork_seconds: float         # the second: the pod copies the first's cache (Session.fork) ...
    second_ttft_seconds: float  # ... and its own question goes up

    @property
    def second_start_seconds(self) -> float:
        return self.fork_seconds + self.second_ttft_seconds

    @property
    def ratio(self) -> float:
        return self.second_start_seconds / self.first_ttft_seconds


@dataclass
class OverlapRow:
    how: str                   # "upload alone", "pipelined" or "one step at a time"
    prompt_tokens: int
    up_mbit: float
    upload_bytes: int
    ttft_seconds: float        # the client's prefill: every step up, the last answer back


@dataclass
class CodingRow:
    codec: str
    raw_mb: float
    ratio: float               # coded / raw bytes
    compress_mb_s: float       # raw MB per second
    decompress_mb_s: float

    def upload_seconds_per_mb(self, mbit: float) -> float:
        """One raw MB through the codec and a link of `mbit`: compress, send the coded bytes, decompress."""
        return 1 / self.compress_mb_s + self.ratio * 8 / mbit + 1 / self.decompress_mb_s


# -- the wire through the link ------------------------------------------------------------------------------
def wire_of(name: str):
    from infemeral.protocol.tensors import Wire

    return Wire("bfloat16") if name == "bfloat16" else Wire.choose(name, "bfloat16")


class StandInPod(pb_grpc.InfemeralServicer):
    """A gRPC Turn service that decodes each step as the server does and answers its last rows in the wire asked
    for, running no layers: what the pod's side of the transport costs."""

    def __init__(self, hidden_size: int):
        import grpc
        from concurrent import futures

        from infemeral.client.client import CHANNEL_OPTIONS

        self.hidden_size = hidden_size
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=CHANNEL_OPTIONS)
        pb_grpc.add_InfemeralServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Turn(self, requests, context):  # noqa: N802 - the gRPC method's name
        from infemeral.protocol import pb
        from infemeral.protocol.tensors import EIGHT_BIT, from_proto, to_proto

        length = 0
        for request in requests:
            if request.WhichOneof("kind") == "open":
                yield pb.TurnResponse(opened=pb.Opened())
                continue
            step = request.step
            hidden = from_proto(step.hidden, self.hidden_size, 1 << 20).to(torch.bfloat16)
            length += hidden.shape[0]
            answer = step.answer_dtype or step.hidden.dtype
            out = to_proto(hidden[-max(step.outputs, 1):], answer if answer in EIGHT_BIT else "bfloat16")
            yield pb.TurnResponse(step=pb.StepResult(hidden=out, cache_length=length))

    def close(self) -> None:
        self.server.stop(0)


def transport_turn(address: str, hidden: torch.Tensor, wire, chunk: int) -> tuple[float, float, int]:
    """One turn's prompt through `address`: (seconds from open to the last answer, seconds encoding, bytes up)."""
    import grpc

    from infemeral.client.client import CHANNEL_OPTIONS
    from infemeral.protocol import pb, pb_grpc
    from infemeral.protocol.tensors import from_proto, to_proto

    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        requests: queue.Queue = queue.Queue()
        replies = pb_grpc.InfemeralStub(channel).Turn(iter(requests.get, None), timeout=600)
        started = now()
        requests.put(pb.TurnRequest(open=pb.OpenTurn()))
        next(replies)
        encode = 0.0
        sent = 0
        for start in range(0, hidden.shape[0], chunk):
            t = now()
            tensor = to_proto(hidden[start:start + chunk], wire.upload)
            encode += now() - t
            request = pb.TurnRequest(step=pb.Step(hidden=tensor, cache_length=start, answer_dtype=wire.answer))
            sent += request.ByteSize()
            requests.put(request)
            from_proto(next(replies).step.hidden, hidden.shape[1], 1)
        elapsed = now() - started
        requests.put(None)
        replies.cancel()
    return elapsed, encode, sent


def measure_transport(shape: str, hidden_of, prompts, rates, chunk: int) -> list[TransportRow]:
    from delay_proxy import DelayProxy

    width = WIDTHS[shape]
    pod = StandInPod(width)
    rows = []
    try:
        for n in prompts:
            hidden = hidden_of(n)
            for mbit in rates:
                with DelayProxy(f"127.0.0.1:{pod.port}", rtt_ms=RTT_MS, up_mbit=mbit, down_mbit=DOWN_MBIT) as proxy:
                    for wire in WIRES:
                        ttft, encode, sent = transport_turn(proxy.address, hidden, wire_of(wire), chunk)
                        rows.append(TransportRow(shape, wire, n, mbit, sent, encode, ttft))
                        log(f"  {shape} {n} tokens, {mbit} Mbit/s up, {wire}: {ttft:.2f} s "
                            f"({sent / 1e6:.1f} MB, floor {rows[-1].floor_seconds:.2f} s)")
    finally:
        pod.close()
    return rows


def random_rows(n: int, width: int = WIDTHS["llama-3-8b"]) -> torch.Tensor:
    """Rows of the 8B width with a few outlier channels, as residual streams have (values do not change the
    bytes or the encoding's time)."""
    gen = torch.Generator().manual_seed(n)
    rows = torch.randn(n, width, generator=gen)
    rows[:, :8] *= 40
    return rows


class DefaultHidden:
    """The default model's own hidden states for prompts of each length: what the client half sends."""

    def __init__(self, split):
        self.split = split

    @torch.inference_mode()
    def __call__(self, n: int) -> torch.Tensor:
        model = self.split.client.model
        _, ids = self.split.prompt_of_length(n)
        cache = model.new_cache()
        chunk = self.split.info.max_step_tokens
        return torch.cat([model.cloak(ids[i:i + chunk], cache) for i in range(0, len(ids), chunk)])


# -- end to end on the default model --------------------------------------------------------------------------
def measure_end_to_end(wb, split, prompts, rates) -> list[EndToEndRow]:
    from delay_proxy import DelayProxy

    from infemeral.client.client import Client
    from infemeral.client.sampling import SamplingParams

    rows = []
    once = SamplingParams(max_new_tokens=1, speculate="off")
    for mbit in rates:
        with DelayProxy(split.address, rtt_ms=RTT_MS, up_mbit=mbit, down_mbit=DOWN_MBIT) as proxy:
            for wire in WIRES:
                mode = "server" if wire == "bfloat16" else wire
                client = Client(proxy.address, wb.client_dir, timeout=600, client_device="cpu",
                                wire=mode)
                try:
                    client.generate("Hello!", SamplingParams(max_new_tokens=2, speculate="off"))  # warm-up
                    for n in prompts:
                        text, _ = split.prompt_of_length(n)
                        result = client.generate(text, once)
                        rows.append(EndToEndRow(wire, result.prompt_tokens, mbit, result.time_to_first_token))
                        log(f"  end to end {result.prompt_tokens} tokens, {mbit} Mbit/s up, {wire}: "
                            f"{result.time_to_first_token:.2f} s")
                finally:
                    client.close()
    return rows


def measure_fork(wb, split, document_tokens: int, mbit: float) -> ForkRow:
    """A first conversation about a document through the link, then a second forked from it on the pod."""
    from delay_proxy import DelayProxy

    from infemeral.client.client import Client
    from infemeral.client.sampling import SamplingParams

    once = SamplingParams(max_new_tokens=1, speculate="off")
    document, _ = split.prompt_of_length(document_tokens)
    with DelayProxy(split.address, rtt_ms=RTT_MS, up_mbit=mbit, down_mbit=DOWN_MBIT) as proxy:
        client = Client(proxy.address, wb.client_dir, timeout=600, client_device="cpu")
        try:
            client.generate("Hello!", SamplingParams(max_new_tokens=2, speculate="off"))  # warm-up
            first = client.new_session()
            try:
                first_ttft = first.chat(document + "\nWho is this about?", once).time_to_first_token
                started = now()
                second = first.fork()
                fork_seconds = now() - started
                try:
                    second_ttft = second.chat("Where does it take place?", once).time_to_first_token
                finally:
                    second.delete()
            finally:
                first.delete()
        finally:
            client.close()
    row = ForkRow(len(first.history_ids), mbit, first_ttft, fork_seconds, second_ttft)
    log(f"  fork: a {row.document_tokens}-token conversation at {mbit} Mbit/s: first {first_ttft:.2f} s; the second "
        f"{row.second_start_seconds:.2f} s (fork {fork_seconds:.2f} s), {row.ratio:.3f}x")
    return row


# -- agreement on the default model ---------------------------------------------------------------------------
def measure_agreement(wb, positions: int, held_tokens: int) -> list[AgreementRow]:
    """Each 8-bit wire against the bfloat16 wire, through the real encoders and bfloat16 served layers; and the
    bfloat16 wire against itself (teacher-forced over its own greedy answers, which it computed one token at a
    time): the floor of the measure, where the served layers' bfloat16 rounding alone parts."""
    from infemeral.eval import metrics
    from infemeral.eval.server_quant import AGREEMENT_PROMPTS
    from infemeral.eval.systems import BundleSplit

    base = BundleSplit(wb.client_dir, wb.server_dir, dtype=torch.bfloat16)
    tokenizer = base.client.bundle.laptop_tokenizer()
    systems = {wire: WireSplit(base, wire_of(wire)) for wire in WIRES}
    reference = systems["bfloat16"]
    prompts = [metrics.chat_ids(tokenizer, p) for p in AGREEMENT_PROMPTS]
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    sequences = metrics.greedy_sequences(reference, prompts, positions, stop)
    held = tokenizer(metrics.DEFAULT_TEXT.read_text(), add_special_tokens=False)["input_ids"][:held_tokens]
    reference_perplexity = metrics.perplexity(reference, held)
    rows = []
    for wire in WIRES:
        agreed = metrics.agreement(systems[wire], sequences)
        perplexity = reference_perplexity if wire == "bfloat16" else metrics.perplexity(systems[wire], held)
        rows.append(AgreementRow(wire, agreed.positions, agreed.top1_matches, agreed.first_divergence,
                                 perplexity, reference_perplexity))
        log(f"  {wire} against the bfloat16 wire: {agreed.describe()}, perplexity x{rows[-1].perplexity_ratio:.4f}")
    return rows


class WireSplit:
    """The split with the wire between its halves: the client's hidden states encoded and decoded as sent, the
    served layers' answers as they come back."""

    def __init__(self, split, wire):
        self.split, self.wire = split, wire

    def new_cache(self):
        return self.split.new_cache()

    @torch.inference_mode()
    def logits(self, ids: list[int], cache) -> torch.Tensor:
        from infemeral.protocol.tensors import EIGHT_BIT, from_proto, to_proto

        client, server = self.split.client, self.split.server
        client_cache, server_cache = cache
        d = client.hidden_size
        sent = from_proto(to_proto(client.cloak(ids, client_cache), self.wire.upload), d, len(ids))
        out = server(sent.to(torch.bfloat16), server_cache)
        answer = self.wire.answer or self.wire.upload
        back = from_proto(to_proto(out, answer if answer in EIGHT_BIT else "bfloat16"), d, len(ids))
        return client.logits(back.to(torch.float32))


# -- lossless coding of the bfloat16 wire ---------------------------------------------------------------------
def measure_coding(hidden: torch.Tensor) -> list[CodingRow]:
    raw = hidden.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
    rows = []
    for level in DEFLATE_LEVELS:
        t = now()
        coded = zlib.compress(raw, level)
        compress = now() - t
        t = now()
        assert zlib.decompress(coded) == raw
        decompress = now() - t
        mb = len(raw) / 1e6
        rows.append(CodingRow(f"deflate level {level}", mb, len(coded) / len(raw), mb / compress, mb / decompress))
        log(f"  {rows[-1].codec}: {rows[-1].ratio:.3f} of the bytes, {rows[-1].compress_mb_s:.0f} MB/s in, "
            f"{rows[-1].decompress_mb_s:.0f} MB/s out")
    return rows


# -- upload overlapped with prefill ---------------------------------------------------------------------------
OVERLAP_TOKENS, OVERLAP_RATIO = 4096, 1.15  # time to first token <= 1.15x the upload alone


class StandInHalf:
    """The laptop's half at the 8B width, costing nothing: `cloak` hands out the prompt's precomputed rows in order
    (what TurnLink's steps carry), the rest passes the answer through."""

    def __init__(self, rows: torch.Tensor):
        self.rows, self.hidden_size = rows, rows.shape[1]
        self.inv_freq = torch.ones(1)

    def cloak(self, ids: list[int], cache, *_) -> torch.Tensor:
        start = cache.length
        cache.length += len(ids)
        return self.rows[start:cache.length]

    def features(self, residual: torch.Tensor) -> torch.Tensor:
        return residual

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return features


class PrefillingPod(StandInPod):
    """The stand-in pod with a prefill that takes `tokens_per_second` (0: none), reading a turn's next message
    while it works on one, as the server does (infemeral/server/turn_call.py)."""

    def __init__(self, hidden_size: int, tokens_per_second: float):
        self.tokens_per_second = tokens_per_second
        super().__init__(hidden_size)

    def Turn(self, requests, context):  # noqa: N802 - the gRPC method's name
        import itertools
        import threading
        import time

        from infemeral.protocol import pb
        from infemeral.protocol.tensors import from_proto, to_proto
        from infemeral.server.turn_call import READ_AHEAD_BYTES

        inbox: list = []  # (request, bytes), read ahead up to the server's bound
        changed = threading.Condition()

        def read() -> None:
            for request in itertools.chain(requests, [None]):
                size = request.ByteSize() if request is not None else 0
                with changed:
                    changed.wait_for(lambda: not inbox or sum(n for _, n in inbox) + size <= READ_AHEAD_BYTES)
                    inbox.append((request, size))
                    changed.notify_all()

        def take():
            with changed:
                changed.wait_for(lambda: bool(inbox))
                request, _ = inbox.pop(0)
                changed.notify_all()
                return request

        threading.Thread(target=read, daemon=True).start()
        length = 0
        for request in iter(take, None):
            if request.WhichOneof("kind") == "open":
                yield pb.TurnResponse(opened=pb.Opened())
                continue
            hidden = from_proto(request.step.hidden, self.hidden_size, 1 << 20)
            length += hidden.shape[0]
            if self.tokens_per_second:
                time.sleep(hidden.shape[0] / self.tokens_per_second)
            yield pb.TurnResponse(step=pb.StepResult(hidden=to_proto(hidden[-1:], "bfloat16"), cache_length=length))


def overlap_prefill(address: str, rows: torch.Tensor, max_step_tokens: int) -> float:
    """The real client's prefill (TurnLink.prefill over a TurnStream) of `rows` through `address`: its seconds."""
    from types import SimpleNamespace

    import grpc

    from infemeral.client.client import CHANNEL_OPTIONS
    from infemeral.client.stream import TurnStream
    from infemeral.client.turn_link import TurnLink
    from infemeral.protocol import pb
    from infemeral.protocol.tensors import Wire

    info = pb.ServerInfo(max_step_tokens=max_step_tokens, max_context=1 << 30, window=False)
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        client = SimpleNamespace(server_info=lambda: info, stub=pb_grpc.InfemeralStub(channel), timeout=600)
        stream = TurnStream(client)
        try:
            stream.call(pb.TurnRequest(open=pb.OpenTurn()), "opened")
            link = TurnLink(StandInHalf(rows), SimpleNamespace(length=0), [], stream, info, Wire("bfloat16"))
            started = now()
            link.prefill(list(range(rows.shape[0])))
            return now() - started
        finally:
            stream.close()


def measure_overlap(tokens: int, mbit: float, max_step_tokens: int) -> list[OverlapRow]:
    """At the 8B width: the upload alone (a pod that computes nothing), then a pod whose prefill takes as long as
    the link takes to carry the prompt (their sum is twice either), with the prompt's steps pipelined and one
    step of max_step_tokens at a time, each waiting for its answer (the client before pipelining)."""
    from delay_proxy import DelayProxy

    from infemeral.client import upload

    rows = random_rows(tokens)
    upload_bytes = tokens * 2 * rows.shape[1]  # bfloat16
    link_tokens_per_second = mbit * 1e6 / 8 / (upload_bytes / tokens)
    out = []
    for how, pod_rate in (("upload alone", 0.0), ("pipelined", link_tokens_per_second),
                          ("one step at a time", link_tokens_per_second)):
        pod = PrefillingPod(rows.shape[1], pod_rate)
        saved = upload.MAX_IN_FLIGHT, upload.FIRST_CHUNK_BYTES
        if how == "one step at a time":
            upload.MAX_IN_FLIGHT, upload.FIRST_CHUNK_BYTES = 1, 1 << 62
        try:
            with DelayProxy(f"127.0.0.1:{pod.port}", rtt_ms=RTT_MS, up_mbit=mbit, down_mbit=DOWN_MBIT) as proxy:
                seconds = overlap_prefill(proxy.address, rows, max_step_tokens)
        finally:
            upload.MAX_IN_FLIGHT, upload.FIRST_CHUNK_BYTES = saved
            pod.close()
        out.append(OverlapRow(how, tokens, mbit, upload_bytes, seconds))
        log(f"  overlap, {tokens} tokens at the 8B width, {mbit:g} Mbit/s up, {how}: {seconds:.2f} s")
    return out


def overlap_facts(rows: list) -> dict:
    """Each way's time to first token over the upload alone's, by prompt length."""
    alone = {r.prompt_tokens: r.ttft_seconds for r in rows if isinstance(r, OverlapRow) and r.how == "upload alone"}
    return {f"{r.how}/{r.prompt_tokens}": r.ttft_seconds / alone[r.prompt_tokens]
            for r in rows if isinstance(r, OverlapRow) and r.prompt_tokens in alone}


# -- the section ----------------------------------------------------------------------------------------------
def run(wb) -> Result:
    split = wb.split("bfloat16")
    chunk = split.info.max_step_tokens
    prompts = QUICK_PROMPTS if wb.quick else PROMPTS
    rates = (TARGET_MBIT,) if wb.quick else UP_MBIT
    default_hidden = DefaultHidden(split)
    log("  transport (a stand-in pod: encoding, bytes and framing through the link, no layers)")
    rows: list = measure_transport("llama-3-8b", random_rows, prompts, rates, chunk)
    rows += measure_transport("default", default_hidden, prompts[:1] if wb.quick else prompts, rates, chunk)
    log("  end to end (the default model's split, bfloat16 pod)")
    rows += measure_end_to_end(wb, split, END_TO_END_PROMPTS[:1] if wb.quick else END_TO_END_PROMPTS, rates)
    log("  agreement of the 8-bit wires with the bfloat16 wire")
    rows += measure_agreement(wb, 64 if wb.quick else AGREEMENT_POSITIONS, 256 if wb.quick else HELD_TOKENS)
    log("  lossless coding of the bfloat16 wire")
    rows += measure_coding(default_hidden(prompts[-1]))
    log("  a document uploaded once (a second conversation forked on the pod)")
    rows.append(measure_fork(wb, split, 512 if wb.quick else FORK_TOKENS, TARGET_MBIT))
    log("  upload overlapped with prefill (the client's prefill, a stand-in pod at the 8B width)")
    rows += measure_overlap(1024 if wb.quick else OVERLAP_TOKENS, TARGET_MBIT, chunk)
    facts = summarise(rows)
    return Result(NAME, method(chunk), rows, targets(facts), facts)


def summarise(rows: list) -> dict:
    transport = {(r.shape, r.wire, r.prompt_tokens, r.up_mbit): r for r in rows if isinstance(r, TransportRow)}
    agreement = {r.wire: r for r in rows if isinstance(r, AgreementRow)}
    facts: dict = {"ratio_to_bf16": {}, "top1": {w: r.top1_rate for w, r in agreement.items()}}
    for (shape, wire, n, mbit), r in transport.items():
        base = transport.get((shape, "bfloat16", n, mbit))
        if base is not None and wire != "bfloat16":
            facts["ratio_to_bf16"][f"{shape}/{wire}/{n}/{mbit:g}"] = r.ttft_seconds / base.ttft_seconds
    coding = [r for r in rows if isinstance(r, CodingRow)]
    facts["coding_pays"] = {f"{r.codec} at {mbit} Mbit/s": r.upload_seconds_per_mb(mbit) < 8 / mbit
                            for r in coding for mbit in UP_MBIT}
    facts["fork"] = {f"{r.document_tokens}/{r.up_mbit:g}": r.ratio for r in rows if isinstance(r, ForkRow)}
    facts["overlap"] = overlap_facts(rows)
    return facts


def targets(facts: dict) -> list:
    out = [eight_bit_target(facts)]
    forks = facts.get("fork", {})
    tokens, ratio = max(((int(k.split("/")[0]), v) for k, v in forks.items()), default=(0, float("nan")))
    value = ratio if tokens >= FORK_TOKENS - 64 else float("nan")  # a quick run's short document is no pass
    out.append(at_most(NAME, "fork", f"a second conversation about the same {FORK_TOKENS}-token document (forked "
                                     f"on the pod) starts in <= {FORK_RATIO} x the first one's time to first token, "
                                     f"default model, {TARGET_MBIT} Mbit/s, {RTT_MS} ms", value, FORK_RATIO,
                       f"{fmt(ratio, '.3f')}x at {tokens} tokens"))
    ratio = facts.get("overlap", {}).get(f"pipelined/{OVERLAP_TOKENS}", float("nan"))
    out.append(at_most(NAME, "overlap", f"upload overlapped with prefill: time to first token of a "
                       f"{OVERLAP_TOKENS}-token prompt at the 8B width, {TARGET_MBIT} Mbit/s up, with a pod that "
                       f"prefills as fast as the link uploads, <= {OVERLAP_RATIO} x the upload alone", ratio,
                       OVERLAP_RATIO, f"{fmt(ratio, '.2f')}x"))
    return out


def eight_bit_target(facts: dict):
    """The best 8-bit wire's line: one that meets both bars if any, else the one closest to the bfloat16 wire."""
    def measured(wire: str) -> tuple[float, float]:
        return (facts["ratio_to_bf16"].get(f"llama-3-8b/{wire}/{TARGET_TOKENS}/{TARGET_MBIT}", float("nan")),
                facts["top1"].get(wire, float("nan")))

    def rank(wire: str) -> tuple:
        ratio, top1 = measured(wire)
        return top1 >= TARGET_TOP1 and ratio <= TARGET_RATIO, top1 if top1 == top1 else -1.0, -ratio

    wire = max(WIRES[1:], key=rank)
    ratio, top1 = measured(wire)
    value = ratio if top1 >= TARGET_TOP1 else float("nan")  # fast but far from bfloat16 is no pass
    floor = facts["top1"].get("bfloat16", float("nan"))
    return at_most(NAME, f"eight_bit_ttft_{TARGET_TOKENS}_8b_{TARGET_MBIT}mbit",
                   f"the best 8-bit wire: time to first token of a {TARGET_TOKENS}-token prompt at the 8B shape on a "
                   f"{TARGET_MBIT} Mbit/s uplink <= {TARGET_RATIO} x the bfloat16 wire, with top-1 agreement "
                   f">= {TARGET_TOP1:.0%}", value, TARGET_RATIO,
                   f"{wire}: {fmt(ratio, '.2f')}x, top-1 {fmt(100 * top1, '.1f')} % (the bfloat16 wire against "
                   f"itself: {fmt(100 * floor, '.1f')} %)")


def method(chunk: int) -> str:
    return (f"The link is `scripts/delay_proxy.py`: {RTT_MS} ms round trip, {' or '.join(map(str, UP_MBIT))} Mbit/s "
            f"up, {DOWN_MBIT} Mbit/s down (token-bucket paced, nothing dropped). Transport: a turn's prompt in steps "
            f"of {chunk} tokens (each waiting for its answer: the wire alone, no overlap) to a stand-in pod that "
            "decodes every step as the server does and answers its last row in the wire asked for, running no "
            "layers; the time runs from opening the turn to the last answer decoded, the floor is the upload's "
            "bytes over the link rate. The 8B shape's rows are random rows of width 4,096 (bytes and encoding "
            "time do not depend on the values), the default model's its own hidden states. End to end: the "
            "default model's real split (bfloat16 pod, float32 laptop half, both on this CPU) through the same "
            "link; the client's time to first token. Agreement: the 8-bit wires against the bfloat16 wire, in "
            "process through the real encoders and bfloat16 served layers; top-1 teacher-forced over the "
            "bfloat16 wire's greedy answers to chat prompts (the first divergence is where free greedy decoding "
            "parts; the bfloat16 wire's own row is the measure's floor: teacher-forced, it computes in other "
            "shapes than the one token at a time that chose those answers), perplexity on held text. Coding: "
            "deflate (gRPC's gzip) on the default model's hidden states of the longest prompt in bfloat16; it pays at a rate when compressing, sending the coded bytes and "
            "decompressing take less than sending the raw bytes. Fork: the default model's split through the "
            f"link at {TARGET_MBIT} Mbit/s, a first conversation about a {FORK_TOKENS}-token document (its time to "
            "first token), then a second forked from it on the pod with a question of its own: the fork's time "
            "plus that question's time to first token.")


def report(r: Result) -> list[str]:
    lines = [r.method + "\n", "| shape | wire | prompt tokens | up Mbit/s | MB up | floor s | encode s | TTFT s | "
             "x floor | x bfloat16 |", "|---|---|---|---|---|---|---|---|---|---|"]
    ratios = r.facts.get("ratio_to_bf16", {})
    for x in r.rows:
        if isinstance(x, TransportRow):
            key = f"{x.shape}/{x.wire}/{x.prompt_tokens}/{x.up_mbit:g}"
            lines.append(f"| {x.shape} | {x.wire} | {x.prompt_tokens} | {x.up_mbit:g} | {x.upload_bytes / 1e6:.2f} | "
                         f"{x.floor_seconds:.2f} | {x.encode_seconds:.3f} | {x.ttft_seconds:.2f} | "
                         f"{fmt(x.over_floor, '.2f')} | {fmt(ratios.get(key, float('nan')), '.2f')} |")
    lines += ["", "End to end, the default model (time to first token as the client measures it, both halves "
              "computing on this CPU):", "", "| wire | prompt tokens | up Mbit/s | TTFT s |", "|---|---|---|---|"]
    lines += [f"| {x.wire} | {x.prompt_tokens} | {x.up_mbit:g} | {x.ttft_seconds:.2f} |" for x in r.rows
              if isinstance(x, EndToEndRow)]
    lines += ["", "Agreement with the bfloat16 wire (default model):", "",
              "| wire | positions | top-1 | first divergence | perplexity | x bfloat16 wire |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {x.wire} | {x.positions} | {100 * x.top1_rate:.1f} % | "
              f"{'none' if x.first_divergence is None else x.first_divergence} | {x.perplexity:.3f} | "
              f"{x.perplexity_ratio:.4f} |" for x in r.rows if isinstance(x, AgreementRow)]
    lines += ["", "Lossless coding of the bfloat16 wire (default model's hidden states):", "",
              "| codec | MB | coded / raw | compress MB/s | decompress MB/s | s per raw MB at 20 / 100 Mbit/s "
              "(raw: 0.40 / 0.08) |", "|---|---|---|---|---|---|"]
    lines += [f"| {x.codec} | {x.raw_mb:.1f} | {x.ratio:.3f} | {x.compress_mb_s:.0f} | {x.decompress_mb_s:.0f} | "
              f"{x.upload_seconds_per_mb(20):.3f} / {x.upload_seconds_per_mb(100):.3f} |"
              for x in r.rows if isinstance(x, CodingRow)]
    lines += ["", "A document uploaded once (default model; the second conversation forked from the first):", "",
              "| document tokens | up Mbit/s | first TTFT s | fork s | second TTFT s | second start / first TTFT |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {x.document_tokens} | {x.up_mbit:g} | {x.first_ttft_seconds:.2f} | {x.fork_seconds:.3f} | "
              f"{x.second_ttft_seconds:.2f} | {x.ratio:.3f} |" for x in r.rows if isinstance(x, ForkRow)]
    lines += ["", "Upload overlapped with prefill: the client's own prefill (TurnLink, its steps and their sizes) of "
              "random rows at the 8B width through the link, to a stand-in pod that reads the next message while it "
              "works on one (as the server does) and whose prefill takes as long as the link takes to carry the "
              "prompt (the sum of the two is twice either); against the same prompt to a pod that computes nothing "
              "(the upload alone), and against one step of max_step_tokens at a time, each waiting for its answer "
              "(the client before pipelining):", "",
              "| how | prompt tokens | up Mbit/s | MB up | TTFT s | x upload alone |", "|---|---|---|---|---|---|"]
    ratios = r.facts.get("overlap", {})
    lines += [f"| {x.how} | {x.prompt_tokens} | {x.up_mbit:g} | {x.upload_bytes / 1e6:.2f} | {x.ttft_seconds:.2f} | "
              f"{fmt(ratios.get(f'{x.how}/{x.prompt_tokens}', float('nan')), '.2f')} |"
              for x in r.rows if isinstance(x, OverlapRow)]
    return lines + [""]

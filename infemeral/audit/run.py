"""`audit()`: run every attack on the user's own prompt, on exactly what the pod would see.

Needs only the client bundle. With the matching server bundle (found next to the client
bundle, or passed in) it also inverts the first served layer's keys and values; with
the public model the bundles were prepared from it also solves Q from the server bundle
the way an operator would, instead of simulating that step with the client's own Q.
"""

from __future__ import annotations

import time
from pathlib import Path

from infemeral.audit.context_matching import Recovery
from infemeral.audit.gram_linking import link
from infemeral.audit.kv_inversion import invert_keys_values
from infemeral.audit.norm_matching import match_norms
from infemeral.audit.observed import observe, on_the_wire, served_keys_values
from infemeral.audit.procrustes import solve_basis, spectrum_difference
from infemeral.audit.public_weights import PublicWeights
from infemeral.audit.report import AuditReport, Row
from infemeral.audit.samples import DEFAULT_PROMPT, EARLIER_EXCHANGE
from infemeral.audit.tables import VocabularyTables
from infemeral.audit.vocabulary_matching import match_vocabulary
from infemeral.client_half.half import ClientModel
from infemeral.cloak.bundle import ClientBundle, ServerBundle
from infemeral.cloak.sources import WeightSource, open_source
from infemeral.errors import FailedPrecondition, InvalidArgument
from infemeral.protocol.tensors import WIRE_NAMES

NO_Q = "public embedding table; no Q"


def audit(prompt: str | None = None, client_bundle: str | Path | None = None, *, system: str | None = None,
          server_bundle: str | Path | None = None, public_model: str | Path | WeightSource | None = None,
          wire_dtype: str = "float32", progress: bool = False) -> AuditReport:
    """Measure what each observer recovers of `prompt` (default: a built-in sensitive sample), as the pod receives
    it over a wire of `wire_dtype` (the server's dtype, or int8 or float8_e4m3fn for an 8-bit wire)."""
    prompt = DEFAULT_PROMPT if prompt is None else prompt
    if not prompt.strip():
        raise InvalidArgument("the prompt is empty: pass the text to audit, or leave it out to audit the "
                              "built-in sample")
    if wire_dtype not in WIRE_NAMES:
        raise InvalidArgument(f"wire dtype must be one of {', '.join(WIRE_NAMES)}, got {wire_dtype!r}")
    if client_bundle is None:
        from infemeral.client.settings import ClientSettings

        client_bundle = ClientSettings().client_bundle
    bundle = ClientBundle.open(client_bundle)
    run = Audit(bundle, find_server_bundle(bundle, server_bundle), wire_dtype, progress)
    return run.report(prompt, system, public_model)


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


class Audit:
    """One audit: the user's bundles, what the pod sees of one prompt, and the attackers' shared tables."""

    def __init__(self, bundle: ClientBundle, server: ServerBundle | None, wire: str, progress: bool):
        self.bundle, self.server, self.wire, self.progress = bundle, server, wire, progress
        self.model = ClientModel(bundle)
        self.tokenizer = bundle.tokenizer()
        self.basis = bundle.basis().double()
        self.notes: list[str] = []

    def report(self, prompt: str, system: str | None, public_model) -> AuditReport:
        started = time.perf_counter()
        head = [{"role": "system", "content": system}] if system else []
        self.seen = observe(self.model, self.tokenizer, head + [{"role": "user", "content": prompt}], self.wire)
        repeated = head + EARLIER_EXCHANGE + [{"role": "user", "content": prompt}]  # a second session
        self.again = observe(self.model, self.tokenizer, repeated, self.wire)
        self.is_public = public_model is not None
        self.weights = self._public_weights(public_model)
        self.tables = VocabularyTables(self.weights, self.progress)
        rows = self.norm_rows() + [self.gram_row()] + self.vocabulary_rows()
        if self.server is not None:
            rows.append(self.kv_row())
        else:
            self.notes.append("K/V inversion and solving Q need the server bundle: none matching this client bundle "
                              f"in {self.bundle.directory.parent / 'server'}; pass --server-bundle DIR")
        return AuditReport(prompt_tokens=self.seen.num_tokens, user_tokens=len(self.seen.user_positions),
                           client_layers=self.bundle.client_layers, wire_dtype=self.wire,
                           public_weights=self.weights.description, rows=rows, notes=self.notes,
                           seconds=time.perf_counter() - started,
                           user_token_text=[self.tokenizer.decode([self.seen.token_ids[i]])
                                            for i in self.seen.user_positions])

    def _public_weights(self, public_model) -> PublicWeights:
        if public_model is None:
            return PublicWeights.simulated(self.model, self.server, self.basis)
        if not isinstance(public_model, WeightSource):
            path = Path(public_model).expanduser()
            if not path.exists():
                raise FileNotFoundError(f"public model not found: {path} (pass a model directory or a .gguf file)")
            public_model = open_source(path)
        weights = PublicWeights.load(public_model, self.bundle.client_layers)
        weights.check_matches(self.model)
        return weights

    # -- one method per attack ------------------------------------------------------------------
    def norm_rows(self) -> list[Row]:
        t0 = time.perf_counter()
        plain = self.model.embed.lookup(self.seen.token_ids).double() @ self.basis  # no local layers
        raw = on_the_wire(plain, self.wire)
        raw_guess = match_norms(raw, self.weights.embed)
        t1 = time.perf_counter()
        guess = match_norms(self.seen.hidden, self.weights.embed)
        t2 = time.perf_counter()
        n = self.bundle.client_layers
        layers = "layer 0" if n == 1 else f"layers 0-{n - 1}"
        return [self._recovery_row("norms_raw", f"norm matching, had the client not run {layers}", NO_Q, raw_guess,
                                   _seconds(t1 - t0)),
                self._recovery_row("norms", "norm matching", NO_Q, guess, _seconds(t2 - t1))]

    def gram_row(self) -> Row:
        t0 = time.perf_counter()
        g = link(self.seen, self.again)
        overall = (f"AUC {g.auc_within:.3f} within, {g.auc_across:.3f} across sessions; "
                   f"{g.linked_pairs}/{g.same_token_pairs} repeat pairs linked, {g.false_links} false")
        user = f"{g.user_tokens_linked}/{g.user_tokens} tokens linked to their repeat in another session"
        metrics = dict(auc_within=g.auc_within, auc_across=g.auc_across, same_token_pairs=g.same_token_pairs,
                       linked_pairs=g.linked_pairs, false_links=g.false_links, user_tokens=g.user_tokens,
                       user_tokens_linked=g.user_tokens_linked, identical_across_sessions=g.num_identical,
                       threshold=g.threshold)
        return Row("gram", f"Gram linking (cosine >= {g.threshold:.2f} links)", "only the traffic: no weights, no Q",
                   overall, user, _seconds(time.perf_counter() - t0), metrics)

    def vocabulary_rows(self) -> list[Row]:
        rows, estimate, metrics = [], self.basis, {}
        observer = "public weights + Q (simulated: the client knows Q)"
        if self.is_public and self.server is not None:
            rotated = self.server.float_layer_weights(self.server.first_layer)["self_attn.o_proj.weight"]
            t0 = time.perf_counter()
            estimate = solve_basis(self.weights.served_o_proj, rotated)
            solve_seconds = time.perf_counter() - t0
            error = float((estimate - self.basis).norm())
            observer = f"public weights; Q solved from the server bundle (error {error:.1e}, {solve_seconds:.2f} s)"
            metrics = dict(basis_error=error, solve_seconds=solve_seconds)
            t0 = time.perf_counter()
            difference = spectrum_difference(self.weights.served_o_proj, rotated)
            rows.append(Row("identification", "model identification (singular values)",
                            "server bundle + the public model", f"max. relative difference {difference:.1e}", "-",
                            _seconds(time.perf_counter() - t0), dict(spectrum_difference=difference)))
        elif self.is_public:
            observer = "public weights + Q (simulated: no server bundle to solve Q from)"
        got = match_vocabulary(self.weights, self.tables, self.seen.hidden, estimate, self.progress)
        row = self._recovery_row("vocabulary", "vocabulary matching after un-rotation", observer, got.token_ids,
                                 _recovery_time(got), **_recovery_metrics(got), **metrics)
        self._note_scans("vocabulary matching", got)
        return [row] + rows

    def kv_row(self) -> Row:
        keys, values = served_keys_values(self.server, self.seen.hidden)
        got = invert_keys_values(self.weights, self.tables, keys, values, self.progress)
        self._note_scans("K/V inversion", got)
        return self._recovery_row("kv", f"K/V inversion (layer {self.server.first_layer}'s cache)",
                                  "public weights; no Q", got.token_ids, _recovery_time(got), **_recovery_metrics(got))

    # -- helpers --------------------------------------------------------------------------------
    def _recovery_row(self, key: str, attack: str, observer: str, got: list[int], time_: str, **metrics) -> Row:
        truth, user = self.seen.token_ids, self.seen.user_positions
        correct = sum(g == t for g, t in zip(got, truth))
        user_correct = sum(got[i] == truth[i] for i in user)
        return Row(key, attack, observer, _rate(correct, len(truth)), _rate(user_correct, len(user)), time_,
                   dict(rate=correct / len(truth), user_rate=user_correct / len(user) if len(user) else None,
                        correct=correct, user_correct=user_correct, **metrics),
                   recovered_text=self.tokenizer.decode([got[i] for i in user]),
                   user_recovered=[got[i] == truth[i] for i in user])

    def _note_scans(self, what: str, got: Recovery) -> None:
        if got.num_full_scans:
            self.notes.append(f"{what}: {got.num_full_scans} position(s) needed a full scan of the vocabulary")


def _rate(correct: int, total: int) -> str:
    return f"{100 * correct / total:.1f} % ({correct}/{total})" if total else "-"


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s < 10 else f"{s:.0f} s"


def _recovery_time(got: Recovery) -> str:
    tables = f"{_seconds(got.table_seconds)} tables (once) + " if got.table_seconds else "tables above + "
    return tables + _seconds(got.seconds)


def _recovery_metrics(got: Recovery) -> dict:
    return dict(table_seconds=got.table_seconds, seconds=got.seconds, verified=got.num_verified,
                full_scans=got.num_full_scans)

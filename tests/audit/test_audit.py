"""infemeral.audit on the default model: the attacks run on what the server really receives and keeps,
they reach the figures of docs/design.md §3, and each figure can fail."""

from __future__ import annotations

import json

import pytest
import torch

from infemeral.audit import audit
from infemeral.audit.gram_linking import auc, link
from infemeral.audit.observed import Observation, observe, served_keys_values
from infemeral.audit.public_weights import PublicWeights
from infemeral.audit.tables import VocabularyTables
from infemeral.audit.vocabulary_matching import match_vocabulary
from infemeral.cli import main as cli
from infemeral.client.client import Client
from infemeral.client_half.half import ClientModel
from infemeral.client.sampling import SamplingParams
from infemeral.cloak.basis import random_orthogonal
from infemeral.cloak.bundle import ClientBundle, ServerBundle
from infemeral.errors import FailedPrecondition
from infemeral.kvcache.cache import KVCache
from infemeral.kvcache.persistence import SessionPersistence
from infemeral.kvcache.stored import SessionKeys
from infemeral.layers.stack import head_dim
from infemeral.protocol import pb
from infemeral.protocol.tensors import E4M3, INT8, from_proto
from infemeral.storage.open import open_store
from tests.protocol.test_wire import TurnRecorder

pytestmark = pytest.mark.slow

PROMPT = "My SSN is 078-05-1120 and my password is Tr0ub4dor&3."
SECRETS = ("078-05-1120", "Tr0ub4dor")


@pytest.fixture(scope="module")
def report(bundles):
    return audit(PROMPT, bundles.client_dir)


@pytest.fixture(scope="module")
def client_half(bundles):
    bundle = ClientBundle.open(bundles.client_dir)
    return ClientModel(bundle), bundle.tokenizer()


def messages(text: str = PROMPT) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- the figures ----------------------------------------------------------------------------------

def test_public_weights_operator_reads_the_prompt(report):
    vocab = report.row("vocabulary")
    assert "simulated" in vocab.observer
    assert vocab.metrics["rate"] >= 0.95 and vocab.metrics["user_rate"] >= 0.95
    assert vocab.recovered_text == PROMPT
    kv = report.row("kv")
    assert kv.metrics["rate"] >= 0.95 and kv.metrics["user_rate"] >= 0.95
    assert report.user_tokens >= 20 and report.prompt_tokens > report.user_tokens


def test_observer_without_weights_links_tokens_but_norms_give_nothing(report):
    assert report.metric("gram", "auc_within") >= 0.95
    assert report.metric("gram", "auc_across") >= 0.95
    assert report.metric("gram", "user_tokens_linked") >= 0.9 * report.user_tokens
    assert report.metric("norms", "rate") <= 0.05
    # The same norm attack on rotated *embeddings* works: running layer 0 locally is what stops it.
    assert report.metric("norms_raw", "rate") >= 0.95


def test_report_shows_recovered_text_only_when_asked(report):
    for secret in SECRETS:
        assert secret not in report.text() and secret not in report.to_json()
        assert secret in report.text(show_tokens=True) and secret in report.to_json(show_tokens=True)
    data = json.loads(report.to_json())
    assert {r["key"] for r in data["rows"]} == {"norms_raw", "norms", "gram", "vocabulary", "kv"}
    assert data["verdict"] and "confidential-computing GPU" in " ".join(data["verdict"])
    assert "attack" in report.table().splitlines()[0]


def test_each_token_of_the_users_text_is_flagged_by_whether_each_observer_recovers_it(report):
    assert "".join(report.user_token_text) == PROMPT and len(report.user_token_text) == report.user_tokens
    for row in report.rows:
        if "user_correct" in row.metrics:
            assert len(row.user_recovered) == report.user_tokens
            assert sum(row.user_recovered) == row.metrics["user_correct"]
    assert all(report.row("vocabulary").user_recovered) and not any(report.row("norms").user_recovered)
    assert "user_token_text" not in json.loads(report.to_json())
    assert json.loads(report.to_json(show_tokens=True))["user_token_text"] == report.user_token_text


# -- what the attacks see is what the server receives and keeps ----------------------------------

def test_observed_states_and_kv_are_exactly_the_servers(bundles, server, client_half):
    """The audit's hidden states equal the bytes a real turn sends; its K/V equal what the pod stores."""
    recorder = TurnRecorder()
    with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[recorder]) as client:
        session = client.new_session()
        session.chat(PROMPT, SamplingParams(max_new_tokens=1))
    sent = [pb.TurnRequest.FromString(raw) for raw in recorder.turns[0]]
    d = client_half[0].hidden_size
    wire = torch.cat([from_proto(r.step.hidden, d, 1 << 20, "sent") for r in sent if r.WhichOneof("kind") == "step"])

    seen = observe(*client_half, messages())
    assert torch.equal(seen.hidden, wire)

    server_bundle = ServerBundle.open(bundles.server_dir, verify=False)
    keys, values = served_keys_values(server_bundle, seen.hidden)
    config = server_bundle.config
    cache = KVCache(server_bundle.first_layer, server_bundle.num_layers, config.num_key_value_heads,
                    head_dim(config), torch.float32)
    SessionPersistence(open_store(server.settings.store), server_bundle.fingerprint).load(
        session.id, SessionKeys.derive(session.id, session.key), 1, cache)
    stored_keys, stored_values = cache.layer_tensors(0)
    assert stored_keys.shape == keys.shape and cache.length == seen.num_tokens
    torch.testing.assert_close(keys, stored_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, stored_values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode, dtype", [("e4m3", E4M3), ("int8", INT8)])
def test_over_an_8bit_wire_the_observed_states_are_what_its_client_sends(bundles, server, client_half, mode, dtype):
    """The pod sees the hidden states after the wire's rounding: the audit's, for an 8-bit dtype, equal what a
    client on that wire really sends (decoded as the server does), and differ from the float32 wire's."""
    recorder = TurnRecorder()
    with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[recorder],
                wire=mode) as client:
        client.new_session().chat(PROMPT, SamplingParams(max_new_tokens=1))
    sent = [pb.TurnRequest.FromString(raw) for raw in recorder.turns[0]]
    steps = [r.step.hidden for r in sent if r.WhichOneof("kind") == "step"]
    assert {s.dtype for s in steps} == {dtype}
    d = client_half[0].hidden_size
    wire = torch.cat([from_proto(s, d, 1 << 20, "sent") for s in steps])

    seen = observe(*client_half, messages(), wire=dtype)
    assert torch.equal(seen.hidden, wire)
    exact = observe(*client_half, messages()).hidden
    assert not torch.equal(seen.hidden, exact)
    if dtype == INT8:  # half of one of 255 levels of each row's largest element
        assert ((seen.hidden - exact).abs() <= exact.abs().amax(dim=1, keepdim=True) / 254 * 1.001).all()
    else:
        torch.testing.assert_close(seen.hidden, exact, rtol=1 / 16, atol=exact.abs().max().item() / 448)


def test_audit_takes_every_dtype_a_wire_can_carry():
    """`audit --wire-dtype` offers what a client's --wire may send, no more: the 8-bit ones included."""
    from infemeral.cli.main import build_parser
    from infemeral.protocol.tensors import WIRE_NAMES

    audit = next(a for a in build_parser()._subparsers._group_actions[0].choices["audit"]._actions
                 if a.dest == "wire_dtype")
    assert sorted(audit.choices) == sorted(WIRE_NAMES)


# -- each figure can fail --------------------------------------------------------------------------

def test_vocabulary_matching_collapses_with_a_wrong_basis(bundles, client_half):
    model, tokenizer = client_half
    seen = observe(model, tokenizer, messages("My password is Tr0ub4dor&3."))
    basis = ClientBundle.open(bundles.client_dir).basis().double()
    weights = PublicWeights.simulated(model, None, basis)
    tables = VocabularyTables(weights)  # one table (tokens in isolation) serves both runs
    right = match_vocabulary(weights, tables, seen.hidden, basis, context_tokens=0)
    wrong = match_vocabulary(weights, tables, seen.hidden, random_orthogonal(model.hidden_size, b"\7" * 32),
                             context_tokens=0, stages=(16, 256), full_scan=False)
    assert right.num_correct(seen.token_ids) == seen.num_tokens and right.num_verified == seen.num_tokens
    assert wrong.num_correct(seen.token_ids) <= 0.1 * seen.num_tokens
    assert wrong.num_verified == 0


def test_a_public_model_of_another_shape_is_refused_for_any_client_mode(bundles, client_half):
    model, _ = client_half
    basis = ClientBundle.open(bundles.client_dir).basis().double()
    weights = PublicWeights.simulated(model, None, basis)
    int8 = ClientModel(ClientBundle.open(bundles.client_dir), quant="int8")
    weights.check_matches(model)
    weights.check_matches(int8)  # the int8 table's shape, not its bytes
    other = PublicWeights(weights.config, weights.embed[:-1], weights.front, None, None, "a smaller vocabulary")
    with pytest.raises(FailedPrecondition, match="pass the public model the bundles were prepared from"):
        other.check_matches(int8)


def test_gram_linking_auc_drops_to_chance_without_the_real_token_identities(client_half):
    model, tokenizer = client_half
    seen = observe(model, tokenizer, messages())
    again = observe(model, tokenizer, [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]
                    + messages())
    assert link(seen, again).auc_within >= 0.95
    g = torch.Generator().manual_seed(0)
    shuffled = Observation([seen.token_ids[i] for i in torch.randperm(seen.num_tokens, generator=g)],
                           seen.user_positions, seen.hidden)
    assert link(shuffled, again).auc_within < 0.8
    assert auc(torch.tensor([0.1, 0.2, 0.9, 0.8]), torch.tensor([False, False, True, True])) == 1.0
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([False, True])) == 0.5


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["empty", "blank", "stdin-empty", "too-long", "missing-bundle", "server-bundle"])
def test_cli_bad_input_is_one_line_and_exit_code_2(case, bundles, tmp_path, capsys, monkeypatch):
    args = ["audit", "--quiet", "--client-bundle", str(bundles.client_dir)]
    if case == "empty":
        args.append("")
    elif case == "blank":
        args.append("  \n ")
    elif case == "stdin-empty":
        import io

        monkeypatch.setattr("sys.stdin", io.StringIO(""))
        args.append("-")
    elif case == "too-long":
        args.append("word " * 9000)
    elif case == "missing-bundle":
        args = ["audit", "--quiet", "--client-bundle", str(tmp_path / "nowhere"), "hello"]
    elif case == "server-bundle":
        args = ["audit", "--quiet", "--client-bundle", str(bundles.server_dir), "hello"]
    assert cli.main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("infemeral-client: ") and err.count("\n") == 1, err
    expected = {"empty": "empty", "blank": "empty", "stdin-empty": "empty", "too-long": "context",
                "missing-bundle": "not an infemeral bundle", "server-bundle": "server-bundle"}[case]
    assert expected in err


def test_cli_passes_the_prompt_and_prints_json_or_text(report, bundles, capsys, monkeypatch):
    import io

    import infemeral.audit

    calls = []
    monkeypatch.setattr(infemeral.audit, "audit",
                        lambda prompt, bundle, **kw: calls.append((prompt, bundle, kw)) or report)
    monkeypatch.setattr("sys.stdin", io.StringIO("text from stdin"))
    assert cli.main(["audit", "-", "--json", "--quiet", "--client-bundle", str(bundles.client_dir),
                     "--wire-dtype", "bfloat16"]) == 0
    prompt, bundle, kw = calls[-1]
    assert prompt == "text from stdin" and str(bundle) == str(bundles.client_dir)
    assert kw["wire_dtype"] == "bfloat16" and kw["progress"] is False and kw["public_model"] is None
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] and all("recovered_text" not in r for r in printed["rows"])

    assert cli.main(["audit", "--show-tokens", "--quiet", "--client-bundle", str(bundles.client_dir)]) == 0
    assert calls[-1][0] is None  # no prompt: the built-in sample
    out = capsys.readouterr().out
    assert "vocabulary matching" in out and PROMPT in out

"""Starting a server as a new user does: `infemeral-server certs`, TLS mismatches told as such, the warm-up
turn before health says SERVING. A tiny random Llama keeps it cheap."""

from __future__ import annotations

import json
import logging
import socket
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM, LlamaConfig

from infemeral.cli.server_errors import describe
from infemeral.client.server_link import ServerLink
from infemeral.cloak.bundle import ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.errors import Unavailable
from infemeral.server import app
from infemeral.server.app import Server
from infemeral.server.main import main as server_main
from infemeral.server.settings import ServerSettings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return prepare(output=tmp_path_factory.mktemp("tiny"), source=ModelSource(model), progress=False)


def start(tiny, tmp_path, **overrides) -> Server:
    settings = ServerSettings(bundle=tiny.server_dir, listen="127.0.0.1:0", store=str(tmp_path / "store"),
                              device="cpu", dtype="float32", metrics_port=0, **overrides)
    return Server(settings).start()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    assert server_main(["certs", "gpu.example.org", "203.0.113.7", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def tls_server(tiny, certs, tmp_path_factory):
    srv = start(tiny, tmp_path_factory.mktemp("tls"), tls_cert=certs / "server.crt", tls_key=certs / "server.key")
    yield srv
    srv.stop(0)


def test_certs_writes_a_ca_and_a_server_certificate_and_keeps_them(tmp_path, capsys):
    out = tmp_path / "tls"
    assert server_main(["certs", "gpu.example.org", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == {"ca.crt": 0o644, "ca.key": 0o600, "server.crt": 0o644, "server.key": 0o600}
    for flag in (f"--tls-cert {out / 'server.crt'}", f"--tls-key {out / 'server.key'}", f"--tls-ca {out / 'ca.crt'}",
                 "INFEMERAL_TLS_CA", "--server gpu.example.org:50051"):
        assert flag in printed
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert server_main(["certs", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert server_main(["certs", "--out", str(out), "--force"]) == 0
    assert (out / "ca.crt").read_bytes() != before["ca.crt"]


def test_a_client_with_the_ca_talks_to_a_server_with_the_certificate(tls_server, tiny, certs):
    for host in ("localhost", "127.0.0.1"):
        with ServerLink(f"{host}:{tls_server.port}", tiny.client_dir, tls_ca=certs / "ca.crt") as link:
            assert link.server_info().bundle_fingerprint == link.server_fingerprint
    with ServerLink(f"127.0.0.1:{tls_server.port}", tiny.client_dir, tls_ca=certs / "ca.crt",
                    tls_server_name="gpu.example.org") as link:
        assert link.server_info().bundle_fingerprint == link.server_fingerprint


def failure(tiny, address: str, **tls) -> str:
    with ServerLink(address, tiny.client_dir, timeout=5, **tls) as link, pytest.raises(Unavailable) as caught:
        link.server_info()
    return describe(caught.value, address)


@pytest.fixture
def plaintext_port():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(0)


def test_tls_mismatches_say_what_to_change(tls_server, tiny, certs, tmp_path, plaintext_port):
    address = f"127.0.0.1:{tls_server.port}"
    no_ca = failure(tiny, address)
    assert "TLS" in no_ca and "--tls-ca" in no_ca and "INFEMERAL_TLS_CA" in no_ca and "no infemeral-server" not in no_ca
    assert server_main(["certs", "--out", str(tmp_path / "other")]) == 0
    wrong_ca = failure(tiny, address, tls_ca=tmp_path / "other" / "ca.crt")
    assert "not signed by the CA" in wrong_ca and "INFEMERAL_TLS_CA" in wrong_ca
    wrong_name = failure(tiny, address, tls_ca=certs / "ca.crt", tls_server_name="elsewhere.example")
    assert "--tls-server-name" in wrong_name
    not_tls = failure(tiny, f"127.0.0.1:{plaintext_port}", tls_ca=certs / "ca.crt")
    assert "does not speak TLS" in not_tls


def test_health_says_serving_only_after_the_warm_up_turn(tiny, tmp_path, monkeypatch):
    events = []
    real_warm_up, real_set = app.warm_up, health.aio.HealthServicer.set

    def warm_up(engine):
        events.append(("warm_up", engine.stats["forwards"]))
        return real_warm_up(engine)

    async def set_status(self, service, status):
        events.append(("health", health_pb2.HealthCheckResponse.ServingStatus.Name(status)))
        await real_set(self, service, status)

    monkeypatch.setattr(app, "warm_up", warm_up)
    monkeypatch.setattr(health.aio.HealthServicer, "set", set_status)
    srv = start(tiny, tmp_path)
    try:
        assert events[0] == ("warm_up", 0) and events[1:] == [("health", "SERVING")] * 2
        assert srv.engine.stats["forwards"] == 2  # a prefill and a decode step
        assert srv.engine.active_turns == 0 and srv.engine.pool.free_pages == srv.engine.pool.num_pages
    finally:
        srv.stop(0)


@pytest.mark.parametrize("verify", [True, False])
def test_a_server_that_skipped_checking_its_bundle_says_so_and_the_client_warns(verify, tiny, tmp_path, caplog,
                                                                                 capsys):
    """--no-verify-bundle: `info` and a connecting Client (what chat and generate use) each say it in one line."""
    from infemeral.cli.main import main as client_main
    from infemeral.client.client import Client

    srv = start(tiny, tmp_path, verify_bundle=verify)
    address = f"127.0.0.1:{srv.port}"
    try:
        caplog.set_level(logging.WARNING)
        assert client_main(["info", "--json", "--server", address, "--client-bundle", str(tiny.client_dir)]) == 0
        assert json.loads(capsys.readouterr().out)["bundle_unverified"] is (not verify)
        with ServerLink(address, tiny.client_dir) as link:  # a Client's fetch, without the tokenizer tiny lacks
            client = SimpleNamespace(_info=None, link=link, model=SimpleNamespace(hidden_size=srv.engine.hidden_size))
            assert Client.server_info(client).bundle_unverified is (not verify)
            Client.server_info(client)  # fetched once: said once
    finally:
        srv.stop(0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if verify:
        assert warnings == []
    else:
        assert warnings == [f"the server at {address} did not check its bundle's files against their hashes (it was "
                            "started with --no-verify-bundle): it may serve altered layers under the fingerprint it "
                            "reports; restart it without that flag"] * 2


# -- refusals before the model: the flags and the machine, checked before its code is imported -----------------
@pytest.fixture
def model_never_opened(monkeypatch, tmp_path):
    """A bundle directory holding only a config (4 attention heads, 2 KV heads); opening the bundle or serving
    fails the test, so a refusal proves it came first."""
    def opened(*args, **kwargs):
        pytest.fail("the server opened the bundle before refusing")

    monkeypatch.setattr(ServerBundle, "open", opened)
    monkeypatch.setattr(app, "serve_forever", opened)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}))
    return ["--bundle", str(bundle), "--store", str(tmp_path / "store"), "--device", "cpu"]


def test_a_taken_port_is_refused_before_the_model_is_opened(model_never_opened, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert server_main(model_never_opened + ["--listen", f"127.0.0.1:{port}", "--metrics-port", "0"]) == 2
        for_metrics = server_main(model_never_opened + ["--listen", "127.0.0.1:0", "--metrics-port", str(port)])
    err = capsys.readouterr().err
    assert for_metrics == 2
    assert err == (f"infemeral-server: cannot listen on 127.0.0.1:{port}: address already in use\n"
                   f"infemeral-server: cannot listen on the metrics port 127.0.0.1:{port}: address already in use\n")


@pytest.mark.parametrize("flags, gpus, expected", [
    (["--tensor-parallel", "3"], 0, "this model has 4 attention heads and 2 KV heads; use one of: 1, 2"),
    (["--tensor-parallel", "2", "--device", "cuda"], 1, "over 2 ranks needs 2 GPUs; this machine has 1"),
])
def test_a_tensor_parallel_count_that_cannot_serve_is_refused_before_the_model_is_opened(
        model_never_opened, flags, gpus, expected, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    argv = model_never_opened + ["--listen", "127.0.0.1:0", "--metrics-port", "0"] + flags
    assert server_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("infemeral-server: tensor parallelism") and expected in err

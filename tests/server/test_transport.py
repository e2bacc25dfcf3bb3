"""TLS, mutual TLS, API keys, health/reflection through grpcurl, and Prometheus metrics."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, start_server
from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.errors import StatusError

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_new_tokens=4)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert) -> None:
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_ca(directory: Path, name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    _write(directory / name, key, cert)
    return key, cert


def issue(directory: Path, name: str, ca, server: bool):
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    _write(directory / name, key, builder.sign(ca_key, hashes.SHA256()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(d, "ca"), make_ca(d, "other-ca")
    issue(d, "server", ca, server=True)
    issue(d, "client", ca, server=False)
    issue(d, "rogue-client", other, server=False)
    return d


@pytest.fixture(scope="module")
def tls_server(bundles, pki, tmp_path_factory):
    srv = start_server(bundles, tmp_path_factory.mktemp("tls-store"), tls_cert=pki / "server.pem",
                       tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem", api_keys="k-one,k-two",
                       metrics_port=free_port())
    yield srv
    srv.stop(0)


def connect(srv, bundles, pki, **kw) -> Client:
    return Client(f"localhost:{srv.port}", bundles.client_dir, timeout=60, **kw)


def test_mutual_tls_and_api_key_round_trip(tls_server, bundles, pki):
    with connect(tls_server, bundles, pki, tls_ca=pki / "ca.pem", tls_client_cert=pki / "client.pem",
                 tls_client_key=pki / "client.key", api_key="k-two") as client:
        result = client.new_session().chat("Hi!", PARAMS)
        assert result.version == 1 and result.generated_tokens > 0


@pytest.mark.parametrize("case", ["wrong CA", "no client certificate", "client certificate from another CA"])
def test_tls_failures_are_unavailable(tls_server, bundles, pki, case):
    kw = {"tls_ca": pki / "ca.pem", "tls_client_cert": pki / "client.pem", "tls_client_key": pki / "client.key",
          "api_key": "k-one"}
    if case == "wrong CA":
        kw["tls_ca"] = pki / "other-ca.pem"
    elif case == "no client certificate":
        del kw["tls_client_cert"], kw["tls_client_key"]
    else:
        kw["tls_client_cert"], kw["tls_client_key"] = pki / "rogue-client.pem", pki / "rogue-client.key"
    with connect(tls_server, bundles, pki, **kw) as client:
        with pytest.raises(StatusError) as info:
            client.server_info(refresh=True)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("key", [None, "wrong", "k-one-but-longer", ""])
def test_missing_or_wrong_api_key_is_unauthenticated(tls_server, bundles, pki, key):
    with connect(tls_server, bundles, pki, tls_ca=pki / "ca.pem", tls_client_cert=pki / "client.pem",
                 tls_client_key=pki / "client.key", api_key=key) as client:
        with pytest.raises(StatusError) as info:
            client.new_session().chat("Hi!", PARAMS)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in str(info.value)


def test_plaintext_is_refused_off_loopback_unless_allowed(bundles, tmp_path):
    with pytest.raises(ValueError, match="refusing plaintext"):
        start_server(bundles, tmp_path / "s1", listen="0.0.0.0:0")
    srv = start_server(bundles, tmp_path / "s2", listen="0.0.0.0:0", allow_plaintext=True)
    srv.stop(0)


def grpcurl(*args) -> subprocess.CompletedProcess:
    exe = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)


def test_grpcurl_checks_health_and_lists_services(server, tls_server, pki):
    address = f"127.0.0.1:{server.port}"
    listed = grpcurl("-plaintext", address, "list")
    assert listed.returncode == 0, listed.stderr
    assert {"infemeral.v1.Infemeral", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    described = grpcurl("-plaintext", address, "describe", "infemeral.v1.Infemeral")
    assert "rpc Turn ( stream .infemeral.v1.TurnRequest ) returns ( stream .infemeral.v1.TurnResponse )" \
        in described.stdout
    health = grpcurl("-plaintext", address, "grpc.health.v1.Health/Check")
    assert health.returncode == 0 and '"status": "SERVING"' in health.stdout
    # Over mutual TLS with an API key (reflection, like every service but health, needs the key).
    tls = ["-cacert", str(pki / "ca.pem"), "-cert", str(pki / "client.pem"), "-key", str(pki / "client.key")]
    secure = grpcurl(*tls, "-H", "x-api-key: k-one", f"localhost:{tls_server.port}", "grpc.health.v1.Health/Check")
    assert secure.returncode == 0 and '"status": "SERVING"' in secure.stdout, secure.stderr
    denied = grpcurl(*tls, f"localhost:{tls_server.port}", "list")
    assert denied.returncode != 0 and "Unauthenticated" in denied.stderr


def scrape(srv) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            samples[key] = s.value
    return samples


def test_metrics_parse_and_move_after_a_turn(tls_server, bundles, pki):
    before = scrape(tls_server)
    assert before["infemeral_kv_pool_pages"] == tls_server.engine.pool.num_pages
    with connect(tls_server, bundles, pki, tls_ca=pki / "ca.pem", tls_client_cert=pki / "client.pem",
                 tls_client_key=pki / "client.key", api_key="k-one") as client:
        client.new_session().chat("Hello there.", PARAMS)
    after = scrape(tls_server)
    assert after["infemeral_turns_total{outcome=committed}"] == before.get("infemeral_turns_total{outcome=committed}", 0) + 1
    assert after["infemeral_steps_total"] > before.get("infemeral_steps_total", 0)
    assert after["infemeral_tokens_total"] >= before.get("infemeral_tokens_total", 0) + 4
    assert after["infemeral_store_written_bytes_total"] > before.get("infemeral_store_written_bytes_total", 0)
    assert after["infemeral_step_seconds_count"] > before.get("infemeral_step_seconds_count", 0)
    assert after["infemeral_active_turns"] == 0

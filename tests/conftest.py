"""Shared fixtures: the real default model, its bundles, and a real gRPC server on localhost."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infemeral.client.health import wait_until_serving

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def reference():
    """The packaged SmolLM2-135M-Instruct as a plain transformers model (fp32) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infemeral.cloak.sources import default_gguf_path

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


@pytest.fixture(scope="session")
def bundles(reference, tmp_path_factory):
    """Client and server bundles of the default model, prepared once per test run: what `infemeral-client prepare`
    writes (the packaged model's sampling included), from the model `reference` already loaded."""
    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource

    model, tokenizer = reference
    out = tmp_path_factory.mktemp("bundles")
    return prepare(output=out, source=ModelSource(model, tokenizer, "packaged SmolLM2", packaged=True),
                   progress=False)


def start_server(bundles, store: Path, **overrides):
    from infemeral.server.app import Server
    from infemeral.server.settings import ServerSettings

    fields = dict(bundle=bundles.server_dir, listen="127.0.0.1:0", store=str(store), device="cpu", dtype="float32",
                  metrics_port=0)
    settings = ServerSettings(**{**fields, **overrides})
    return Server(settings).start()


@pytest.fixture(scope="session")
def server(bundles, tmp_path_factory):
    """A real in-process gRPC server on a free localhost port, shared by the session."""
    srv = start_server(bundles, tmp_path_factory.mktemp("store"))
    yield srv
    srv.stop(0)


@pytest.fixture(scope="session")
def client(server, bundles):
    from infemeral.client.client import Client

    c = Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on a free localhost port (`make test` installs it when missing)."""
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed; `make test` installs it (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 20
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_client(bundles, redis_url):
    """A real server whose session store is Redis, and a client for it."""
    from infemeral.client.client import Client

    srv = start_server(bundles, redis_url)
    c = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120)
    yield c
    c.close()
    srv.stop(0)


@pytest.fixture(params=["directory", "redis"])
def any_client(request):
    """The same tests against a directory-backed and a Redis-backed server."""
    return request.getfixturevalue("client" if request.param == "directory" else "redis_client")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(bundle_dir: Path, store: Path, port: int, **env_extra) -> subprocess.Popen:
    """`infemeral-server` as a real separate process; returns once it reports SERVING."""
    env = dict(os.environ, INFEMERAL_BUNDLE=str(bundle_dir), INFEMERAL_STORE=str(store),
               INFEMERAL_LISTEN=f"127.0.0.1:{port}", INFEMERAL_DEVICE="cpu", INFEMERAL_DTYPE="float32",
               INFEMERAL_METRICS_PORT="0",
               **{k: str(v) for k, v in env_extra.items()})
    proc = subprocess.Popen([sys.executable, "-m", "infemeral.server.main"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_serving(f"127.0.0.1:{port}", proc)
    return proc


def wait_serving(address: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    try:
        wait_until_serving(address, proc, timeout)
    except RuntimeError:
        raise RuntimeError(f"server exited early:\n{proc.stdout.read()}") from None


class StoredSession:
    """What a directory store holds for one session, read as one snapshot (manifest + chunks)."""

    def __init__(self, store_root, session_id: bytes):
        self.folder = Path(store_root) / session_id.hex()

    def exists(self) -> bool:
        return (self.folder / "manifest").exists()

    def files(self) -> dict[str, bytes]:
        if not self.exists():
            raise FileNotFoundError(self.folder / "manifest")
        return {p.name: p.read_bytes() for p in sorted(self.folder.iterdir())
                if p.name == "manifest" or p.name.startswith("chunk-")}

    def read_bytes(self) -> bytes:
        """All stored bytes of the session, in a canonical order, for before/after comparisons."""
        return b"".join(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data
                        for name, data in self.files().items())

    def restore(self, files: dict[str, bytes]) -> None:
        """Put back exactly `files` (as a backup restore would)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for p in self.folder.iterdir():
            if p.name == "manifest" or p.name.startswith("chunk-"):
                p.unlink()
        for name, data in files.items():
            (self.folder / name).write_bytes(data)

"""The `serve` command: an open address needs a key (and is advised one off the command line), it answers and
deletes its sessions on exit, a taken port is one line before anything loads; its logs carry counts, not
text."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from infemeral.endpoint.serving_models import bundle_model_name

from tests.conftest import free_port
from tests.endpoint.openai_endpoint import MODEL, QUESTION, TOKENS, sdk_answer, stored_sessions

pytestmark = pytest.mark.slow


def test_serve_refuses_an_open_address_without_a_key(capsys):
    from infemeral.cli import main as cli
    from infemeral.endpoint.serve import check_exposure

    assert cli.main(["serve", "--host", "0.0.0.0", "--client-bundle", "/nonexistent"]) == 2
    assert "refusing to serve on 0.0.0.0 without --api-key" in capsys.readouterr().err
    check_exposure("0.0.0.0", "key")
    assert "plain HTTP" in capsys.readouterr().err
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_exposure(host, None)


def test_serve_command_answers_and_deletes_its_sessions_on_exit(server, bundles, client, tmp_path):
    port = free_port()
    stored_before = stored_sessions(server)
    env = dict(os.environ, INFEMERAL_SERVER=f"127.0.0.1:{server.port}", INFEMERAL_CLIENT_BUNDLE=str(bundles.client_dir),
               INFEMERAL_ANSWER_INDEX_DIR=str(tmp_path / "answers"))
    proc = subprocess.Popen([sys.executable, "-m", "infemeral.cli", "serve", "--port", str(port),
                             "--api-key", "k3y", "--max-new-tokens", str(TOKENS)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3y", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                name = api.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
                time.sleep(0.2)
        assert name == bundle_model_name(bundles.client_dir)
        reply = api.chat.completions.create(model=name, messages=QUESTION, temperature=0)  # the bundle samples
        assert reply.choices[0].message.content == sdk_answer(client, QUESTION).text
        assert len(stored_sessions(server) - stored_before) == 1  # the endpoint's session, kept for reuse
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert f"http://127.0.0.1:{port}/v1" in output and "prompt tokens" in output  # counts are logged
    assert QUESTION[0]["content"] not in output and reply.choices[0].message.content not in output  # no text in logs
    assert stored_sessions(server) <= stored_before  # deleted on the way out



def test_endpoint_logs_carry_counts_not_text(endpoint, caplog):
    caplog.set_level(logging.DEBUG)
    secret = "My password is hunter2-swordfish."
    api = endpoint.openai()
    reply = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": secret}], max_tokens=6)
    streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": secret + " Again."}], max_tokens=6, stream=True))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "chat completion:" in text and "prompt tokens" in text
    for payload in ("hunter2", reply.choices[0].message.content.strip()[:12], streamed.strip()[:12]):
        assert payload and payload not in text


def test_serve_on_a_taken_port_is_one_line_before_anything_loads(capsys):
    import socket

    from infemeral.cli import main as cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["serve", "--port", str(port), "--client-bundle", "/nonexistent"])
    assert code == 2
    assert capsys.readouterr().err == (f"infemeral-client: cannot listen on 127.0.0.1:{port}: address already in use "
                                       "(pick another --port)\n")


def test_an_open_address_is_advised_a_key_off_the_command_line(capsys):
    from infemeral.cli import main as cli

    assert cli.main(["serve", "--host", "0.0.0.0", "--client-bundle", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "INFEMERAL_SERVE_API_KEY" in err and "Set --api-key" not in err and err.count("\n") == 1

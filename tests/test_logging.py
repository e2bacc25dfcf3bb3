"""Logs carry sizes and timings only: no keys, no full session ids, no payloads."""

from __future__ import annotations

import logging

import pytest

from infemeral.client.sampling import SamplingParams

pytestmark = pytest.mark.slow


def test_turn_logs_contain_no_secrets(client, caplog):
    caplog.set_level(logging.DEBUG)
    session = client.new_session()
    result = session.chat("My password is hunter2-swordfish.", SamplingParams(max_new_tokens=8))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "turn committed" in text  # the server did log the turn
    for secret in (session.key.hex(), session.id.hex(), "hunter2", result.text.strip()[:12]):
        assert secret and secret not in text
    assert session.key.hex() not in repr(session)

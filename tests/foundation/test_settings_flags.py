"""Flags made from settings classes: one flag per field, list fields repeat, bad values name the flag."""

from __future__ import annotations

import argparse

import pytest

from infemeral.client.settings import ClientSettings
from infemeral.endpoint.settings import ServeSettings
from infemeral.errors import UsageError
from infemeral.settings_flags import add_settings_flags, settings_from_args


def parsed(settings_cls, argv, only=None):
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, settings_cls, only)
    return settings_from_args(settings_cls, parser.parse_args(argv))


def test_a_list_field_takes_its_flag_repeated():
    assert parsed(ClientSettings, ["--stop", "END", "--stop", "\n\n"], ("stop",)).stop == ["END", "\n\n"]


def test_allowed_hosts_repeat_or_take_commas():
    hosts = parsed(ServeSettings, ["--allowed-hosts", "a.example,b.example", "--allowed-hosts", " c.example "],
                   ("allowed_hosts",)).allowed_hosts
    assert hosts == ["a.example", "b.example", "c.example"]


def test_a_bad_value_names_its_flag():
    with pytest.raises(UsageError, match="--port"):
        parsed(ServeSettings, ["--port", "70000"], ("port",))

"""The server's settings take their defaults from the config dataclasses, so the two cannot drift apart."""

from __future__ import annotations

from dataclasses import MISSING, fields

from infemeral.kvcache.window import WindowPolicy
from infemeral.server.config import EngineConfig, ServiceLimits
from infemeral.server.settings import ServerSettings

# settings whose config field has another name
RENAMED = {"workers": (ServiceLimits, "delete_threads"), "window": (WindowPolicy, "enabled")}


def declared_defaults(cls) -> dict[str, object]:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def test_every_setting_with_a_config_field_has_its_default():
    config_defaults = {**declared_defaults(WindowPolicy), "max_context": EngineConfig().window.max_context,
                       **declared_defaults(ServiceLimits), **declared_defaults(EngineConfig)}
    config_defaults.update({name: declared_defaults(cls)[field] for name, (cls, field) in RENAMED.items()})
    compared = {name: (setting.default, config_defaults[name])
                for name, setting in ServerSettings.model_fields.items() if name in config_defaults}
    assert {"max_streams", "kv_pool_share_per_key", "max_sessions_per_peer", "max_sessions", "workers",
            "max_context", "sink_tokens"} <= compared.keys()
    differing = {name: pair for name, pair in compared.items() if pair[0] != pair[1]}
    assert not differing, f"setting default != config default: {differing}"

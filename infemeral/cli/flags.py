"""Command-line flags generated from a settings class, so flags, env vars and docs never drift."""

from __future__ import annotations

import argparse
import typing

from pydantic_settings import BaseSettings


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type[BaseSettings],
                       only: tuple[str, ...] | None = None) -> None:
    prefix = settings_cls.model_config.get("env_prefix", "")
    for name, field in settings_cls.model_fields.items():
        if only is not None and name not in only:
            continue
        flag = "--" + name.replace("_", "-")
        env = (prefix + name).upper()
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description} (env {env}; default: {default})"
        if name == "stop":
            parser.add_argument(flag, dest=name, default=None, action="append", help=help_text)
        elif field.annotation is bool:
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        elif typing.get_origin(field.annotation) is typing.Literal:
            parser.add_argument(flag, dest=name, default=None, choices=typing.get_args(field.annotation),
                                help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text)


def settings_from_args(settings_cls: type[BaseSettings], args: argparse.Namespace):
    """Flags override INFEMERAL_* variables, which override defaults."""
    given = {k: v for k, v in vars(args).items() if k in settings_cls.model_fields and v is not None}
    return settings_cls(**given)

"""Command-line flags generated from a settings class, so flags, env vars and docs never drift."""

from __future__ import annotations

import argparse
import typing

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from infemeral.errors import UsageError


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type[BaseSettings],
                       only: tuple[str, ...] | None = None, shown_defaults: dict[str, str] | None = None) -> None:
    """A flag for every field (or those in `only`); `shown_defaults` says in the help where a command's default
    is not the field's."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    for name, field in settings_cls.model_fields.items():
        if only is not None and name not in only:
            continue
        flag = "--" + name.replace("_", "-")
        env = (prefix + name).upper()
        default = (shown_defaults or {}).get(name, field.get_default(call_default_factory=True))
        help_text = f"{field.description} (env {env}; default: {default})"
        if typing.get_origin(field.annotation) is list:  # repeat the flag for several values
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
    try:
        return settings_cls(**given)
    except ValidationError as e:
        raise UsageError(describe_invalid(e, settings_cls, given)) from None


def describe_invalid(error: ValidationError, settings_cls: type[BaseSettings], given: dict) -> str:
    """pydantic's report as one line a person can act on: the flag (or the INFEMERAL_* variable, if the value
    came from there), what it must be, and what it got."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    problems = []
    for e in error.errors():
        name = str(e["loc"][0]) if e["loc"] else ""
        where = ("--" + name.replace("_", "-") if name in given else (prefix + name).upper()) if name else ""
        what = e["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        got = f" (got {e['input']})" if name and not isinstance(e.get("input"), dict) else ""
        problems.append(f"{where} {what}{got}".strip())
    return "; ".join(problems)

"""The settings of `infemeral-client serve`, from flags and INFEMERAL_SERVE_* environment variables."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class ServeSettings(BaseSettings):
    """The OpenAI-compatible endpoint on the laptop (`infemeral-client serve`); INFEMERAL_SERVE_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="INFEMERAL_SERVE_", extra="ignore")

    host: str = Field("127.0.0.1", description="address to listen on; anything but loopback needs --api-key")
    port: int = Field(8080, ge=0, le=65535, description="HTTP port")
    api_key: str | None = Field(None, description="key HTTP clients must send as 'Authorization: Bearer KEY'")
    model_name: str | None = Field(None, description="model name the endpoint answers to (default: the client "
                                                     "bundle's directory name)")
    max_sessions: int = Field(8, ge=1, description="live sessions kept for reuse; the least recently used "
                                                   "beyond this are deleted on the server")
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="host names requests may be addressed to besides localhost, 127.0.0.0/8 and ::1, comma-separated "
                    "('*': any; '*.example.com': its subdomains); a non-loopback --host is always allowed. Stops a "
                    "web page from reaching the endpoint by DNS rebinding")
    max_body_bytes: int = Field(4 * 2**20, ge=1, description="largest request body accepted (bytes); a larger one is "
                                                             "answered 413 and never read whole")
    open: bool = Field(False, description="open the chat page (http://HOST:PORT/) in the default web browser once "
                                          "the endpoint listens")

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value):
        if isinstance(value, str):
            value = [value]
        return [h.strip() for item in value for h in item.split(",") if h.strip()]  # flags repeat or list with commas

"""GET /v1/models: the one model this endpoint serves, named after the client bundle."""

from __future__ import annotations

from pathlib import Path

from infemeral.endpoint.responses import model_card, model_list, now
from infemeral.endpoint.schema import RequestError


def bundle_model_name(client_bundle: str | Path) -> str:
    """The model's name: the client bundle's directory, or its parent's when it is the `client` half that
    `prepare` writes (~/bundles/qwen7b/client -> qwen7b)."""
    path = Path(client_bundle).expanduser().resolve()
    return path.parent.name if path.name == "client" and path.parent.name else path.name


class ServingModels:
    def __init__(self, name: str):
        self.name, self.created = name, now()

    def check(self, name: str) -> None:
        """Refuse a request for any other model (404, as OpenAI does)."""
        if name != self.name:
            raise RequestError(404, f"The model `{name}` does not exist: this endpoint serves `{self.name}`.",
                               param="model", code="model_not_found")

    def list(self) -> dict:
        return model_list(self.name, self.created)

    def card(self, name: str) -> dict:
        self.check(name)
        return model_card(self.name, self.created)

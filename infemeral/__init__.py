"""infemeral: private split inference for large language models.

The client keeps everything that touches text (tokenizer, embeddings, the first
decoder layer, final norm, LM head, sampling); the server runs the remaining
layers on hidden states in a secret basis and stores the conversation's KV
cache only as ciphertext under a key the client holds.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Client", "Session", "SamplingParams", "UploadProgress", "prepare", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import infemeral` stays cheap (torch and transformers load on use).
    if name == "Client":
        from infemeral.client.client import Client

        return Client
    if name == "Session":
        from infemeral.client.session import Session

        return Session
    if name == "SamplingParams":
        from infemeral.client.sampling import SamplingParams

        return SamplingParams
    if name == "UploadProgress":
        from infemeral.client.upload import UploadProgress

        return UploadProgress
    if name == "prepare":
        from infemeral.cloak.prepare import prepare

        return prepare
    raise AttributeError(name)

"""A bundle's manifest.json: its format, version and fingerprints, read without torch or transformers.

Commands that only need to know which bundle they hold (`infemeral-client info`, `delete`) read this
and nothing else, so they answer without loading the model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from infemeral.errors import FailedPrecondition

SERVER_FORMAT = "infemeral-server-bundle"
CLIENT_FORMAT = "infemeral-client-bundle"
FORMAT_VERSION = 1
QUANTIZED_FORMAT_VERSION = 2  # server bundles whose layers are quantised (manifest["server_quant"])


def fingerprint(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "fingerprint"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(directory: Path, expected_format: str, versions: tuple[int, ...] = (FORMAT_VERSION,)) -> dict:
    path = directory / "manifest.json"
    if not path.exists():
        raise FailedPrecondition(f"{directory} is not an infemeral bundle (no manifest.json); run `infemeral-client prepare`")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != expected_format:
        raise FailedPrecondition(f"{directory} holds a {manifest.get('format')!r}, expected a {expected_format!r}")
    if manifest.get("format_version") not in versions:
        raise FailedPrecondition(
            f"{directory} has bundle format version {manifest.get('format_version')}, this version of infemeral "
            f"reads version {' or '.join(map(str, versions))}; prepare the bundles again")
    return manifest


def client_manifest(directory: str | Path) -> dict:
    """The manifest of the client bundle in `directory` (its `server_fingerprint` names the server bundle it
    matches)."""
    return read_manifest(Path(directory).expanduser(), CLIENT_FORMAT)

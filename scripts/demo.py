"""`make demo`: prepare the default bundles (once), start a real server on localhost,
stream a real answer through it with the real CLI, report speed, stop the server.

The bundles go where `infemeral-client prepare` puts them and every command looks
by default (~/.local/share/infemeral/bundles/default), so the commands the demo
prints at the end (README, "Run it locally") work as they are, without preparing
again; the answer index goes beside them, as for any `generate`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from infemeral.client.health import wait_until_serving
from infemeral.paths import DATA_HOME

BUNDLES = DATA_HOME / "bundles" / "default"  # the default of every command
QUESTION = os.environ.get("DEMO_QUESTION", "What are three good reasons to learn to cook at home?")
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    halves = [(BUNDLES / half / "manifest.json").exists() for half in ("server", "client")]
    if not all(halves):
        # half a pair (a prepare cut short) is of no use, and prepare refuses to replace it without --force
        force = ["--force"] if any(halves) else []
        print(f"==> infemeral-client prepare {' '.join(force)}  # the packaged model, once, into {shown(BUNDLES)}",
              flush=True)
        subprocess.run([BIN / "infemeral-client", "prepare", *force], check=True)
    else:
        source = json.loads((BUNDLES / "client" / "manifest.json").read_text()).get("source", "?")
        print(f"==> using the bundles in {shown(BUNDLES)} (prepared from {Path(source).name})", flush=True)

    port = free_port()
    address = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="infemeral-demo-store-") as store:
        env = dict(os.environ, INFEMERAL_BUNDLE=str(BUNDLES / "server"), INFEMERAL_STORE=store,
                   INFEMERAL_LISTEN=address, INFEMERAL_METRICS_PORT="0")
        print(f"==> starting infemeral-server on {address}", flush=True)
        server = subprocess.Popen([BIN / "infemeral-server", "--log-level", "WARNING"], env=env)
        try:
            wait_until_serving(address, server, timeout=180)
            print(f"==> infemeral-client generate {QUESTION!r}\n", flush=True)
            rc = subprocess.run([BIN / "infemeral-client", "generate", QUESTION, "--server", address,
                                 "--client-bundle", BUNDLES / "client", "--max-new-tokens", "160", "--verbose"],
                                env=env).returncode
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
        print(f"\n==> server stopped (exit code {server.returncode})")
    if rc == 0:
        print(NEXT_STEPS.format(activate=shown(BIN / "activate")))
    return rc


NEXT_STEPS = """
==> next, with the same bundles (README, "Run it locally"):
      . {activate}
      infemeral-server                 # in one terminal: serves on 127.0.0.1:50051 until Ctrl-C
      infemeral-client chat            # in another: Ctrl-D quits
      infemeral-client serve           # or an OpenAI-compatible API on http://127.0.0.1:8080/v1"""


def shown(path: Path) -> str:
    """`path` as a person would type it: relative to the checkout or to ~ where it lies under one."""
    for base, prefix in ((Path.cwd(), ""), (Path.home(), "~/")):
        try:
            return prefix + str(path.relative_to(base))
        except ValueError:
            pass
    return str(path)


if __name__ == "__main__":
    sys.exit(main())

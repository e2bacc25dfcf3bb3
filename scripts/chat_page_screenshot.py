"""Regenerate docs/chat_page.png, README's screenshot of the chat page.

    .venv/bin/python scripts/chat_page_screenshot.py [--output docs/chat_page.png]

What it shows: the page as `infemeral-client serve` serves it, in front of a real in-process pod serving the
packaged default model (bundles prepared afresh in a temporary directory, the pod on CPU in float32): a
conversation of two greedy turns, so the text is the same on every run, each answer with its figures, the
header's Fork button and the Edit buttons on your messages, and the panel of what the pod sees with the audit
of the first message. The window is 1280x860 in headless Chromium (the distribution's `chromium` and
`chromium-driver`, `make system-deps`) driven by selenium, as tests/endpoint/test_chat_browser.py drives it;
the server, endpoint and browser helpers are the tests' own. Takes a few minutes on a CPU. The figures
(speeds, bytes), the port and the conversation's name differ from run to run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

from infemeral.client.client import Client  # noqa: E402
from infemeral.client.sampling import SamplingParams  # noqa: E402
from infemeral.client.session_store import SessionStore  # noqa: E402
from infemeral.cloak.prepare import prepare  # noqa: E402
from infemeral.endpoint.app import create_app  # noqa: E402
from infemeral.endpoint.conversations import Conversations  # noqa: E402
from infemeral.endpoint.serving_models import bundle_model_name  # noqa: E402
from infemeral.endpoint.session_pool import SessionPool  # noqa: E402
from infemeral.endpoint.wire_meter import WireMeter  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.endpoint.test_chat_browser import ask, finished, wait  # noqa: E402
from tests.support.http_endpoint import Uvicorn  # noqa: E402

WINDOW = (1280, 860)
QUESTIONS = ("What is the capital of France?", "What is it famous for?")
TOKENS = 64
AUDIT_SECONDS = 600


def browser() -> webdriver.Chrome:
    chromedriver = shutil.which("chromedriver")
    if chromedriver is None:
        sys.exit("needs chromium and chromium-driver: make system-deps")
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--hide-scrollbars", f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(chromedriver))
    # the window's size includes what headless Chromium keeps of a window's frame: fix the page's own instead
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           dict(width=WINDOW[0], height=WINDOW[1], deviceScaleFactor=1, mobile=False))
    return driver


def converse(page) -> None:
    """The two turns, greedy, then the audit of the first message, with the settings panel folded away so the
    pod's panel shows."""
    driver = page.driver
    for question in QUESTIONS:
        finished(page, ask(page, question, max_tokens=TOKENS))
    wait(page, lambda d: d.find_element(By.ID, "fork").is_displayed() and d.find_element(By.ID, "fork").is_enabled())
    driver.execute_script("document.getElementById('settings').open = false")
    driver.find_element(By.ID, "audit").click()
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#audit-result .hint"), timeout=AUDIT_SECONDS)
    driver.execute_script("document.getElementById('panels').scrollTop = 0")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "chat_page.png")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="infemeral-screenshot-") as tmp:
        work = Path(tmp)
        print("preparing the default model's bundles ...", flush=True)
        bundles = prepare(None, work / "default", progress=False)
        server = start_server(bundles, work / "store")
        client = Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[WireMeter()])
        pool = SessionPool(client, max_sessions=2)
        conversations = Conversations(SessionStore(work / "sessions", client.bundle.server_fingerprint), pool)
        app = create_app(pool, bundle_model_name(bundles.client_dir), defaults=SamplingParams(max_new_tokens=TOKENS),
                         conversations=conversations)
        http = Uvicorn(app)
        driver = browser()
        try:
            page = type("Page", (), dict(driver=driver))
            driver.get(f"http://127.0.0.1:{http.port}/")
            print("asking, then auditing the first message ...", flush=True)
            converse(page)
            driver.save_screenshot(str(args.output))
        finally:
            driver.quit()
            http.stop()
            client.close()
            server.stop(0)
    print(f"wrote {args.output} ({args.output.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The chat page in a real browser: headless Chromium (the distribution's `chromium` and `chromium-driver`,
`make system-deps`) driven by selenium, against an endpoint in front of the shared real server. One browser
and one endpoint for the module; the tests run in order, on one conversation."""

from __future__ import annotations

import shutil
import time

import pytest

from tests.support.http_endpoint import Uvicorn
from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.client.session_store import SessionStore
from infemeral.endpoint.app import create_app
from infemeral.endpoint.conversations import Conversations
from infemeral.endpoint.session_pool import SessionPool
from infemeral.endpoint.wire_meter import WireMeter
from tests.endpoint.openai_endpoint import TurnLog, stored_sessions

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not shutil.which("chromedriver"), reason="needs chromium-driver: make system-deps")]

QUESTION = "What is the capital of France?"
TOKENS = 12


@pytest.fixture(scope="module")
def page(server, bundles, tmp_path_factory):
    log = TurnLog()
    client = Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[log, WireMeter()])
    pool = SessionPool(client, max_sessions=2)
    store = SessionStore(tmp_path_factory.mktemp("sessions"), client.bundle.server_fingerprint)
    app = create_app(pool, "page-model", defaults=SamplingParams(max_new_tokens=TOKENS),
                     conversations=Conversations(store, pool))
    http = Uvicorn(app)
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    driver.get(f"http://127.0.0.1:{http.port}/")
    yield type("Page", (), dict(driver=driver, client=client, pool=pool, store=store, app=app, log=log,
                                 url=f"http://127.0.0.1:{http.port}/"))
    driver.quit()
    http.stop()
    client.close()


def wait(page, condition, timeout: float = 60):
    return WebDriverWait(page.driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def ask(page, text: str, *, max_tokens: int = TOKENS, temperature: str = "0"):
    driver = page.driver
    for field, value in (("temperature", temperature), ("max-tokens", str(max_tokens))):
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()
    return wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[before:])[0]


def finished(page, node):
    wait(page, lambda d: "streaming" not in node.get_attribute("class"))
    return node


def words(text: str) -> str:
    return " ".join(text.split())


def test_a_typed_message_streams_the_greedy_answer(page, client):
    expected = client.generate(QUESTION, SamplingParams(max_new_tokens=TOKENS))
    node = finished(page, ask(page, QUESTION))
    assert words(node.find_element(By.CSS_SELECTOR, ".content").text) == words(expected.text)
    figures = node.find_element(By.CSS_SELECTOR, ".figures").text
    assert "tokens/s" in figures and "tokens per round trip" in figures and "KiB sent" in figures
    name = page.driver.find_element(By.ID, "conversation-name").text
    assert page.store.messages(name)[-1] == {"role": "assistant", "content": expected.text}  # saved
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, f'#conversations li[data-name="{name}"]'))
    assert "sent" in page.driver.find_element(By.ID, "pod-bytes").text


def test_stop_ends_the_turn_on_the_pod_and_keeps_nothing(page):
    name = page.driver.find_element(By.ID, "conversation-name").text
    saved = page.store.messages(name)
    turns = len(page.log.turns)
    node = ask(page, "Write a long story about the sea.", max_tokens=400)
    wait(page, lambda d: len(node.find_element(By.CSS_SELECTOR, ".content").text) > 5)
    page.driver.find_element(By.ID, "stop").click()
    wait(page, lambda d: "stopped" in node.get_attribute("class"))
    deadline = time.monotonic() + 30
    while page.log.turns[turns]["ended"] is None or page.pool.num_busy:
        assert time.monotonic() < deadline, "the turn went on after the page stopped it"
        time.sleep(0.05)
    kinds = [r.WhichOneof("kind") for r in page.log.turns[turns]["requests"]]
    assert "commit" not in kinds and kinds.count("step") < 300  # stopped early, nothing committed
    assert page.store.messages(name) == saved


def test_a_reloaded_page_resumes_the_conversation_on_its_session(page):
    driver = page.driver
    name = driver.find_element(By.ID, "conversation-name").text
    page.pool.forget(name)  # as after a restart of the endpoint: the session comes back from its file
    driver.refresh()
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, f'#conversations li[data-name="{name}"] .open'))[0].click()
    wait(page, lambda d: d.find_element(By.ID, "conversation-name").text == name)
    shown = [words(n.text) for n in driver.find_elements(By.CSS_SELECTOR, ".msg .content")]
    assert shown == [words(m["content"]) for m in page.store.messages(name)]
    turns = len(page.log.turns)
    finished(page, ask(page, "And of Italy?"))
    opened = page.log.turns[turns]["requests"][0].open
    first = page.log.turns[0]["requests"][0].open
    assert opened.session_id == first.session_id and opened.expected_version == 1  # the same session, continued
    assert len(page.store.messages(name)) == 4


def turn_of(page, since: int):
    """The OpenTurn of the turn opened at `since`, and how many tokens its prompt's first step found cached."""
    requests = page.log.turns[since]["requests"]
    return requests[0].open, next(r.step for r in requests if r.WhichOneof("kind") == "step").cache_length


def test_a_forked_conversation_goes_on_from_a_copy_made_on_the_pod(page):
    """Fork copies the conversation on the pod: both are listed, the copy goes on without uploading what it holds,
    and the original stays as it was; editing an earlier message forks at that turn."""
    driver = page.driver
    name = driver.find_element(By.ID, "conversation-name").text
    saved = page.store.path(name).read_bytes()
    original = page.log.turns[0]["requests"][0].open.session_id
    fork_button = wait(page, lambda d: d.find_element(By.ID, "fork").is_displayed() and d.find_element(By.ID, "fork"))
    fork_button.click()
    wait(page, lambda d: d.find_element(By.ID, "conversation-name").text != name)
    fork = driver.find_element(By.ID, "conversation-name").text
    wait(page, lambda d: all(d.find_elements(By.CSS_SELECTOR, f'#conversations li[data-name="{n}"]')
                             for n in (name, fork)))
    assert page.store.messages(fork) == page.store.messages(name)
    turns = len(page.log.turns)
    finished(page, ask(page, "And of Spain?"))
    opened, cached = turn_of(page, turns)
    assert opened.session_id != original and opened.expected_version == 1 and cached > 0  # the copy, not uploaded
    assert len(page.store.messages(fork)) == 6 and page.store.path(name).read_bytes() == saved
    turns = len(page.log.turns)
    driver.find_elements(By.CSS_SELECTOR, ".msg.user .edit")[1].click()  # "And of Italy?", in turn 2
    alert = driver.switch_to.alert
    alert.send_keys("And of Germany?")
    alert.accept()
    wait(page, lambda d: d.find_element(By.ID, "conversation-name").text not in (name, fork))
    edited = driver.find_element(By.ID, "conversation-name").text
    finished(page, wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[1:])[0])
    opened, cached = turn_of(page, turns)
    assert opened.session_id != original and opened.expected_version == 1 and cached > 0
    assert page.store.messages(edited)[:3] == page.store.messages(name)[:2] + [{"role": "user",
                                                                                "content": "And of Germany?"}]
    assert len(page.store.messages(edited)) == 4 and len(page.store.messages(fork)) == 6
    driver.find_element(By.CSS_SELECTOR, f'#conversations li[data-name="{name}"] .open').click()
    wait(page, lambda d: d.find_element(By.ID, "conversation-name").text == name)


def test_deleting_the_conversation_deletes_it_here_and_on_the_pod(page, server):
    driver = page.driver
    name = driver.find_element(By.ID, "conversation-name").text
    session_id = page.log.turns[0]["requests"][0].open.session_id.hex()
    assert session_id in stored_sessions(server)
    driver.find_element(By.CSS_SELECTOR, f'#conversations li[data-name="{name}"] .delete').click()
    driver.switch_to.alert.accept()
    wait(page, lambda d: not d.find_elements(By.CSS_SELECTOR, f'#conversations li[data-name="{name}"]'))
    assert not page.store.exists(name) and session_id not in stored_sessions(server)
    assert driver.find_element(By.ID, "conversation-name").text == "new chat"


def test_a_reply_with_markup_renders_as_text(page, monkeypatch):
    reply = ('<script>window.pwned = 1</script> <img src=x onerror="window.pwned = 2"> **bold** '
             '`<b>code</b>`\n```\n<iframe src="/"></iframe>\n```')
    chat = page.app.state.chat
    prompt = chat.prompt

    def markup(body, params):  # the model's answer stubbed where the endpoint streams it
        ids, start, echo = prompt(body, params)

        def answer(session):
            for _ in start(session):
                pass
            yield reply

        return ids, answer, echo

    monkeypatch.setattr(chat, "prompt", markup)
    node = finished(page, ask(page, "Say something."))
    content = node.find_element(By.CSS_SELECTOR, ".content")
    assert content.find_elements(By.TAG_NAME, "script") == content.find_elements(By.TAG_NAME, "img") == []
    assert content.find_elements(By.TAG_NAME, "iframe") == []
    assert "<script>window.pwned = 1</script>" in content.text and '<img src=x onerror="window.pwned = 2">' in content.text
    assert content.find_element(By.TAG_NAME, "strong").text == "bold"
    assert [c.text for c in content.find_elements(By.TAG_NAME, "code")] == ["<b>code</b>", '<iframe src="/"></iframe>']
    assert page.driver.execute_script("return window.pwned === undefined")


def test_lists_keep_their_items_together_and_their_numbers(page):
    """A model's numbered list often has blank lines between its items: still one list, numbered as the model
    numbered it; a list of another kind, or a paragraph, ends it."""
    render = lambda text: page.driver.execute_script("return renderMarkdown(arguments[0])", text)  # noqa: E731
    assert render("1. Eiffel Tower\n\n2. Louvre\n\n3. Notre Dame") == (
        "<ol><li>Eiffel Tower</li><li>Louvre</li><li>Notre Dame</li></ol>")
    assert render("3. third\n4. fourth") == '<ol start="3"><li>third</li><li>fourth</li></ol>'
    assert render("- a\n\n- b\n\n1. one\n\nAfter.\n\n- c") == (
        "<ul><li>a</li><li>b</li></ul><ol><li>one</li></ol><p>After.</p><ul><li>c</li></ul>")
    assert render("- a\n\n") == "<ul><li>a</li></ul>"

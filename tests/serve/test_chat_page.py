"""The chat page at / of `zlc serve` (runtime/serve/ingress/chat.html). Fast: its HTTP answer (HTML, a CSP
that allows this server only, nothing to load from elsewhere). Slow: the page in a real headless
browser (Debian's chromium driven by playwright) against a real server on loopback: the model's
name from /v1/models, an answer streamed into the page equal to the same request's greedy answer
through the OpenAI SDK, a second turn with the conversation, tokens/s, stop, clear, escaping, and
a server with an API key."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import get, openai_client

MODEL = "llama-chat"
MAX_TOKENS = 16
CHROMIUM = shutil.which("chromium")  # Debian's package; playwright's own browser download is not used


def test_the_page_is_served_at_root(server: Any) -> None:
    status, page = get(server, "/")
    assert status == 200 and page.startswith("<!doctype html>")
    assert "://" not in page  # no CDN, no absolute URL: it works offline, from this server only
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/?from=bookmark", timeout=10) as r:
        assert r.headers["content-type"] == "text/html; charset=utf-8"
        csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp


def test_the_wheel_ships_the_page() -> None:
    """chat.html is package data (an installed server reads it from the package, not the checkout)."""
    import tomllib

    setuptools = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "chat.html" in setuptools["package-data"]["zlc.runtime.serve.ingress"]


# --------------------------------------------------------------------------------------------------
# in a real browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (test extra)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)  # headless, no sandbox (CI runs as root)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context()
    yield context.new_page()
    context.close()


def ask(page: Any, text: str, max_tokens: int = MAX_TOKENS, temperature: float = 0.0) -> Any:
    """Types `text` and sends it with Enter; returns the answer's element once it has finished."""
    page.fill("#temperature", str(temperature))
    page.fill("#max-tokens", str(max_tokens))
    n = page.locator(".msg.assistant").count() + 1
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_function(f"() => document.querySelectorAll('.msg.assistant').length === {n} "
                           "&& !document.getElementById('send').disabled", timeout=60_000)
    return page.locator(".msg.assistant").nth(n - 1)


def sdk_answer(server: Any, messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> str:
    r = openai_client(server).chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                      temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content or ""


def count_updates(page: Any) -> None:
    """Counts, in the page, the changes of the newest answer's text (one per streamed delta)."""
    page.evaluate("""() => { window.updates = 0;
        new MutationObserver(() => window.updates++).observe(document.getElementById('log'),
                                                             {subtree: true, childList: true}); }""")


@pytest.mark.slow
def test_streamed_answers_equal_the_sdks(server: Any, page: Any) -> None:
    page.goto(server.base_url + "/")
    page.wait_for_function(f"() => document.getElementById('model').textContent === '{MODEL}'")
    count_updates(page)
    first = ask(page, "Hello there")
    expected = sdk_answer(server, [{"role": "user", "content": "Hello there"}])
    assert expected and first.text_content() == expected
    assert page.evaluate("window.updates") > 3  # two new bubbles, then the deltas one by one
    speed = page.text_content("#speed") or ""
    m = re.fullmatch(r"(\d+) tokens, (\d+\.\d) tokens/s", speed)
    assert m and 0 < int(m[1]) <= MAX_TOKENS and float(m[2]) > 0, speed
    # a second turn is answered with the conversation so far
    second = ask(page, "And then?")
    assert second.text_content() == sdk_answer(server, [{"role": "user", "content": "Hello there"},
                                                        {"role": "assistant", "content": expected},
                                                        {"role": "user", "content": "And then?"}])
    # clear: the log empties and the next question starts a new conversation
    page.click("#clear")
    assert page.locator(".msg").count() == 0 and page.text_content("#speed") == ""
    again = ask(page, "<b>Hi</b> & bye")
    assert again.text_content() == sdk_answer(server, [{"role": "user", "content": "<b>Hi</b> & bye"}])
    user = page.locator(".msg.user").first
    assert user.text_content() == "<b>Hi</b> & bye"  # shown as text, never parsed as markup
    assert page.locator(".msg b").count() == 0


@pytest.mark.slow
def test_stop_keeps_the_partial_answer(server: Any, page: Any) -> None:
    """Downloads throttled in the browser (DevTools network emulation), so the answer is still
    arriving when Stop is clicked."""
    page.goto(server.base_url + "/")
    page.wait_for_function(f"() => document.getElementById('model').textContent === '{MODEL}'")
    full = sdk_answer(server, [{"role": "user", "content": "Hello there"}], max_tokens=60)
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": 400,
                                                  "uploadThroughput": -1})
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "60")
    page.fill("#prompt", "Hello there")
    page.click("#send")
    page.wait_for_function("() => document.querySelector('.msg.assistant').textContent.length > 0",
                           timeout=60_000)
    page.click("#stop")
    page.wait_for_function("() => !document.getElementById('send').disabled")
    answer = page.locator(".msg.assistant")
    partial = answer.text_content() or ""
    assert "stopped" in (answer.get_attribute("class") or "")
    assert partial and full.startswith(partial) and len(partial) < len(full)
    assert page.is_disabled("#stop")


@pytest.mark.slow
def test_a_server_with_a_key_asks_for_it(start_server: Any, page: Any) -> None:
    s = start_server("--device", "reference", "--api-key", "page-key")
    page.goto(s.base_url + "/")  # the page itself needs no key
    page.wait_for_selector("#key-label", state="visible")
    page.fill("#key", "page-key")
    page.dispatch_event("#key", "change")
    page.wait_for_function(f"() => document.getElementById('model').textContent === '{MODEL}'")
    answer = ask(page, "Hello there")
    r = openai_client(s, key="page-key").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], temperature=0, max_tokens=MAX_TOKENS)
    assert answer.text_content() == r.choices[0].message.content

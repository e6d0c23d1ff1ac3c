"""The gateway's web chat page (`/`) in headless Chromium, driven by Selenium.

Usage: BATON_URL=http://127.0.0.1:PORT BATON_API_KEY=bk-... python3 test_web_page.py
Optional: BATON_CHROMIUM (default /usr/bin/chromium), BATON_CHROMEDRIVER
(default /usr/bin/chromedriver). Run by tests/gateway/gateway_browser.rs,
which starts the gateway.

Checks, as a user would do them: a wrong key is refused and the right one
opens the chat; a message gets a reply that streams in (its text is seen
growing while the stop button is live); the conversation is listed; Stop ends
a second reply as `[stopped]` (and the store agrees); a reload keeps the key
and reopens the conversation; Delete removes it from the page and from
GET /v1/conversations. Any SEVERE browser console entry fails the test.
Exits 0 and prints `web page: ok` when every check passes.
"""
import json
import os
import sys
import time
import urllib.error
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

BASE = os.environ["BATON_URL"].rstrip("/")
KEY = os.environ["BATON_API_KEY"]
# The CPU model is slow, and the machine may be busy.
LONG = 120
FIRST = "Tell me about the sea."
SECOND = "Write a long story about a dragon who learns to sing."

T0 = time.monotonic()


def step(msg):
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def http(method, path, key=KEY):
    req = urllib.request.Request(BASE + path, method=method, headers={"authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def conversations():
    status, body = http("GET", "/v1/conversations")
    assert status == 200, (status, body)
    return body["data"]


def browser():
    opts = Options()
    opts.binary_location = os.environ.get("BATON_CHROMIUM", "/usr/bin/chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=os.environ.get("BATON_CHROMEDRIVER", "/usr/bin/chromedriver"))
    return webdriver.Chrome(service=service, options=opts)


def severe(entries):
    return [e for e in entries if e.get("level") == "SEVERE"]


# One script call, so the text and the button are read at the same moment.
LAST_REPLY = """
const bots = document.querySelectorAll('#log .msg.bot');
const last = bots.length ? bots[bots.length - 1].textContent : null;
return [bots.length, last, document.getElementById('stop').disabled];
"""


def texts(driver, selector):
    """textContent of each match (Selenium's .text trims and folds whitespace)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), e => e.textContent)", selector)


def send(driver, text):
    box = driver.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def watch_reply(driver, bots_before, on_first_text=None):
    """Polls the newest reply until the stream ends (Stop disabled again).

    Returns (final text, distinct non-empty texts seen while Stop was enabled).
    """
    seen = []
    deadline = time.monotonic() + LONG
    started = False
    clicked = False
    while time.monotonic() < deadline:
        n, text, stop_disabled = driver.execute_script(LAST_REPLY)
        if n > bots_before:
            if not stop_disabled:
                started = True
                if text and (not seen or seen[-1] != text):
                    seen.append(text)
                if text and on_first_text and not clicked:
                    on_first_text()
                    clicked = True
            elif started or text:
                return text, seen
        time.sleep(0.03)
    raise AssertionError(f"reply did not finish within {LONG}s; seen {len(seen)} states, last {seen[-1:]!r}")


def main():
    driver = browser()
    wait = WebDriverWait(driver, LONG)
    errors = []
    try:
        driver.get(BASE + "/")
        assert driver.title == "Baton chat", driver.title
        keybox, side, main_ = (driver.find_element(By.ID, i) for i in ("keybox", "side", "main"))
        assert keybox.is_displayed(), "the key prompt is not shown"
        assert not side.is_displayed() and not main_.is_displayed(), "the chat is shown before a key is given"
        step("page loaded, asks for the key")

        # A wrong key: the page says so (alert) and stays on the key prompt.
        driver.find_element(By.ID, "key").send_keys("bk-not-a-key")
        driver.find_element(By.ID, "savekey").click()
        alert = wait.until(EC.alert_is_present())
        assert "key refused" in alert.text, alert.text
        alert.accept()
        assert keybox.is_displayed() and not main_.is_displayed()
        # The refused request's 401 is logged by Chromium as SEVERE: expected here, nowhere else.
        for e in severe(driver.get_log("browser")):
            if "401" not in e.get("message", ""):
                errors.append(e)
        step("wrong key refused")

        key = driver.find_element(By.ID, "key")
        key.clear()
        key.send_keys(KEY)
        driver.find_element(By.ID, "savekey").click()
        wait.until(EC.visibility_of_element_located((By.ID, "main")))
        assert side.is_displayed() and not keybox.is_displayed()
        step("key accepted")

        # First message: the reply streams in.
        driver.find_element(By.ID, "new").click()
        send(driver, FIRST)
        wait.until(lambda d: FIRST in texts(d, "#log .msg.user"))
        reply, seen = watch_reply(driver, 0)
        step(f"reply finished: {len(reply)} chars, {len(seen)} streamed states")
        assert reply and reply.strip(), "empty reply"
        assert "[error" not in reply and "[stopped]" not in reply, reply
        # Streaming: the text grew while the turn was still live, at least twice,
        # and each state was a prefix of the next and of the final reply.
        assert len(seen) >= 2, f"reply did not stream (seen while live: {seen!r}, final {reply!r})"
        for a, b in zip(seen, seen[1:] + [reply]):
            assert b.startswith(a), (a, b)
        assert len(seen[0]) < len(reply)

        # The conversation is listed (title = the first message) and active; the store agrees.
        wait.until(lambda d: texts(d, "#convs .conv.active") == [FIRST])
        convs = [c for c in conversations() if c.get("title") == FIRST]
        assert len(convs) == 1, conversations()
        conv_id = convs[0]["id"]
        status, conv = http("GET", "/v1/conversations/" + conv_id)
        assert status == 200 and len(conv["turns"]) == 1, (status, conv)
        assert conv["turns"][0]["state"] == "done", conv["turns"][0]
        assert conv["turns"][0]["reply"] == reply, (conv["turns"][0]["reply"], reply)
        step(f"conversation {conv_id} listed")

        # Second message, stopped as soon as text appears.
        def stop():
            driver.find_element(By.ID, "stop").click()
            step("stop clicked")

        send(driver, SECOND)
        stopped, _ = watch_reply(driver, 1, on_first_text=stop)
        step(f"second reply ended: {stopped[-40:]!r}")
        assert stopped.endswith(" [stopped]"), f"stop did not stop the reply: {stopped!r}"
        assert stopped[: -len(" [stopped]")].strip(), "stopped before any text"
        assert driver.find_element(By.ID, "stop").get_attribute("disabled") is not None
        time.sleep(1)
        assert driver.execute_script(LAST_REPLY)[1] == stopped, "the reply kept growing after it was stopped"
        status, conv = http("GET", "/v1/conversations/" + conv_id)
        assert status == 200 and [t["state"] for t in conv["turns"]] == ["done", "stopped"], conv["turns"]
        assert conv["turns"][1]["reply"] + " [stopped]" == stopped, (conv["turns"][1]["reply"], stopped)

        # A reload keeps the key (sessionStorage) and reopens the conversation from the store.
        driver.refresh()
        wait.until(EC.visibility_of_element_located((By.ID, "main")))
        item = wait.until(lambda d: next((e for e in d.find_elements(By.CSS_SELECTOR, "#convs .conv") if e.text == FIRST), None))
        item.click()
        want = [FIRST, reply, SECOND, stopped]
        wait.until(lambda d: texts(d, "#log .msg") == want)
        step("reload reopened the conversation")

        # Delete: confirm, then gone from the page and from the API.
        driver.find_element(By.ID, "del").click()
        alert = wait.until(EC.alert_is_present())
        assert "Delete" in alert.text, alert.text
        alert.accept()
        wait.until(lambda d: FIRST not in texts(d, "#convs .conv"))
        assert driver.find_elements(By.CSS_SELECTOR, "#log .msg") == []
        assert conv_id not in [c["id"] for c in conversations()]
        status, _ = http("GET", "/v1/conversations/" + conv_id)
        assert status == 404, status
        step("conversation deleted")

        errors += severe(driver.get_log("browser"))
    except TimeoutException as e:
        raise AssertionError(f"timed out after {LONG}s; page log: {page_log(driver)!r}") from e
    finally:
        driver.quit()
    assert not errors, f"browser console errors: {errors}"
    print("web page: ok")


def page_log(driver):
    try:
        return driver.execute_script("return document.getElementById('log').innerText")
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return f"<unreadable: {e}>"


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"web page: FAILED: {e}", file=sys.stderr)
        raise

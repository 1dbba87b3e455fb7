"""The web app in a real browser: Debian's headless Chromium driven by Playwright.

gunicorn serves the API and the pages; a real tiny-model worker answers.
Screenshots of each page are written to docs/screenshots/.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from config import Settings, load_catalog
from config.settings import PROJECT_ROOT
from db.session import Database
from fleet.registry import registry_key
from fleet.scaler_state import ScalerState
from tests import farm
from workers.executors.base import RecordOnlyExecutor
from workers.scaler import Scaler

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = PROJECT_ROOT / "docs" / "screenshots"
WAIT_MS = 60_000
expect.set_options(timeout=WAIT_MS)


@pytest.fixture(scope="module")
def farm_url(migrated: Settings, log_dir: Path, tiny_worker: farm.Process) -> Iterator[str]:
    with farm.serve_gunicorn(migrated, log_dir) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        if farm.services_required():
            pytest.fail("/usr/bin/chromium is missing (apt-get install chromium)", pytrace=False)
        pytest.skip("/usr/bin/chromium is missing (apt-get install chromium)")
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Any, farm_url: str) -> Iterator[Any]:
    context = browser.new_context(base_url=farm_url, viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def sign_in(page: Any, token: str, path: str = "/") -> None:
    page.goto(path)
    page.get_by_label("API token").fill(token)
    page.get_by_role("button", name="Sign in", exact=True).click()


def shot(page: Any, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / name), full_page=True)


def job_of(farm_url: str, token: str, job_id: str) -> dict[str, Any]:
    r = requests.get(
        f"{farm_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_job_final(farm_url: str, token: str, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    job = job_of(farm_url, token, job_id)
    while job["status"] in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.2)
        job = job_of(farm_url, token, job_id)
    return job


# Records the answer bubble's text every time it changes, and whether the
# answer was still streaming then: tokens seen before "done" show up as
# non-empty text with streaming=true.
RECORD_STREAM = """
() => {
  window.__seen = [];
  const list = document.getElementById('messages');
  new MutationObserver(() => {
    const answers = list.querySelectorAll('.turn.assistant');
    const last = answers[answers.length - 1];
    if (!last) return;
    window.__seen.push({
      text: last.querySelector('.bubble-text').textContent,
      streaming: last.classList.contains('streaming'),
    });
  }).observe(list, {subtree: true, childList: true, characterData: true, attributes: true});
}
"""


def test_wrong_token_shows_the_error(page: Any) -> None:
    sign_in(page, "sy_not-a-real-token")
    alert = page.locator("#sign-in-error")
    expect(alert).to_contain_text("401")
    expect(alert).to_contain_text("not accepted")
    expect(page.get_by_label("API token")).to_be_visible()
    assert page.evaluate("localStorage.getItem('switchyard.token')") is None
    assert "sy_not-a-real-token" not in page.url
    shot(page, "sign-in-error.png")


def test_the_token_is_kept_for_the_session_unless_remembered(page: Any, user_token: str) -> None:
    sign_in(page, user_token)
    expect(page.get_by_label("Message", exact=True)).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('switchyard.token')") == user_token
    assert page.evaluate("localStorage.getItem('switchyard.token')") is None
    assert not page.get_by_label("Remember on this device").is_checked()


def test_chat_streams_then_reopens_after_reload(page: Any, farm_url: str, user_token: str) -> None:
    sign_in(page, user_token)
    page.get_by_label("Model").select_option("tiny-random")
    page.get_by_text("Sampling settings and system prompt").click()
    page.get_by_label("Max tokens").fill("200")
    page.get_by_label("Temperature").fill("0.7")
    page.evaluate(RECORD_STREAM)

    page.get_by_label("Message", exact=True).fill("Tell me about foxes in winter.")
    page.get_by_label("Message", exact=True).press("Enter")

    answer = page.locator(".turn.assistant").last
    expect(answer).to_have_attribute("data-job-id", re.compile(r"[0-9a-f-]{36}"))
    expect(page.locator(".turn.assistant.streaming")).to_have_count(0)
    job_id = answer.get_attribute("data-job-id")
    # The bubble shows the answer rendered as Markdown; data-source holds its text.
    final_text = answer.locator(".bubble-text").get_attribute("data-source")
    assert final_text

    # The answer came over the page's one multiplexed websocket (/v1/ws).
    assert page.evaluate("state.transport.constructor.name") == "MuxTransport"
    seen = page.evaluate("window.__seen")
    during = [s["text"] for s in seen if s["streaming"] and s["text"]]
    assert during, "no token was shown before the answer was done"
    assert len(during[0]) < len(final_text)

    job = wait_job_final(farm_url, user_token, job_id)
    assert job["status"] == "succeeded" and job["output_text"] == final_text
    assert job["params"]["max_new_tokens"] == 200 and job["params"]["temperature"] == 0.7
    shot(page, "chat.png")

    page.reload()
    chat_link = page.locator(".chat-link", has_text="Tell me about foxes in winter.")
    expect(chat_link).to_be_visible()
    chat_link.click()
    expect(page.locator(".turn.user .bubble-text")).to_have_text(["Tell me about foxes in winter."])
    reopened = page.locator(".turn.assistant .bubble-text")
    expect(reopened).to_have_attribute("data-source", final_text)
    page.get_by_text("Sampling settings and system prompt").click()
    expect(page.get_by_label("Max tokens")).to_have_value("200")

    # A second turn carries the first one as context.
    page.get_by_label("Message", exact=True).fill("And in summer?")
    page.get_by_role("button", name="Send", exact=True).click()
    expect(page.locator(".turn.assistant")).to_have_count(2)
    expect(page.locator(".turn.assistant.streaming")).to_have_count(0)
    second = page.locator(".turn.assistant").last.get_attribute("data-job-id")
    sent = wait_job_final(farm_url, user_token, second)
    assert sent["status"] == "succeeded"

    page.set_viewport_size({"width": 390, "height": 844})
    shot(page, "chat-phone.png")


# Model output meant to run script: each piece must show as text. Streamed in
# small pieces, so a tag or a fence is split across tokens.
HOSTILE_ANSWER = """Here is **bold**, *emphasis*, `<b>inline</b>`,
a [safe link](https://example.com/a) and [a bad one](javascript:window.__pwned=1).
<img src=x onerror="window.__pwned=1"> <script>window.__pwned=1</script>
<a href="javascript:window.__pwned=1">click</a>

- one
- two <svg onload="window.__pwned=1">
  - nested

1. first
2. second

| Name | Value |
|------|------:|
| <iframe src="javascript:window.__pwned=1"> | 1 |

```python
print("<script>window.__pwned=1</script>")
```
"""
CODE = 'print("<script>window.__pwned=1</script>")'


def hostile_events() -> str:
    pieces = [HOSTILE_ANSWER[i : i + 7] for i in range(0, len(HOSTILE_ANSWER), 7)]
    events = [{"seq": 0, "type": "started"}]
    events += [{"seq": n + 1, "type": "token", "text": t} for n, t in enumerate(pieces)]
    events.append({"seq": len(pieces) + 1, "type": "done", "text": HOSTILE_ANSWER})
    return "".join(f"id: {e['seq']}\ndata: {json.dumps(e)}\n\n" for e in events)


def test_answers_render_markdown_and_never_run_model_html(
    page: Any, farm_url: str, user_token: str
) -> None:
    # The job is real (tiny-random); its event stream is replaced by this test's
    # tokens, read by the page's server-sent-events transport.
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=farm_url)
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.route(
        re.compile(r".*/v1/jobs/[^/]+/events$"),
        lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=hostile_events()
        ),
    )
    sign_in(page, user_token)
    page.get_by_role("button", name="New chat", exact=True).click()
    page.get_by_label("Model").select_option("tiny-random")
    page.evaluate("window.__pwned = 0; state.transport = new JobTransport()")
    page.get_by_label("Message", exact=True).fill("Show me some Markdown")
    page.get_by_role("button", name="Send", exact=True).click()
    expect(page.locator(".turn.assistant.streaming")).to_have_count(0)
    body = page.locator(".turn.assistant .bubble-text").last
    expect(body).to_have_attribute("data-source", HOSTILE_ANSWER)

    # Nothing ran, nothing became an element; the hostile text shows as written.
    page.wait_for_timeout(500)
    assert page.evaluate("window.__pwned") == 0 and dialogs == []
    assert body.locator("img, script, svg, iframe, [onerror], [onload]").count() == 0
    expect(body).to_contain_text('<img src=x onerror="window.__pwned=1">')
    expect(body).to_contain_text("<script>window.__pwned=1</script>")
    expect(body).to_contain_text("[a bad one](javascript:window.__pwned=1)")
    expect(body).to_contain_text('<a href="javascript:window.__pwned=1">click</a>')
    links = body.locator("a")
    expect(links).to_have_count(1)
    expect(links).to_have_attribute("href", "https://example.com/a")
    expect(links).to_have_attribute("rel", "noopener noreferrer")
    expect(links).to_have_attribute("target", "_blank")

    # Emphasis, inline code, lists, a table and a code block render.
    expect(body.locator("strong")).to_have_text("bold")
    expect(body.locator("em")).to_have_text("emphasis")
    expect(body.locator("p code")).to_have_text("<b>inline</b>")
    expect(body.locator(":scope > ul > li")).to_have_count(2)
    expect(body.locator("li > p")).to_have_count(0)  # a tight list: no paragraphs
    expect(body.locator("ul > li ul > li")).to_have_text(["nested"])
    second = body.locator(":scope > ul > li").nth(1)
    expect(second).to_contain_text('two <svg onload="window.__pwned=1">')
    expect(body.locator("ol > li")).to_have_text(["first", "second"])
    expect(body.locator("table th")).to_have_text(["Name", "Value"])
    expect(body.locator("table td").first).to_have_text(
        '<iframe src="javascript:window.__pwned=1">'
    )
    expect(body.locator("table td.align-right")).to_have_text("1")
    expect(body.locator(".code-block pre code")).to_have_text(CODE)
    expect(body.locator(".code-block pre code")).to_have_attribute("data-lang", "python")

    copy = body.get_by_role("button", name="Copy code")
    copy.click()
    expect(body.get_by_role("button", name="Copied")).to_be_visible()
    assert page.evaluate("navigator.clipboard.readText()") == CODE
    shot(page, "chat-markdown.png")
    # Without a clipboard (plain http on another host) the code is selected instead.
    page.evaluate("() => { navigator.clipboard.writeText = () => Promise.reject(Error('no')); }")
    copy = body.locator(".copy-code")
    copy.click()
    expect(copy).to_have_attribute("aria-label", re.compile("the code is selected"))
    assert page.evaluate("window.getSelection().toString()") == CODE

    # While it streams, an unclosed fence already shows as code.
    partial = page.evaluate(
        """(text) => { const d = document.createElement('div');
                       Markdown.render(text, d);
                       return d.querySelector('pre code').textContent; }""",
        "Text\n```js\nlet a = 1;",
    )
    assert partial == "let a = 1;"
    assert page.evaluate("window.__pwned") == 0


# Renders 3,000 random strings of Markdown- and HTML-significant pieces and
# returns what should never be there: an element or attribute the renderer does
# not make, a link that is not http(s), or an exception.
FUZZ_MARKDOWN = """
() => {
  const pieces = ['<', '>', '"', "'", '&', '*', '**', '_', '`', '```', '~~', '[', ']', '(', ')',
    '|', '-', '1.', '#', '>', ' ', '\\n', '\\n\\n', '  ', '\\\\', 'javascript:', 'http://a.b/c',
    'https://x.y', 'data:text/html,', '<script>', '<img src=x onerror=alert(1)>', 'onload=',
    'a', 'word', '|---|', ':--'];
  let seed = 42;
  const rand = (n) => {  // mulberry32: the same strings on every run
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) % n;
  };
  const tags = new Set(['P', 'STRONG', 'EM', 'DEL', 'CODE', 'PRE', 'A', 'UL', 'OL', 'LI',
    'TABLE', 'THEAD', 'TBODY', 'TR', 'TH', 'TD', 'DIV', 'BUTTON', 'BLOCKQUOTE', 'HR',
    'H3', 'H4', 'H5', 'H6']);
  const attrs = new Set(['class', 'href', 'target', 'rel', 'type', 'aria-label', 'data-state',
    'data-lang', 'start']);
  const bad = [];
  const made = {};
  for (let n = 0; n < 3000; n++) {
    let text = '';
    for (let k = rand(40); k >= 0; k--) text += pieces[rand(pieces.length)];
    const box = document.createElement('div');
    try {
      Markdown.render(text, box);
    } catch (err) {
      bad.push(['throws', text, String(err)]);
      continue;
    }
    for (const node of box.querySelectorAll('*')) {
      made[node.tagName] = (made[node.tagName] || 0) + 1;
      if (!tags.has(node.tagName)) bad.push(['tag', text, node.tagName]);
      for (const a of node.attributes) {
        if (!attrs.has(a.name)) bad.push(['attribute', text, a.name]);
      }
      if (node.tagName === 'A' && !/^https?:\\/\\//.test(node.getAttribute('href')))
        bad.push(['href', text, node.getAttribute('href')]);
    }
  }
  return {bad: bad.slice(0, 5), made};
}
"""


def test_markdown_of_random_text_makes_only_safe_nodes(page: Any, user_token: str) -> None:
    sign_in(page, user_token)
    expect(page.get_by_label("Message", exact=True)).to_be_visible()
    found = page.evaluate(FUZZ_MARKDOWN)
    assert found["bad"] == []
    # The pieces did make every kind of node, links included.
    for tag in ("A", "STRONG", "EM", "CODE", "PRE", "UL", "OL", "TABLE", "BLOCKQUOTE", "H3"):
        assert found["made"].get(tag, 0) > 0, (tag, found["made"])


def test_queue_position_then_stop(page: Any, farm_url: str, user_token: str) -> None:
    # tiny-late has no worker: the job waits in the queue until it is stopped.
    sign_in(page, user_token)
    page.get_by_role("button", name="New chat", exact=True).click()
    page.get_by_label("Model").select_option("tiny-late")
    page.get_by_label("Message", exact=True).fill("Are you there?")
    page.get_by_role("button", name="Send", exact=True).click()
    status = page.locator("#queue-status")
    expect(status).to_contain_text(re.compile(r"queue"))
    # No worker of the model is ready, nor starting: the page says so, with a bar.
    loading = page.locator("#load-status")
    expect(loading).to_be_visible()
    expect(loading).to_contain_text("Waiting for a worker to be started for this model")
    expect(page.locator("#load-progress")).to_be_visible()
    answer = page.locator(".turn.assistant").last
    job_id = answer.get_attribute("data-job-id")
    assert job_id
    shot(page, "chat-queued.png")

    stop = page.get_by_role("button", name="Stop", exact=True)
    expect(stop).to_be_enabled()
    stop.click()
    expect(answer).to_contain_text("Stopped.")
    expect(loading).to_be_hidden()
    expect(page.get_by_role("button", name="Send", exact=True)).to_be_enabled()
    assert wait_job_final(farm_url, user_token, job_id)["status"] == "cancelled"


def test_rename_and_delete_a_chat(page: Any, user_token: str) -> None:
    sign_in(page, user_token)
    page.get_by_role("button", name="New chat", exact=True).click()
    page.get_by_label("Model").select_option("tiny-random")
    page.get_by_label("Message", exact=True).fill("A chat to rename")
    page.get_by_role("button", name="Send", exact=True).click()
    expect(page.locator(".turn.assistant")).to_have_count(1)
    expect(page.locator(".turn.assistant.streaming")).to_have_count(0)
    page.get_by_role("button", name="Rename chat", exact=True).click()
    page.get_by_label("Chat title").fill("Renamed chat")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.locator(".chat-link", has_text="Renamed chat")).to_be_visible()
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Delete chat", exact=True).click()
    expect(page.locator(".chat-link", has_text="Renamed chat")).to_have_count(0)


def test_operator_page_shows_models_and_workers(page: Any, admin_token: str) -> None:
    sign_in(page, admin_token, "/ops")
    card = page.locator('[data-model="tiny-random"]')
    expect(card).to_be_visible()
    expect(card.get_by_role("table")).to_contain_text("ready")
    expect(card).to_contain_text("Ready replicas")
    expect(card).to_contain_text("Queue depth")
    shot(page, "ops.png")

    late = page.locator('[data-model="tiny-late"]')
    late.get_by_label("Replicas", exact=True).fill("1")
    late.get_by_role("button", name="Scale", exact=True).click()
    expect(late).to_contain_text("manual: 1")
    late.get_by_role("button", name="Back to automatic").click()
    expect(late).to_contain_text("automatic")
    expect(late).not_to_contain_text("manual: 1")
    page.set_viewport_size({"width": 390, "height": 844})
    shot(page, "ops-phone.png")


def test_operator_page_refuses_a_plain_user(page: Any, user_token: str) -> None:
    sign_in(page, user_token, "/ops")
    expect(page.locator("#sign-in-error")).to_contain_text("403")


def add_job(db: Any, model: str, status: str, **fields: Any) -> str:
    from db.schema import Job

    job_id = str(uuid.uuid4())
    with db.session() as s:
        s.add(Job(id=job_id, model=model, status=status, params={}, attempts=1, **fields))
    return job_id


def test_operator_charts_from_the_farms_history(
    page: Any, farm_url: str, migrated: Settings, admin_token: str, user_token: str
) -> None:
    """The farm's history over the last 40 minutes, then the operator page draws it.

    The real scaler (its executor records only) ticks once a minute of the past
    40 against the farm's database and Redis, as its leader would have: the
    tiny-random worker of this module is its ready replica; finished jobs are
    written with the times a worker gives them (the history counts them by
    those times); jobs queued for tiny-late through the API wake it up, and an
    operator pins a count through the API.
    """
    db = Database(migrated.database_url)
    client = redis.Redis.from_url(migrated.redis_url)
    scaler = Scaler(
        migrated,
        load_catalog(migrated.models_dir),
        db,
        client,
        RecordOnlyExecutor(),
    )
    now = datetime.now(UTC)
    base = now.replace(second=0, microsecond=0) - timedelta(minutes=40)
    s = timedelta(seconds=1)
    headers = {"Authorization": f"Bearer {admin_token}"}
    queued: list[str] = []
    # Two lost workers of tiny-late: one a moment ago (listed), one long ago (folded away).
    for gone, age in (("tiny-late@gone:1:recent", 20), ("tiny-late@gone:2:old", 600)):
        client.hset(
            registry_key(migrated),
            gone,
            json.dumps(
                {
                    "id": gone,
                    "model": "tiny-late",
                    "state": "ready",
                    "updated_at": time.time() - age,
                }
            ),
        )
    # A time-of-day window over the hour of 20 minutes ago (UTC), which the charts shade.
    hour = (now - timedelta(minutes=20)).hour
    # This scaler leads (its lock held), so the API's reaper records no history of its own.
    lock = ScalerState.lock_key_of(migrated)
    client.set(lock, scaler.id, px=300_000)
    r = requests.post(
        f"{farm_url}/v1/admin/models/tiny-random/schedule",
        json={"cron": f"* {hour} * * *", "timezone": "UTC", "min_replicas": 1},
        headers=headers,
        timeout=30,
    )
    assert r.status_code in (200, 201), r.text
    window_id = r.json()["id"]
    try:
        for k in range(40):
            minute = base + timedelta(minutes=k)
            for n in range(1 + k % 3):
                wait, ttft = 0.2 + 0.1 * n, 0.05 + 0.01 * (k % 7) + 0.02 * n
                add_job(
                    db,
                    "tiny-random",
                    "succeeded",
                    created_at=minute + (5 + n) * s,
                    started_at=minute + (5 + n + wait) * s,
                    first_token_at=minute + (5 + n + wait + ttft) * s,
                    finished_at=minute + (20 + n) * s,
                )
            if k in (12, 31):
                add_job(
                    db,
                    "tiny-random",
                    "failed",
                    created_at=minute + s,
                    started_at=minute + 2 * s,
                    finished_at=minute + 10 * s,
                    worker="tiny-random@gone:9:dead",
                    error="worker lost 2 times",
                )
            if k == 15:  # three requests for tiny-late, which no worker serves
                for _ in range(3):
                    r = requests.post(
                        f"{farm_url}/v1/jobs",
                        json={"model": "tiny-late", "prompt": "anyone?"},
                        headers={"Authorization": f"Bearer {user_token}"},
                        timeout=30,
                    )
                    assert r.status_code in (200, 201, 202), r.text
                    queued.append(r.json()["id"])
            if k == 24:  # given up on
                for job_id in queued:
                    requests.delete(f"{farm_url}/v1/jobs/{job_id}", headers=headers, timeout=30)
            scaler.tick(minute + 50 * s)
        r = requests.put(
            f"{farm_url}/v1/admin/models/tiny-random/scaling",
            json={"replicas": 2},
            headers=headers,
            timeout=30,
        )
        assert r.status_code == 200, r.text
        scaler.tick()

        sign_in(page, admin_token, "/ops")
        card = page.locator('[data-model="tiny-random"]')
        charts = card.locator(".history .chart")
        expect(charts).to_have_count(5)
        for key in ("queue", "replicas", "tokens", "ttft", "wait"):
            line = card.locator(f'[data-chart="{key}"] path.line').first
            expect(line).to_have_attribute("data-points", re.compile(r"^[1-9][0-9]*$"))
        replicas = card.locator('[data-chart="replicas"] path.line')
        assert int(replicas.nth(1).get_attribute("data-points")) >= 40  # ready, each minute
        ttft = card.locator('[data-chart="ttft"] path.line').first
        assert int(ttft.get_attribute("data-points")) >= 40
        band = card.locator('[data-chart="replicas"] .window-band')
        expect(band).to_have_count(1)
        expect(band).to_have_attribute("data-window", re.compile(rf"\* {hour} \* \* \* \(UTC\)"))

        # The operator's pin is a marker; its tooltip says who and why.
        pin = card.locator('[data-chart="replicas"] .marker[data-kinds~="setting"]').first
        pin.hover()
        tip = card.locator('[data-chart="replicas"] .chart-tip')
        expect(tip).to_be_visible()
        expect(tip).to_contain_text("setting")
        expect(tip).to_contain_text("admin-")

        late = page.locator('[data-model="tiny-late"]')
        wake = late.locator('[data-chart="replicas"] .marker[data-kinds~="wake"]')
        expect(wake).to_have_count(1)
        wake.hover()
        expect(late.locator('[data-chart="replicas"] .chart-tip')).to_contain_text(
            re.compile(r"wake: 0 → 1 replicas, by ")
        )
        # Lost workers: the recent one listed, the old one folded away.
        expect(late.get_by_text("tiny-late@gone:1:recent")).to_be_visible()
        expect(late.get_by_text("tiny-late@gone:2:old")).to_be_hidden()
        expect(late.locator(".lost-workers summary")).to_contain_text("1 lost worker")

        events = page.locator("#recent-events")
        expect(events.locator('tr[data-kind="wake"]').first).to_contain_text("tiny-late")
        expect(events.locator('tr[data-kind="setting"]').first).to_contain_text("admin-")
        failures = page.locator("#recent-failures")
        expect(failures.locator("tbody tr")).to_have_count(2)
        expect(failures).to_contain_text("worker lost 2 times")
        wake.hover()  # the tooltip shows in the screenshots
        late.locator(".history").screenshot(path=str(SCREENSHOTS / "ops-charts-wake.png"))
        pin.hover()
        card.locator(".history").screenshot(path=str(SCREENSHOTS / "ops-charts.png"))
        page.locator("#recent-events").screenshot(path=str(SCREENSHOTS / "ops-events.png"))

        late.locator(".lost-workers summary").click()
        expect(late.get_by_text("tiny-late@gone:2:old")).to_be_visible()

        # On a phone the charts stack and nothing scrolls sideways.
        page.set_viewport_size({"width": 390, "height": 844})
        expect(card.locator('[data-chart="replicas"]')).to_be_visible()
        wide = page.evaluate(  # the innermost elements past the screen's edge, if any
            """() => [...document.querySelectorAll('body *')]
                 .filter((n) => n.getBoundingClientRect().right > 392 && !n.children.length)
                 .slice(0, 8).map((n) => `${n.tagName}.${n.className}`)"""
        )
        assert page.evaluate("document.documentElement.scrollWidth") <= 390, wide
        card.locator(".history").screenshot(path=str(SCREENSHOTS / "ops-charts-phone.png"))
        page.set_viewport_size({"width": 1280, "height": 860})

        # A day's range: the same 41 minutes in 5-minute buckets, on a wider axis.
        page.get_by_label("History over").select_option("1d")
        expect(card.locator('[data-chart="replicas"] path.line').nth(1)).to_have_attribute(
            "data-points", re.compile(r"^(9|10)$")
        )
    finally:
        client.delete(lock)
        requests.delete(
            f"{farm_url}/v1/admin/models/tiny-random/schedule/{window_id}",
            headers=headers,
            timeout=30,
        )
        requests.put(
            f"{farm_url}/v1/admin/models/tiny-random/scaling",
            json={"auto": True},
            headers=headers,
            timeout=30,
        )
        client.hdel(registry_key(migrated), "tiny-late@gone:1:recent", "tiny-late@gone:2:old")
        db.dispose()

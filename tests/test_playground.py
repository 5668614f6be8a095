"""The web playground in a real browser: Debian's chromium, headless, driven by Playwright's Python
package against the server on 127.0.0.1 with the default model (SmolLM2-135M), greedy, prompt lookup.

Oracles: the stream the page received, read off the wire by the browser (the marks drawn must be its
tokens, origins, passes and draft positions, in order, and as many as its usage counts), the stream's
own statistics (figures), and plain decoding (the race's speculative pane must equal it). The test
takes docs/img/playground.png, the README's screenshot.

chromium comes from apt (scripts/install.sh installs it where apt can run); Playwright cannot
download its own browsers here. Where install.sh could not install it, it says why in
.venv/.quickdraft-no-chromium and this test is skipped with that reason; missing otherwise, it fails.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import quickdraft
from quickdraft.engine.batch import EngineConfig
from quickdraft.proposers import SpecConfig
from quickdraft.server import BackgroundServer, ServerConfig

pytestmark = pytest.mark.slow  # ~40 s: the default model, a browser, three answers

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
NO_CHROMIUM = ROOT / ".venv" / ".quickdraft-no-chromium"
SCREENSHOT = ROOT / "docs" / "img" / "playground.png"
NAME = "smollm2-135m"
PROMPT = "Write a Python function that adds two numbers, then a version with type hints."
DRAFT_ORIGINS = {"accepted", "branch"}


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    llm = quickdraft.load(NAME)
    # the fixed policy verifies every draft prompt lookup offers: under goodput, step times measured on a
    # slow or busy machine may rightly decide that no draft pays, and the page would have no draft to mark
    s = BackgroundServer(llm, ServerConfig(NAME, SpecConfig("ngram", k=8), EngineConfig(max_batch=2, policy="fixed")))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        if NO_CHROMIUM.exists():
            pytest.skip(f"NO BROWSER TEST: {NO_CHROMIUM.read_text().strip()}")
        pytest.fail(f"{CHROMIUM} is missing: run scripts/install.sh (it installs Debian's chromium with apt)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        # --no-sandbox: chromium refuses to run as root with its sandbox (containers, CI)
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def wire_tokens(body: str) -> tuple[list[dict], list[dict]]:
    """(the chunks, their tokens with the pass that committed them) of an SSE body ending with [DONE]."""
    events = [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [{**t, "pass": c["quickdraft"]["pass"]} for c in chunks for t in c["quickdraft"]["tokens"]]
    return chunks, tokens


def marks(page, selector: str) -> list[dict]:
    return page.eval_on_selector_all(f"{selector} .tok", """spans => spans.map(s => ({
        origin: s.dataset.origin, text: s.textContent, pass: Number(s.dataset.pass),
        depth: Number(s.dataset.depth), id: Number(s.dataset.id)}))""")


def test_chat_marks_each_token_by_origin_and_a_race_is_identical(server: BackgroundServer, browser) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.wait_for_selector("body[data-ready='1']")
    assert page.text_content("#model") == NAME and page.text_content("#default-spec") == "ngram, k = 8"
    assert page.input_value("#method") == "ngram" and page.input_value("#temperature") == "0"

    # -- a chat answer: every mark is a token of the stream, in order, with its origin and pass
    page.fill("#max-tokens", "96")
    page.fill("#prompt", PROMPT)
    with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as answer:
        page.click("#send")
    page.wait_for_selector("#log .msg.assistant[data-done='1']", timeout=120_000)
    chunks, tokens = wire_tokens(answer.value.text())
    final = chunks[-1]
    stats, usage = final["stats"], final["usage"]
    drawn = marks(page, "#log .msg.assistant")
    assert drawn == [{k: t[k] for k in ("origin", "text", "pass", "depth", "id")} for t in tokens]
    counts = Counter(m["origin"] for m in drawn)
    assert sum(counts.values()) == usage["completion_tokens"] == stats["new_tokens"]
    assert counts["accepted"] > 0 and counts["recovered"] + counts["bonus"] > 0, counts
    # one target token per pass (each draft-verifying pass gives a recovered or bonus token); the
    # last pass may have lost its own to the token budget, and accepted drafts cut there are counted
    target_marks = counts["recovered"] + counts["bonus"] + counts["target"]
    assert stats["target_passes"] - 1 <= target_marks <= stats["target_passes"]
    assert counts["accepted"] + counts["branch"] <= stats["accepted_tokens"]
    assert all(m["depth"] >= 1 for m in drawn if m["origin"] != "target")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert page.eval_on_selector("#log .msg.assistant", "m => m.textContent") == "assistant" + text

    # hovering an accepted token tells its pass and its position in the draft
    accepted = next(i for i, m in enumerate(drawn) if m["origin"] == "accepted")
    page.hover(f"#log .msg.assistant .tok >> nth={accepted}")
    info = page.text_content("#hover-info")
    assert f"target pass {drawn[accepted]['pass']}" in info and \
        f"position {drawn[accepted]['depth']} in the draft" in info and "proposed by prompt lookup (ngram)" in info, info
    # a one-part proposer's tokens carry no source on the wire: the page names the request's method
    assert {t["source"] for t in tokens} == {None}
    sources = page.eval_on_selector_all("#log .msg.assistant .tok", "spans => spans.map(s => s.dataset.source)")
    assert {s for s, m in zip(sources, drawn) if m["origin"] in DRAFT_ORIGINS} == {"ngram"}
    assert {s for s, m in zip(sources, drawn) if m["origin"] not in DRAFT_ORIGINS} == {""}

    # the live figures are the stream's
    assert page.text_content("#fig-of") == "of the chat answer (ngram, k = 8)"
    for origin in ("accepted", "branch", "recovered", "bonus", "target"):
        assert page.get_attribute(f"#fig-origins li[data-origin='{origin}']", "data-count") == str(counts[origin])
    assert page.get_attribute("#fig-sources li[data-source='ngram']", "data-count") == \
        str(counts["accepted"] + counts["branch"])
    assert page.text_content("#fig-tpp") == f"{stats['tokens_per_pass']:.2f}"  # the stop token counted, as in stats
    assert page.text_content("#fig-passes") == str(stats["target_passes"])
    bars = page.eval_on_selector_all("#fig-bars .bar span", "spans => spans.map(s => s.textContent)")
    # the page rounds as JavaScript's Math.round does (halves up), not as Python's round (halves to even)
    assert bars == [f"{math.floor(rate * 100 + 0.5)}%" for rate in stats["acceptance_by_position"]]

    # -- a race of the same prompt: both panes finish, greedy speculative equals plain
    page.click("#race")
    page.wait_for_selector("#race-result[data-identity]", timeout=180_000)
    result = page.text_content("#race-result")
    assert page.get_attribute("#race-result", "data-identity") == "identical", result
    assert re.match(r"speedup \d+\.\d\dx · identical", result), result
    plain, spec = marks(page, "#pane-plain .out"), marks(page, "#pane-spec .out")
    assert all(page.get_attribute(f"#pane-{pane} .out", "data-done") == "1" for pane in ("plain", "spec"))
    assert {m["origin"] for m in plain} == {"target"} and DRAFT_ORIGINS & {m["origin"] for m in spec}
    assert [m["id"] for m in plain] == [m["id"] for m in spec] and len(plain) > 0
    assert page.text_content("#fig-of") == "of the race's ngram, k = 8 run"
    # the race card and the live figures count one way: the speculative pane's tokens per pass
    assert f"{page.text_content('#fig-tpp')} tokens per pass" in page.text_content("#pane-spec .meta")
    assert errors == []
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    page.close()

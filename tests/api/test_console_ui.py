"""The web console in a real headless browser (Debian's chromium through its chromedriver, no
download at run time) against `loraplex serve` on the default model: an adapter loaded through
the page, the playground streaming base and adapter side by side, a schema run shown parsed
and valid, the live numbers moving, and every view fitting a narrow window.

With LORAPLEX_SCREENSHOTS=<folder> it also saves the three views there (docs/ holds them)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import jsonschema
import pytest

from conftest import make_peft_adapter
from test_serve_e2e import serving

pytestmark = pytest.mark.e2e
USER, ADMIN = "console-user-key", "console-admin-key"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
          "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}}}


def browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:  # a failure with the reason, never a silent skip
        pytest.fail("the console test needs Debian's chromium and chromium-driver packages "
                    "(apt-get install chromium chromium-driver; `make test` tries to install them)")
    return chromium, driver


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("console-root")
    make_peft_adapter(default_model_dir, root / "ex", rank=8, seed=0, scale=0.5)
    with serving(default_model_dir, "--max-model-len", "2048", "--adapter-root", str(root), "--api-key", USER,
                 env={"LORAPLEX_ADMIN_API_KEY": ADMIN}) as (url, _):
        yield url


@pytest.fixture(scope="module")
def page(served):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_window_size(1280, 800)
    try:
        driver.get(served + "/ui/")
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, timeout: float = 180, what: str = "the page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition(driver)
        if value:
            return value
        time.sleep(0.25)
    shot = Path(os.environ.get("TMPDIR", "/tmp")) / "loraplex-console-failure.png"
    driver.save_screenshot(str(shot))
    pytest.fail(f"timed out waiting for {what} (screenshot: {shot}); page error: "
                f"{driver.find_element('id', 'error').text!r}")


def _spec_cards(driver) -> dict:
    """The speculation cards for a `spec_decode` (a server with --speculative-config), drawn and read in one
    script: the next poll of this server hides them again."""
    return driver.execute_script("""
        const spec = {drafts: 10, draft_tokens: 40, accepted_tokens: 25, acceptance_rate: 0.625,
                      mean_acceptance_length: 3.5, by_adapter: {a: {acceptance_rate: 0.75}}};
        showSpec({time: 2, spec_decode: spec}, {time: 1, spec_decode: {...spec, draft_tokens: 0}});
        const shown = [...document.querySelectorAll('.card.spec, .card.spec-adapters')].every((c) => !c.hidden);
        const text = (id) => document.getElementById(id).textContent;
        return shown && {rate: text('live-spec-rate'), length: text('live-spec-length'),
                         tps: text('live-spec-tps'), adapters: text('live-spec-adapters')};""")


def by_id(driver, element_id):
    return driver.find_element("id", element_id)


def type_into(driver, element_id: str, text: str) -> None:
    field = by_id(driver, element_id)
    field.clear()
    field.send_keys(text)


def screenshot(driver, name: str) -> None:
    folder = os.environ.get("LORAPLEX_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / f"console-{name}.png"))


def run_outputs(run: int):
    """Columns of playground run `run` once all are done, read in one script: the click's handler
    replaces the previous run's columns only after the schema check, so element handles taken
    earlier may belong to the old run or go stale."""
    script = """
        const out = document.getElementById("outputs");
        if (out.dataset.run !== String(arguments[0])) return null;
        const cols = [...out.querySelectorAll(".column")];
        if (!cols.length || !cols.every((c) => c.classList.contains("done"))) return null;
        return cols.map((c) => ({model: c.dataset.model, text: c.querySelector(".text").textContent,
                                 parsed: c.querySelector(".parsed") ? c.querySelector(".parsed").textContent : null}));
    """
    return lambda driver: driver.execute_script(script, run)


def served_url(driver) -> str:
    return driver.current_url.split("/ui")[0]


def _answer(url: str, prompt: str, **fields) -> str:
    """The same chat request as the playground's, unstreamed, through the API."""
    import urllib.request

    base = next(m["id"] for m in json.loads(_get(url, "/v1/models"))["data"] if m["parent"] is None)
    body = {"model": base, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}], **fields}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {USER}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"]


def _get(url: str, path: str) -> str:
    import urllib.request

    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {USER}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read().decode()


def test_the_console_end_to_end(page):
    driver = page
    type_into(driver, "api-key", USER)
    # adapters view: the base row; admin controls only with the admin key
    wait_for(driver, lambda d: "(base)" in by_id(d, "adapters-table").text, what="the adapter table")
    assert not by_id(driver, "load-form").is_displayed()
    type_into(driver, "admin-key", ADMIN)
    assert by_id(driver, "load-form").is_displayed()
    type_into(driver, "load-name", "ex")
    type_into(driver, "load-path", "nope")  # refused: the server's own message, as is
    by_id(driver, "load-btn").click()
    wait_for(driver, lambda d: "bad" in by_id(d, "admin-status").get_attribute("class"), what="a refusal")
    assert "nope" in by_id(driver, "admin-status").text
    type_into(driver, "load-path", "ex")
    by_id(driver, "load-btn").click()
    row = wait_for(driver, lambda d: d.execute_script(
        "const r = document.querySelector('tr[data-name=\"ex\"]'); return r && r.innerText;"), what="the loaded adapter")
    assert "8" in row and "q_proj" in row
    assert by_id(driver, "page-info").text == "1-1 of 1" and not by_id(driver, "page-next").is_enabled()
    type_into(driver, "adapter-search", "nothing-like-it")  # searched on the server: the page empties
    wait_for(driver, lambda d: by_id(d, "page-info").text == "none", what="an empty search")
    type_into(driver, "adapter-search", "E")  # a part of the name, any case
    wait_for(driver, lambda d: by_id(d, "page-info").text == "1-1 of 1", what="the search's page")
    screenshot(driver, "adapters")

    by_id(driver, "tab-live").click()
    wait_for(driver, lambda d: by_id(d, "live-total").text not in ("", "-"), what="live numbers")
    total_before = int(by_id(driver, "live-total").text)

    # playground: base and the adapter streamed side by side, then a schema
    by_id(driver, "tab-playground").click()
    wait_for(driver, lambda d: d.find_elements("css selector", '#targets input[value="ex"]'), what="targets")
    driver.find_element("css selector", '#targets input[value="ex"]').click()
    by_id(driver, "mix-add").click()  # a third target: the adapter at weight -0.8 on the base model
    weight = driver.find_element("css selector", "#mix-rows .mix-weight")
    weight.clear()
    weight.send_keys("-0.8")
    type_into(driver, "prompt", "Name three colors of the rainbow.")
    type_into(driver, "max-tokens", "24")
    by_id(driver, "run").click()
    cols = wait_for(driver, run_outputs(1), what="three streamed answers")
    texts = {c["model"]: c["text"] for c in cols}
    assert list(texts)[2] == "mix: ex × -0.8" and len(texts) == 3, texts
    assert all(t.strip() for t in texts.values()) and len({t.strip() for t in texts.values()}) == 3, texts
    assert texts["mix: ex × -0.8"] == _answer(served_url(driver), "Name three colors of the rainbow.",
                                             adapters=[{"name": "ex", "weight": -0.8}])
    assert '"adapters"' in by_id(driver, "snippet-curl").get_attribute("textContent")
    assert "client.chat.completions.create" in by_id(driver, "snippet-python").get_attribute("textContent")
    driver.find_element("css selector", "#mix-rows .mix-remove").click()

    type_into(driver, "schema", '{"type": "object", "properties": {"x": {"type": "array", "contains": {}}}}')
    wait_for(driver, lambda d: "'contains'" in by_id(d, "schema-status").text, what="the server's refusal")
    type_into(driver, "schema", json.dumps(SCHEMA))
    wait_for(driver, lambda d: "Schema accepted" in by_id(d, "schema-status").text, what="the schema check")
    type_into(driver, "prompt", "Give the city and country of the Eiffel Tower as JSON.")
    type_into(driver, "max-tokens", "60")
    by_id(driver, "run").click()
    cols = wait_for(driver, run_outputs(2), what="the schema run")
    assert len(cols) == 2
    for col in cols:  # base and adapter, each parsed and valid
        jsonschema.validate(json.loads(col["parsed"]), SCHEMA)
    screenshot(driver, "playground")

    by_id(driver, "tab-live").click()
    wait_for(driver, lambda d: int(by_id(d, "live-total").text) > total_before, what="the live total to move")
    assert by_id(driver, "live-ttft").text != "- / -"
    assert not by_id(driver, "live-spec-rate").is_displayed()  # served without --speculative-config
    assert _spec_cards(driver) == {"rate": "62.5 %", "length": "3.50", "tps": "40.0", "adapters": "a 75.0 %"}
    time.sleep(2)
    screenshot(driver, "live")

    driver.set_window_size(420, 800)  # a narrow window: nothing spills sideways
    for view in ("adapters", "live", "playground"):
        by_id(driver, f"tab-{view}").click()
        assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1"), view
    driver.set_window_size(1280, 800)


def test_the_console_can_be_turned_off(default_model_dir):
    import urllib.error
    import urllib.request

    with serving(default_model_dir, "--max-model-len", "512", "--disable-ui") as (url, _):
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url + "/ui/", timeout=10)
        assert missing.value.code == 404

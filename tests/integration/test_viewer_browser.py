"""The rollout report in a real browser: headless Chromium opens the file, we click and read the DOM.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them when missing) and the
``selenium`` test extra; skipped with the reason when one is missing. No Ray cluster: the page is a
file. Screenshots land in the test's tmp folder (``table.png``, ``dialog.png``).
"""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcollect.viewer import write_rollout_report

webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
from selenium.webdriver.common.by import By  # noqa: E402 - after the skip above
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromium-driver on PATH (.ci/run installs them: apt-get install chromium chromium-driver)",
)

GROUPS = 3
ANSWERS_PER_GROUP = 4
MULTI_TURN_TRAJ = (1 << 62) + 1  # past 2**53, where a JavaScript number would round it: the page must keep it exact
SYSTEM = "<|im_start|>user\nGuess my number between 1 and 20.<|im_end|>\n<|im_start|>assistant\n"
REPLY = "<|im_end|>\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"


def _row(tokenizer: Any, traj_id: int, step: int, prompt: str, response: str, **fields: Any) -> dict[str, Any]:
    tokens = tokenizer.encode(response, add_special_tokens=False)
    # confident first token, unsure last one: the colours must tell them apart
    log_probs = [-0.05 if i == 0 else -7.5 if i == len(tokens) - 1 else -1.0 for i in range(len(tokens))]
    return {
        "prompt": prompt, "response": response, "tokens_prompt": tokenizer.encode(prompt, add_special_tokens=False),
        "tokens_response": tokens, "log_probs": log_probs, "reward": 0.0, "done": True, "policy_version": 0,
        "traj_id": traj_id, "step": step, "prompt_id": 0, "group_id": 0, **fields,
    }


def rollout_rows(tokenizer: Any) -> list[dict[str, Any]]:
    """GROUPS x ANSWERS_PER_GROUP one-turn dialogs, then a three-turn dialog whose last turn spans two versions."""
    rows = []
    for group in range(GROUPS):
        for answer in range(ANSWERS_PER_GROUP):
            traj_id = group * ANSWERS_PER_GROUP + answer
            rows.append(_row(tokenizer, traj_id, 0, SYSTEM, f"My guess is {answer + 7}.", reward=answer / 4,
                             policy_version=group, group_id=100 + group, prompt_id=group))
    prompt = SYSTEM
    for step, (response, version) in enumerate([("10", 1), ("15", 1), ("I think it is 17 then", 2)]):
        rows.append(_row(tokenizer, MULTI_TURN_TRAJ, step, prompt, response, policy_version=version, group_id=-1,
                         prompt_id=9, done=step == 2, reward=1.0 if step == 2 else 0.0))
        prompt = prompt + response + REPLY
    last = rows[-1]
    half = len(last["tokens_response"]) // 2
    last["token_versions"] = [1] * half + [2] * (len(last["tokens_response"]) - half)
    return rows


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, tiny_model_and_tokenizer) -> tuple[Path, list[dict[str, Any]]]:
    _, tokenizer = tiny_model_and_tokenizer
    rows = rollout_rows(tokenizer)
    path = write_rollout_report(rows, tmp_path_factory.mktemp("report") / "report.html", title="browser test", tokenizer=tokenizer)
    return path, rows


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,900",
                "--host-resolver-rules=MAP * ~NOTFOUND"):  # no name resolves: a page that needed the network would break
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def open_page(browser: Any, path: Path, fragment: str = "") -> None:
    browser.get("about:blank")  # a fresh load, even when only the fragment differs from the page shown
    browser.get(path.as_uri() + fragment)
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true"


def table_column(browser: Any, key: str) -> list[str]:
    """The listed rows' cells of one column, read in one call (a WebDriver call per cell takes seconds for 500)."""
    cells = f"#dialog-rows td[data-key={key}]"
    return browser.execute_script(f"return Array.from(document.querySelectorAll('{cells}'), td => td.textContent)")


def test_the_table_lists_every_dialog_and_loads_nothing(browser: Any, report: tuple[Path, list], tmp_path: Path) -> None:
    path, rows = report
    open_page(browser, path)
    num_dialogs = GROUPS * ANSWERS_PER_GROUP + 1
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.dialog-row")) == num_dialogs
    assert browser.find_element(By.ID, "row-count").text == f"{num_dialogs} of {num_dialogs} dialogs"
    assert browser.find_element(By.ID, "summary").text.startswith(f"{len(rows)} turns in {num_dialogs} dialogs")
    assert str(MULTI_TURN_TRAJ) in table_column(browser, "traj")  # exact, not rounded to a double
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []  # no script error
    assert browser.save_screenshot(str(tmp_path / "table.png"))


def test_sort_and_filter_by_reward_version_and_group(browser: Any, report: tuple[Path, list]) -> None:
    open_page(browser, report[0])
    header = browser.find_element(By.CSS_SELECTOR, "th[data-key=reward]")
    header.click()
    rewards = [float(x) for x in table_column(browser, "reward")]
    assert rewards == sorted(rewards, reverse=True) and header.get_attribute("aria-sort") == "descending"
    header.click()
    assert [float(x) for x in table_column(browser, "reward")] == sorted(rewards)

    browser.find_element(By.ID, "filter-reward-min").send_keys("0.5")
    assert all(float(x) >= 0.5 for x in table_column(browser, "reward")) and len(table_column(browser, "reward")) == 7
    browser.find_element(By.ID, "filter-clear").click()
    Select(browser.find_element(By.ID, "filter-version")).select_by_value("2")
    assert sorted(table_column(browser, "traj")) == sorted([str(MULTI_TURN_TRAJ)] + [str(8 + i) for i in range(4)])
    browser.find_element(By.ID, "filter-clear").click()

    browser.find_element(By.CSS_SELECTOR, "#dialog-rows tr:first-child .group-link").click()  # "show only this group"
    groups = table_column(browser, "group")
    assert len(groups) == ANSWERS_PER_GROUP and len(set(groups)) == 1
    assert browser.find_element(By.ID, "dialog").get_attribute("hidden") is not None  # the link filters, it opens nothing
    browser.find_element(By.ID, "filter-clear").click()
    assert len(table_column(browser, "group")) == GROUPS * ANSWERS_PER_GROUP + 1


def test_a_click_opens_the_dialog_turn_by_turn(browser: Any, report: tuple[Path, list], tmp_path: Path) -> None:
    path, rows = report
    turns = [r for r in rows if r["traj_id"] == MULTI_TURN_TRAJ]
    open_page(browser, path)
    panel = browser.find_element(By.ID, "dialog")
    assert not panel.is_displayed()
    browser.find_element(By.CSS_SELECTOR, f"tr.dialog-row[data-traj='{MULTI_TURN_TRAJ}']").click()
    assert panel.is_displayed()
    assert browser.find_element(By.ID, "dialog-title").text == f"Trajectory {MULTI_TURN_TRAJ}"
    shown = browser.find_elements(By.CSS_SELECTOR, "#turns .turn")
    assert len(shown) == len(turns)
    for element, row in zip(shown, turns):
        tokens = element.find_elements(By.CSS_SELECTOR, ".tok")
        assert len(tokens) == len(row["tokens_response"])
        assert "".join(t.get_attribute("textContent") for t in tokens) == row["response"]
        assert "log p " in tokens[0].get_attribute("title")
    assert "new prompt text" in shown[1].find_element(By.CSS_SELECTOR, ".label").text.lower()
    assert "Higher." in shown[1].find_element(By.CSS_SELECTOR, "pre.prompt").text

    last_turn_tokens = shown[-1].find_elements(By.CSS_SELECTOR, ".tok")
    sure, unsure = last_turn_tokens[0].value_of_css_property("background-color"), last_turn_tokens[-1].value_of_css_property("background-color")
    assert sure != unsure  # log-prob -0.05 vs -7.5
    assert browser.save_screenshot(str(tmp_path / "dialog.png"))

    browser.find_element(By.CSS_SELECTOR, "input[name=colour-by][value=version]").click()
    recoloured = browser.find_elements(By.CSS_SELECTOR, "#turns .turn:last-child .tok")
    colours = [t.value_of_css_property("background-color") for t in recoloured]
    half = len(colours) // 2
    assert len(set(colours[:half])) == 1 and len(set(colours[half:])) == 1 and colours[0] != colours[-1]  # token versions 1 | 2
    assert browser.find_element(By.ID, "version-mode-label").text == "version (per token)"

    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    assert not panel.is_displayed()


def test_the_url_fragment_opens_a_dialog(browser: Any, report: tuple[Path, list]) -> None:
    open_page(browser, report[0], f"#traj={MULTI_TURN_TRAJ}")
    assert browser.find_element(By.ID, "dialog").is_displayed()
    assert browser.find_element(By.ID, "dialog-title").text == f"Trajectory {MULTI_TURN_TRAJ}"
    browser.find_element(By.ID, "dialog-prev").click()  # previous in table order: the last one-turn dialog
    assert browser.find_element(By.ID, "dialog-title").text == f"Trajectory {GROUPS * ANSWERS_PER_GROUP - 1}"


def test_a_long_table_is_listed_in_pages_and_untokenized_turns_show_ids(browser: Any, tmp_path: Path) -> None:
    num_dialogs = 510  # the page lists 500 rows at a time
    rows = [
        {"traj_id": traj_id, "step": 0, "prompt": SYSTEM, "response": "guess 7", "tokens_response": [70, 71, 72],
         "log_probs": [-0.1, -2.0, -9.0], "reward": traj_id / num_dialogs, "policy_version": 0}
        for traj_id in range(num_dialogs)
    ]
    open_page(browser, write_rollout_report(rows, tmp_path / "long.html"))
    assert len(table_column(browser, "traj")) == 500
    assert browser.find_element(By.ID, "row-count").text == f"{num_dialogs} of {num_dialogs} dialogs (first 500 listed)"
    browser.find_element(By.ID, "show-more").click()
    assert len(table_column(browser, "traj")) == num_dialogs and not browser.find_element(By.ID, "show-more").is_displayed()

    browser.find_element(By.CSS_SELECTOR, "tr.dialog-row:last-child").click()
    assert browser.find_element(By.ID, "dialog-title").text == f"Trajectory {num_dialogs - 1}"
    assert [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#turns .tok.id")] == ["70", "71", "72"]
    assert browser.find_element(By.CSS_SELECTOR, "#turns pre.response-text").text == "guess 7"

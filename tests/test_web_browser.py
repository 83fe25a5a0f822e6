"""The web page in a real headless browser (Debian's chromium + chromedriver, selenium).

Runs where ``chromium`` and ``chromedriver`` are on PATH (CI's .ci/run installs Debian's
chromium and chromium-driver; `make test` never installs system packages) and skips with
a one-line reason elsewhere. The screenshots land in tests/artifacts/.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from timing import scaled

from planner_service.core.request import PlanRequest, debug_request
from planner_service.service.testing import ServerProcess
from planner_service.solvers.registry import solve, strategy_names

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[dev]')")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="chromium or chromedriver not on PATH (Debian: apt-get install chromium "
        "chromium-driver; .ci/run installs them)"),
    pytest.mark.slow,  # a browser and a server start: start it early under xdist
]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(workers=1, grpc=False, startup_timeout_s=scaled(90)) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="planner-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(scaled(30))
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def plan_id_shown(driver) -> str | None:
    """The drawn plan's id; None while none is drawn or the drawing is being replaced (the
    page swaps the svg between the lookup and the read: a stale element)."""
    svgs = driver.find_elements(By.CSS_SELECTOR, "#plan-view svg.plan-svg")
    try:
        return svgs[0].get_attribute("data-plan-id") if svgs else None
    except StaleElementReferenceException:
        return None


def test_page_draws_sample_replans_new_input_and_compares(server, browser):
    # A lookup may race the page replacing a drawing: retry rather than fail.
    wait = WebDriverWait(browser, scaled(30), ignored_exceptions=(StaleElementReferenceException,))
    browser.get(server.http_url + "/")
    sample = solve(debug_request(context_length=None))
    wait.until(lambda d: plan_id_shown(d) == sample.plan_id)
    shards = browser.find_elements(By.CSS_SELECTOR, "#plan-view rect.shard")
    assert len(shards) == sample.metrics.num_shards
    ranks = {s.get_attribute("data-rank") for s in shards}
    assert ranks == {"0", "1", "2", "3"}
    assert browser.find_elements(By.CSS_SELECTOR, "#plan-view rect.sent")  # KV highlighted
    assert "imbalance" in browser.find_element(By.ID, "plan-view").text

    # New input: different lengths, N = 2, another strategy.
    lengths = [30000, 700, 12000, 5, 9000]
    box = browser.find_element(By.ID, "lengths")
    box.clear()
    box.send_keys(", ".join(map(str, lengths)))
    cp = browser.find_element(By.ID, "cp")
    cp.clear()
    cp.send_keys("2")
    browser.find_element(By.CSS_SELECTOR, "#strategy option[value='per_doc']").click()
    browser.find_element(By.ID, "plan-btn").click()
    expected = solve(PlanRequest(doc_lengths=tuple(lengths), cp_size=2, strategy="per_doc"))
    wait.until(lambda d: plan_id_shown(d) == expected.plan_id)
    rows = {s.get_attribute("data-rank")
            for s in browser.find_elements(By.CSS_SELECTOR, "#plan-view rect.shard")}
    assert rows == {"0", "1"}
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "web_plan.png"))

    browser.find_element(By.ID, "compare-btn").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#compare-view svg.plan-svg"))
               == len(strategy_names()))
    drawn = [s.get_attribute("data-strategy")
             for s in browser.find_elements(By.CSS_SELECTOR, "#compare-view svg.plan-svg")]
    assert drawn == strategy_names()
    assert browser.save_screenshot(str(ARTIFACTS / "web_compare.png"))

    # Bad input is reported on the page, and the server stays healthy.
    box = browser.find_element(By.ID, "lengths")
    box.clear()
    box.send_keys("12, -4")
    browser.find_element(By.ID, "plan-btn").click()
    wait.until(lambda d: "doc_lengths" in d.find_element(By.ID, "status").text)
    browser.get(server.http_url + "/healthz")
    assert "ok" in browser.page_source

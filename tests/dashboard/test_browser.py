"""The dashboard in a real browser: headless Chromium (the system's, driven by Playwright) against
`streamlit run` and a live control plane.

Screenshots of every page are saved to ``SPECGATE_SCREENSHOT_DIR`` (default: the test's tmp dir).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import playwright.sync_api as playwright_sync
import pytest

from dashboard import launch
from tests.support import dashboard_seed as seed
from tests.support.dashboard_live import LiveControlPlane
from tests.support.live import free_port

CHROMIUM = Path("/usr/bin/chromium")
WAIT_MS = 60_000  # generous: two cores shared with other work


@pytest.fixture(autouse=True)
def _chromium_is_installed() -> None:
    # A missing browser is a broken set-up, not a reason to pass quietly: `make test` installs it.
    assert CHROMIUM.exists(), "Debian's chromium is missing at /usr/bin/chromium (make test installs it)"


@pytest.fixture
def dashboard_url(live_control_plane: LiveControlPlane, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("SPECGATE_DASHBOARD_PAGE_SIZE", "10")  # the audit log of the journey spans pages
    port = free_port()
    log = tmp_path / "streamlit.log"
    process = launch.start(port=port, api_url=live_control_plane.url, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        assert launch.wait_ready(url, process, timeout_s=90), f"the dashboard did not start:\n{log.read_text()}"
        yield url
    finally:
        process.terminate()
        try:
            process.wait(15)
        except Exception:
            process.kill()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("SPECGATE_SCREENSHOT_DIR") or tmp_path / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture
def browser() -> Iterator[object]:
    with playwright_sync.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            yield instance
        finally:
            instance.close()


def _sign_in(page: object, url: str, key: str) -> None:
    p: playwright_sync.Page = page  # type: ignore[assignment]
    p.goto(url)
    p.get_by_text("Sign in with an API key").wait_for(timeout=WAIT_MS)
    p.get_by_label("API key").fill(key)
    p.get_by_role("button", name="Sign in").click()
    p.get_by_text("Signed in as").wait_for(timeout=WAIT_MS)


def _goto(page: playwright_sync.Page, title: str) -> None:
    page.get_by_role("link", name=title).click()
    page.get_by_role("heading", name=title, level=1).wait_for(timeout=WAIT_MS)


def _editor(page: playwright_sync.Page, text: str) -> None:
    editor = page.get_by_role("textbox", name="Policy document (YAML)")
    editor.fill(text)
    editor.press("Control+Enter")


_BUSY = ("[data-testid='stElementContainer'][data-stale='true'], [data-testid='stSkeleton'], "
         "[data-testid='stSkeletonElement'], [data-testid='stAppSkeleton']")


def _settled(page: playwright_sync.Page) -> None:
    """Wait until the page has finished drawing: nothing left of the previous run, no placeholder of a
    widget still loading."""
    page.wait_for_function(f"() => !document.querySelector({_BUSY!r})", timeout=WAIT_MS)


def _press(form: playwright_sync.Locator, name: str) -> None:
    _settled(form.page)
    form.get_by_role("button", name=name).click()


def _confirm(form: playwright_sync.Locator, reason: str) -> None:
    _settled(form.page)
    form.get_by_label("Reason (goes to the audit log)").fill(reason)
    form.get_by_text("I confirm").click()


def _shot(page: playwright_sync.Page, where: Path, name: str) -> None:
    _settled(page)
    page.screenshot(path=str(where / f"{name}.png"), full_page=True)


def test_sign_in_edit_roll_out_roll_back_and_audit(live_control_plane: LiveControlPlane, dashboard_url: str,
                                                   browser: playwright_sync.Browser, shots: Path) -> None:
    cp = live_control_plane
    seeded = seed.seed_all(cp.url, cp.admin, cp.worker, minutes=60, per_minute=25)
    _gateway(cp)
    page = browser.new_page(viewport={"width": 1440, "height": 1800})
    page.set_default_timeout(WAIT_MS)
    try:
        _journey(page, browser, cp, seeded, dashboard_url, shots)
    except Exception:
        page.screenshot(path=str(shots / "failure.png"), full_page=True)
        raise


def _gateway(cp: LiveControlPlane) -> None:
    """A gateway of the seeded pool reporting one ejected replica, for the overview's replicas table."""
    with httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {cp.worker}"}, timeout=30) as api:
        api.post("/v1/workers/register", json={"id": "fleet-gw-1", "pool": "fleet", "kind": "gateway",
                                               "engines": {"base": "pool"}}).raise_for_status()
        api.post("/v1/workers/fleet-gw-1/heartbeat", json={"replicas": [
            {"engine": "base", "replica": "10.0.0.7:8000", "state": "ejected", "consecutive_failures": 3,
             "ejections": 1, "next_probe_in_s": 5.0}]}).raise_for_status()


def _journey(page: playwright_sync.Page, browser: playwright_sync.Browser, cp: LiveControlPlane,
             seeded: seed.Seeded, dashboard_url: str, shots: Path) -> None:

    _sign_in(page, dashboard_url, cp.admin)
    page.get_by_text("Signed in as admin:alice").wait_for()
    page.get_by_text("Last hour").wait_for()
    page.get_by_text("Does speculation pay here?").wait_for()
    # The seeded policy explores request by request: the overview says what that cannot show.
    page.get_by_text("explores request by request").wait_for()
    page.get_by_text("Rollouts in progress").wait_for()
    page.get_by_text("fleet-gpu-5").wait_for(state="attached")  # a cell of a data grid: in the DOM, drawn on canvas
    page.get_by_text("Replicas, as each worker and gateway last reported them").wait_for()
    page.get_by_text("10.0.0.7:8000").wait_for(state="attached")  # the gateway's replica row
    _shot(page, shots, "1-overview")

    # A revision with a validation error: the error shows at its path and line; then fixed and saved.
    _goto(page, "Policies")
    page.get_by_text("Valid.").first.wait_for()
    source = (seed.EXAMPLES / "multi-route.yaml").read_text()
    broken = source.replace("batch_size: {max: 4}", "batch_size: {min: 5, max: 4}")
    _editor(page, broken)
    page.get_by_text(f"rules[2].when.batch_size.max (line {seed.line_of(source, 'batch_size: {max: 4}')})").wait_for()
    page.get_by_text("inverted_range").wait_for()
    _shot(page, shots, "2-policies-invalid")
    fixed = source.replace("batch_size: {max: 4}", "batch_size: {max: 5}")
    _editor(page, fixed)
    page.get_by_text("Valid. Saved, it would become revision").wait_for()
    page.get_by_text("rules changed: chat-draft-small-batch").wait_for()
    page.get_by_label("Message (why this revision exists)").fill("chat speculates up to batch 5")
    _settled(page)
    page.get_by_role("button", name="Save as draft revision").click()
    page.get_by_text(re.compile(r"Revision #3 [0-9a-f]{12} of fleet saved; it is a draft")).wait_for()
    _shot(page, shots, "3-policies-saved")
    policy = httpx.get(f"{cp.url}/v1/policies/fleet", headers={"Authorization": f"Bearer {cp.admin}"}).json()
    new_revision = policy["head_revision_id"]
    assert new_revision not in (seeded.active, seeded.draft)

    # A rollout of it: refused without a reason, started with one, promoted to completion.
    _goto(page, "Rollouts")
    start = page.locator("[data-testid='stForm']").filter(has_text="Start rollout")
    start.get_by_label("Steps (percent, comma separated, last 100)").fill("50,100")
    _press(start, "Start rollout")
    page.get_by_text("A reason is required").wait_for()
    _confirm(start, "canary: chat up to batch 5")
    _press(start, "Start rollout")
    page.get_by_text(re.compile(r"Rollout of fleet to [0-9a-f]{12} started at 50%")).wait_for()
    _shot(page, shots, "4-rollouts")
    running = page.locator("[data-testid='stForm']").filter(has_text="change the rollout of fleet")
    _confirm(running, "canary looks good")
    _press(running, "Apply")
    page.get_by_text("promote done; it is now running (100%)").wait_for()
    # Each change asks again: the form is empty after the last one.
    _press(running, "Apply")
    page.get_by_text("A reason is required").wait_for()
    _confirm(running, "all workers look good")
    _press(running, "Apply")
    page.get_by_text("promote done; it is now completed").wait_for()

    # Roll back to the first revision.
    back = page.locator("[data-testid='stForm']").filter(has_text="Roll back")
    _settled(page)
    back.get_by_role("combobox").click()
    page.get_by_role("option", name=re.compile(r"^#1 ")).click()
    _confirm(back, "p95 regressed on chat")
    _press(back, "Roll back")
    page.get_by_text(re.compile(r"fleet rolled back to " + seeded.active[:12])).wait_for()
    active = httpx.get(f"{cp.url}/v1/policies/fleet", headers={"Authorization": f"Bearer {cp.admin}"}).json()
    assert active["active_revision_id"] == seeded.active

    _goto(page, "Audit log")
    page.get_by_text("policy.rollback").first.wait_for(state="attached")
    _shot(page, shots, "5-audit")
    older = page.get_by_role("button", name="Older")
    playwright_sync.expect(older).to_be_enabled()
    page.get_by_label("Search (reason, action, actor, target, before/after)").fill("p95 regressed")
    page.get_by_label("Search (reason, action, actor, target, before/after)").press("Enter")
    page.get_by_text("Page 1, newest first").wait_for()
    page.get_by_text("p95 regressed on chat").first.wait_for(state="attached")
    playwright_sync.expect(older).to_be_disabled(timeout=WAIT_MS)  # the search left one page: the rollback

    _goto(page, "Telemetry")
    page.locator("[data-testid='stVegaLiteChart']").nth(3).wait_for()
    page.get_by_text("requests in the window").wait_for()
    page.locator("[data-testid='stVegaLiteChart']").nth(4).wait_for()
    page.get_by_role("heading", name="Shadow comparisons").wait_for()
    page.get_by_text("No shadow comparisons in this window").wait_for()
    _shot(page, shots, "6-telemetry")

    _goto(page, "Recommendations")
    page.get_by_text(re.compile(r"Analysis not available|For the active revision")).first.wait_for()
    page.get_by_text(re.compile(r"Analysis not available|Score a revision")).first.wait_for()
    page.get_by_role("heading", name="Autopilot").wait_for()
    page.get_by_role("button", name="Save autopilot").wait_for()
    _shot(page, shots, "7-recommendations")

    # A viewer sees the same pages with every control disabled.
    viewer = browser.new_page(viewport={"width": 1440, "height": 1400})
    viewer.set_default_timeout(WAIT_MS)
    _sign_in(viewer, dashboard_url, cp.viewer)
    _goto(viewer, "Rollouts")
    viewer.get_by_text("you can look, the controls on this page need").wait_for()
    assert viewer.get_by_role("button", name="Roll back").is_disabled()
    assert viewer.get_by_role("button", name=re.compile("Turn the kill switch")).is_disabled()
    _shot(viewer, shots, "8-rollouts-viewer")

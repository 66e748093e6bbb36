"""Makes the dashboard's pictures in docs/, photographed in headless Chromium (the system's, as the tests drive it).

- dashboard.png: `quotawrap demo` into a fresh ledger, then the page on it.
- dashboard-in-flight.png: the demo's agent against the bundled simulator with a free balance of 60,000
  synced through the billing API after its first run (and the balance wall off, which that balance is
  under), photographed while its second run is under way: calls settled, in flight and waiting, and v6's
  limit above the lag-aware one.

Run: .venv/bin/python docs/dashboard_screenshot.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from quotawrap.simulator import PackageSpec, SimConfig, serve

DOCS = Path(__file__).resolve().parent
AGENT = DOCS.parent / "examples" / "agent.py"
QUOTAWRAP = [sys.executable, "-m", "quotawrap"]
MODEL = "deepseek-v4-flash"


def photograph(store: str, out: Path, ready: Callable[[Page], None]) -> None:
    """The dashboard on ``store``, photographed once ``ready`` returns."""
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("chromium is not installed: make chromium (Debian: apt-get install chromium)")
    server = subprocess.Popen(
        [*QUOTAWRAP, "dashboard", "--store", store, "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        found = re.search(r"on (http://\S+)", server.stdout.readline())
        assert found, "the dashboard did not start"
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page(viewport={"width": 1100, "height": 800})
            page.goto(found.group(1))
            page.wait_for_selector("#freshness[data-state=ok]")
            ready(page)
            page.screenshot(path=str(out), full_page=True)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"wrote {out}")


def after_the_demo(tmp: Path) -> None:
    store = f"sqlite:///{tmp / 'demo.sqlite3'}"
    subprocess.run([*QUOTAWRAP, "demo", "--store", store], check=True, capture_output=True)
    photograph(store, DOCS / "dashboard.png", lambda page: None)


def in_flight(tmp: Path) -> None:
    store = f"sqlite:///{tmp / 'in-flight.sqlite3'}"
    now = time.time()
    with serve(config=SimConfig(packages=(PackageSpec(MODEL, 60_000, now - 86_400, now + 20 * 86_400),))) as sim:
        env = {**os.environ, "ARK_BASE_URL": sim.url, "ARK_API_KEY": "simulated", "DEMO_CALLS": "24"}
        env.update(VOLC_ACCESSKEY="AKsimulated", VOLC_SECRETKEY="SKsimulated")  # the simulator's billing API
        # a balance under the balance wall (100,000) evicts the model once used: the wall is off here
        os.environ["QUOTAWRAP_BALANCE_WALL"] = env["QUOTAWRAP_BALANCE_WALL"] = "0"
        run = [*QUOTAWRAP, "--store", store, "--base-url", sim.url, "--model", MODEL]
        subprocess.run([*run, "--", sys.executable, str(AGENT)], env=env, check=True, capture_output=True)
        sync = [*QUOTAWRAP, "sync", "--store", store, "--billing-endpoint", sim.base_url, "--model", MODEL]
        subprocess.run(sync, env=env, check=True, capture_output=True)
        sim.patch_config({"chunk_delay_s": 0.25})  # the second run's streams stay in flight a while
        agent = subprocess.Popen(
            [*run, "--", sys.executable, str(AGENT)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:

            def busy(page: Page) -> None:
                page.wait_for_function(
                    """() => [...document.querySelectorAll('[data-field="in_flight"], [data-field="waiting"]')]
                        .every((node) => Number(node.textContent.replace(/,/g, "")) > 0)""",
                    timeout=120_000,
                )

            photograph(store, DOCS / "dashboard-in-flight.png", busy)
        finally:
            agent.wait(timeout=600)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        after_the_demo(Path(tmp))
        in_flight(Path(tmp))


if __name__ == "__main__":
    main()

"""Makes docs/dashboard.png: `quotawrap demo` into a fresh ledger, then the dashboard on it, photographed in
headless Chromium (the system's, as the tests drive it). Run: .venv/bin/python docs/dashboard_screenshot.py"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

OUT = Path(__file__).resolve().parent / "dashboard.png"


def main() -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("chromium is not installed: make chromium (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{Path(tmp) / 'ledger.sqlite3'}"
        quotawrap = [sys.executable, "-m", "quotawrap"]
        subprocess.run([*quotawrap, "demo", "--store", store], check=True, capture_output=True)
        server = subprocess.Popen(
            [*quotawrap, "dashboard", "--store", store, "--port", "0"], stdout=subprocess.PIPE, text=True
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
                page.screenshot(path=str(OUT), full_page=True)
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

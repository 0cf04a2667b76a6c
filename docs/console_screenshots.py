"""Take the README's console screenshots (docs/console-*.png) from a running pipeline.

    make run                       # in one terminal
    .venv/bin/webhooks demo        # in another
    WEBHOOKS_CONSOLE_TOKEN=... .venv/bin/python docs/console_screenshots.py [ADMIN_URL]

The token is one of WEBHOOKS_ADMIN_TOKENS (read from the environment, never an argument).
Drives Debian's /usr/bin/chromium through Playwright, as the console's tests do.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

HERE = Path(__file__).resolve().parent
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]  # fmt: skip


def main() -> None:
    base = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8001").rstrip("/")
    token = os.environ["WEBHOOKS_CONSOLE_TOKEN"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{base}/console/login")
        page.fill("#token", token)
        page.click("button[type=submit]")
        page.wait_for_url(f"{base}/console/")

        def shot(name: str) -> None:
            path = HERE / f"console-{name}.png"
            page.screenshot(path=str(path), full_page=True)
            print(path)  # noqa: T201  (a script: it says what it wrote)

        shot("overview")
        page.goto(f"{base}/console/events")
        shot("events")
        page.click("#events tbody a")
        shot("event")
        page.goto(f"{base}/console/dead")
        shot("dead-letters")
        page.click("#dead tbody td:nth-child(2) a")
        shot("delivery")
        browser.close()


if __name__ == "__main__":
    main()

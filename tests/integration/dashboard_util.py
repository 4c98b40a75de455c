"""The Ray dashboard in headless Chromium, as a person sees it (not a test module): the browser,
the dashboard's URL and the token a person logs in with, shared by the dashboard tests."""
from __future__ import annotations

import pytest


def _browser():
    """Headless Debian Chromium driven by its chromedriver; skipped without them unless
    PDSERVE_REQUIRE_CHROMIUM=1 (CI installs them, so there it must run)."""
    import os
    import shutil

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        chromium = None
    if not (chromium and driver):
        reason = "needs Debian's chromium and chromium-driver and the selenium package"
        if os.environ.get("PDSERVE_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"PDSERVE_REQUIRE_CHROMIUM=1 but the test {reason}")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--window-size=1800,1100"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def _dashboard_url() -> str:
    import ray

    return "http://" + ray._private.worker.global_worker.node.address_info["webui_url"]


def _token() -> str:
    from pathlib import Path

    return (Path.home() / ".ray" / "auth_token").read_text().strip()


def _xpath_literal(s: str) -> str:
    return f"'{s}'" if "'" not in s else f'"{s}"'

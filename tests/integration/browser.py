"""Headless Chromium from Debian's packages (`chromium`, `chromium-driver`), driven by selenium.

Installed with apt-get on first use when missing (CI runs as root and reaches Debian's
archive); a file lock keeps parallel test runs from installing at once. Without apt-get, root or
the archive the browser tests are skipped on a developer's machine and fail in CI (`CI` set), as
the real-client tests do (clis.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from tests.integration.clis import locked, unavailable

PACKAGES = ("chromium", "chromium-driver")
INSTALL_TIMEOUT_S = 900
LOCK = Path("/tmp/dflash-test-chromium.lock")


def chromium_paths() -> tuple[str, str]:
    """(the browser, its driver), installed from Debian's packages if missing."""
    with locked(LOCK):
        if not _found():
            _apt_install()
        browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
        if browser is None or driver is None:
            unavailable(f"apt-get installed {' '.join(PACKAGES)}, but chromium or chromedriver is not on PATH")
    return browser, driver


def headless_chromium(width: int = 1280, height: int = 900) -> webdriver.Chrome:
    """A headless browser whose console messages `driver.get_log("browser")` returns."""
    browser, driver = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={width},{height}", "--no-first-run", "--disable-extensions",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver's path is given, so selenium's manager never looks for one on the internet.
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def _found() -> bool:
    return shutil.which("chromium") is not None and shutil.which("chromedriver") is not None


def _apt_install() -> None:
    apt_get = shutil.which("apt-get")
    if apt_get is None:
        unavailable(f"chromium is missing and there is no apt-get to install {' '.join(PACKAGES)}")
    if os.geteuid() != 0:
        unavailable(f"chromium is missing and installing {' '.join(PACKAGES)} with apt-get needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [apt_get, "install", "-y", "--no-install-recommends", *PACKAGES]
    try:
        done = subprocess.run(install, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=env)
        if done.returncode != 0:  # stale package lists: refresh once and try again
            subprocess.run([apt_get, "update"], capture_output=True, timeout=INSTALL_TIMEOUT_S, env=env)
            done = subprocess.run(install, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        unavailable(f"apt-get install {' '.join(PACKAGES)} took over {INSTALL_TIMEOUT_S}s")
    if done.returncode != 0:
        unavailable(f"apt-get install {' '.join(PACKAGES)} failed ({done.returncode}): {done.stderr[-1500:]}")

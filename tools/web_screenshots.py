#!/usr/bin/env python
"""Screenshots of the playground and the dashboard for the README: starts the stories260K server, chats once,
puts a little load on it, and saves docs/img/playground.png and docs/img/dashboard.png (headless Chromium).

    python tools/web_screenshots.py [--model DIR] [--config YAML]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llm_serving.server_process import ServerProcess, http  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K" / "hf"))
    p.add_argument("--config", default=str(REPO / "configs" / "stories260K.yaml"))
    p.add_argument("--out", default=str(REPO / "docs" / "img"))
    args = p.parse_args(argv)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,820"):
        options.add_argument(arg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with ServerProcess(["--config", args.config, "--model", args.model], out / "screenshots-server.log") as srv:
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        try:
            wait = WebDriverWait(driver, 60)
            driver.get(srv.url + "/")
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
            driver.find_element(By.ID, "system").send_keys("You tell short stories.")
            for field, value in (("temperature", "0.8"), ("max_tokens", "80")):
                driver.find_element(By.ID, field).clear()
                driver.find_element(By.ID, field).send_keys(value)
            driver.find_element(By.ID, "input").send_keys("Tell me a story about a dog and a ball.")
            driver.find_element(By.ID, "send").click()
            wait.until(lambda d: any("tokens" in s.text for s in d.find_elements(By.CSS_SELECTOR, ".stats")))
            driver.save_screenshot(str(out / "playground.png"))

            def load():
                while not done.is_set():
                    http("POST", srv.url + "/generate", {"inputs": "Once upon a time",
                                                         "parameters": {"max_new_tokens": 200, "ignore_eos": True}})
            done = threading.Event()
            threads = [threading.Thread(target=load) for _ in range(8)]
            driver.get(srv.url + "/dashboard")
            for t in threads:
                t.start()
            time.sleep(15)
            driver.save_screenshot(str(out / "dashboard.png"))
            done.set()
            for t in threads:
                t.join()
        finally:
            driver.quit()
    (out / "screenshots-server.log").unlink(missing_ok=True)
    print(f"wrote {out / 'playground.png'} and {out / 'dashboard.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The live run page (app/live/): what it reads of a run directory, the files and the WebSocket it
serves (and to whom), the MQTT feed, and the page in a real headless browser (Debian's chromium)
whose curve grows while a federation runs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from app.live.feed import Feed
from app.live.runs import RunView, Tail, find_run_dirs
from app.live.server import LiveServer
from app.tools.broker import LocalBroker, missing
from app.tools.in_process import run_in_process
from tests.helpers import ROOT

FAST = "federation.rounds={rounds} train.epochs=1 seed=5"
ARTIFACTS = Path(os.environ.get("FEDGPU_TEST_ARTIFACTS", ROOT / "test-artifacts"))  # git ignores it


class Served:
    """A LiveServer on a free loopback port, in a thread of its own, until `close()`."""

    def __init__(self, root: Path, feed: Feed | None = None) -> None:
        self.server = LiveServer(root, interval=0.2, feed=feed)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def main() -> None:
            started = asyncio.Event()
            task = asyncio.create_task(self.server.run(0, started))
            await started.wait()
            ready.set()
            await task

        self.thread = threading.Thread(target=lambda: self._run(main()), daemon=True)
        self.thread.start()
        assert ready.wait(60), "the live server did not start"
        self.url = f"http://127.0.0.1:{self.server.port}/"

    def _run(self, coro) -> None:  # noqa: ANN001
        self.task = self.loop.create_task(coro)
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(timeout=30)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path / "runs")
    try:
        yield s
    finally:
        s.close()


def test_a_run_directory_read_as_it_grows(tmp_path):
    summary, _ = run_in_process(FAST.format(rounds=2) + " ledger.contribution=loo", tmp_path, nodes=3)
    run = Path(summary["run_dir"])
    assert find_run_dirs(tmp_path) == [run] and find_run_dirs(run) == [run]
    view = RunView.of_dir(run)
    assert view.poll() and not view.poll()  # everything at once, then nothing new
    shown = view.as_dict()
    assert (shown["status"], shown["step"], shown["planned"], shown["primary"]) == ("completed", 2, 2, "accuracy")
    assert [r["round"] for r in shown["rows"]] == [1, 2] and shown["metric"] == summary["final_metric"]
    assert set(shown["nodes"]) == {"1000", "1001", "1002"}
    assert all(
        n["applied"] == 2 and n["examples"] > 0 and n["contribution"] is not None for n in shown["nodes"].values()
    )


def test_a_torn_line_waits_for_its_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = Tail(path)
    assert tail.new() == []  # no file yet
    path.write_text('{"round": 1}\n{"round": 2, "lo')
    assert tail.new() == [{"round": 1}]
    with path.open("a") as f:
        f.write('ss": 0.5}\n')
    assert tail.new() == [{"round": 2, "loss": 0.5}]


def test_alerts_of_a_run_on_disk(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text(
        "strategy:\n  name: fedavg\nfederation:\n  rounds: 3\n  target_value: 0.9\n  target_metric: null\n"
        "  target_accuracy: 0.0\nprivacy:\n  max_epsilon: 0.0\ntask:\n  metrics: [accuracy]\n"
    )
    rows = [
        {"round": 1, "accuracy": 0.5, "rejected": [{"node_id": 4, "reason": "non-finite values"}]},
        {"round": 2, "accuracy": 0.95, "model_updated": True},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    view = RunView.of_dir(run)
    view.poll()
    assert [(a["alert"], a["step"]) for a in view.alerts] == [("node_rejected", 1), ("target_reached", 2)]


def test_the_page_its_files_and_nothing_else_are_served(served):
    import urllib.error
    import urllib.request

    with urllib.request.urlopen(served.url) as page:
        assert page.headers["Content-Type"].startswith("text/html") and b"live.js" in page.read()
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    for name in ("live.js", "live.css", "uPlot.iife.min.js", "uPlot.min.css"):
        with urllib.request.urlopen(served.url + "static/" + name) as f:
            assert f.status == 200 and len(f.read()) > 100
    for path in ("static/../runs.py", "static/%2e%2e/runs.py", "runs.py", "static/nope.js", "etc/passwd"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(served.url + path)
        assert err.value.code == 404, path


def test_only_the_pages_own_origin_may_open_the_websocket(served, tmp_path):
    summary, _ = run_in_process(FAST.format(rounds=1), tmp_path / "runs", nodes=2)
    ws_url = f"ws://127.0.0.1:{served.server.port}/ws"
    with pytest.raises(InvalidStatus) as err:
        connect(ws_url, origin="http://evil.example")
    assert err.value.response.status_code == 403
    with pytest.raises(InvalidStatus):
        connect(ws_url)  # no Origin: not a page of ours either
    deadline = time.monotonic() + 60
    while True:  # the server's next look (interval 0.2 s) reads the finished run's summary
        with connect(ws_url, origin=served.url.rstrip("/")) as ws:
            snapshot = json.loads(ws.recv(timeout=60))
        if any(r["status"] == "completed" for r in snapshot["runs"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert snapshot["type"] == "snapshot"
    (run,) = snapshot["runs"]
    assert run["name"] == Path(summary["run_dir"]).name and run["status"] == "completed" and len(run["rows"]) == 1


def test_runs_known_only_from_the_status_channel(tmp_path, monkeypatch):
    """A server elsewhere: the page's root is empty, the runs come from the broker."""
    if (why := missing()) is not None:
        pytest.skip(why)
    broker = LocalBroker(tmp_path / "broker")
    for key, value in broker.node_env().items():
        monkeypatch.setenv(key, value)
    feed = Feed(broker.watcher())
    (tmp_path / "empty").mkdir()
    served = Served(tmp_path / "empty", feed)
    try:
        deadline = time.monotonic() + 60
        while not feed.client.is_connected():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        summary, _ = run_in_process(
            FAST.format(rounds=2) + " " + " ".join(broker.overrides()), tmp_path / "runs", nodes=2
        )
        name = Path(summary["run_dir"]).name
        deadline = time.monotonic() + 60
        while (view := served.server.views.get(name)) is None or view.status != "completed":
            assert time.monotonic() < deadline, served.server.views.keys()
            time.sleep(0.1)
    finally:
        served.close()
        feed.close()
        broker.stop()
    shown = view.as_dict()
    assert [r["round"] for r in shown["rows"]] == [1, 2] and shown["metric"] == summary["final_metric"]
    assert {n["heartbeat"] for n in shown["nodes"].values()} == {"train finished"}


def _browser():  # noqa: ANN202
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip(
            "no `chromium` / `chromedriver` on PATH (Debian's chromium and chromium-driver; .ci/run installs them)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(driver))  # the given driver: nothing downloaded


def test_the_page_in_a_browser_shows_a_running_federations_curve_grow(tmp_path):
    """Debian's chromium, headless: the page loads, lists the run, and its chart gains points while
    the federation runs (WebSocket updates, no reload); the screenshot is kept in test-artifacts/."""
    browser = _browser()
    root = tmp_path / "runs"
    root.mkdir()
    served = Served(root)
    done: dict = {}
    federation = threading.Thread(
        target=lambda: done.update(run_in_process(FAST.format(rounds=8) + " train.epochs=2", root, nodes=3)[0]),
        daemon=True,
    )
    try:
        browser.get(served.url)
        federation.start()
        points = lambda: int(browser.find_element("id", "chart-step").get_attribute("data-points") or 0)  # noqa: E731
        deadline = time.monotonic() + 300
        while points() < 1:
            assert time.monotonic() < deadline, browser.page_source[-2000:]
            time.sleep(0.2)
        first = points()
        seen = [first]
        while federation.is_alive() or points() > seen[-1]:
            if points() != seen[-1]:
                seen.append(points())
            assert time.monotonic() < deadline
            time.sleep(0.2)
        seen.append(points())
        rows = [r.text for r in browser.find_elements("css selector", "#runs tbody tr")]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "live-page.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        browser.quit()
        served.close()
        federation.join(timeout=600)
    assert done["status"] == "completed"
    assert first < 8 and seen[-1] == 8 and len(set(seen)) >= 3, seen  # it grew, in steps, to every round
    assert len(rows) == 1 and "completed" in rows[0], rows
    assert not errors, errors
    assert (ARTIFACTS / "live-page.png").stat().st_size > 10_000

"""The live run page (app/live/): what it reads of a run directory, the files and the WebSocket it
serves (and to whom), the MQTT feed, and the page in a real headless browser (Debian's chromium)
whose curve grows while a federation runs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from app.live import runs as runs_module
from app.live.feed import MAX_HEARTBEAT, Feed, NodeLogins
from app.live.runs import RunView, Tail, find_run_dirs
from app.live.server import LiveServer
from app.status.channel import Broker, paho_client
from app.status.schema import VERSION, payload
from app.tools.broker import LocalBroker, missing
from app.tools.in_process import run_in_process
from tests.helpers import ROOT

FAST = "federation.rounds={rounds} train.epochs=1 seed=5"
ARTIFACTS = Path(os.environ.get("FEDGPU_TEST_ARTIFACTS", ROOT / "test-artifacts"))  # git ignores it


def strict(text: str):  # noqa: ANN201
    """JSON as a browser's JSON.parse reads it: no NaN, Infinity or -Infinity."""
    return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"not JSON: {c}")))


class Served:
    """A LiveServer on a free loopback port, in a thread of its own, until `close()`; `url` is the
    address the command prints (with the token), `base` the bare one."""

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
        self.base = f"http://127.0.0.1:{self.server.port}/"
        self.url = f"{self.base}?token={self.server.token}"
        self.ws = f"ws://127.0.0.1:{self.server.port}/ws"

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


def test_a_torn_tail_is_read_once_and_a_too_long_line_is_skipped(tmp_path, monkeypatch, caplog):
    """Issue 48, finding 13: a torn last line is kept from where the last poll stopped, not read
    again whole every poll; a line longer than runs.MAX_LINE is skipped (counted, with a warning);
    a poll reads at most runs.READ_MAX bytes, so a big file is taken in bounded steps."""
    caplog.set_level(logging.WARNING, logger="flwr.fedgpu")
    monkeypatch.setattr(runs_module, "MAX_LINE", 100)
    monkeypatch.setattr(runs_module, "READ_MAX", 64)
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\n{"round": 2, "train": {"' + "x" * 20)  # torn, within one read
    tail = Tail(path)
    rows = tail.new()
    assert rows == [{"round": 1}] and tail.offset == path.stat().st_size  # the torn part is not read again
    assert tail.new() == [] and tail.offset == path.stat().st_size
    with path.open("a") as f:
        f.write('": 1}}\n' + '{"round": 3, "pad": "' + "y" * 150 + '"}\n{"round": 4}\n')  # 3 is too long
    got = []
    while tail.offset < path.stat().st_size:  # READ_MAX bytes a poll
        before = tail.offset
        got += tail.new()
        assert 0 < tail.offset - before <= 64
    assert [r["round"] for r in got] == [2, 4] and tail.skipped == 1
    assert "longer than 100 bytes" in caplog.text
    with path.open("a") as f:  # a too-long line still torn: dropped as it comes, never held whole
        f.write('{"round": 5, "pad": "' + "z" * 200)
    while tail.offset < path.stat().st_size:
        assert tail.new() == []
    assert len(tail.partial) <= 100 and tail.skipped == 2
    with path.open("a") as f:
        f.write('"}\n{"round": 6}\n')
    assert tail.new() == [{"round": 6}]


def test_the_pages_messages_are_strict_json(tmp_path):
    """A NaN in a row (a diverged loss) reaches the page as null: a bare NaN would make the
    browser's JSON.parse throw on every message holding the run."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("federation:\n  rounds: 3\n")
    rows = [{"round": 1, "accuracy": 0.5, "loss": float("nan")}, {"round": 2, "loss": float("inf")}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = LiveServer(tmp_path)
    server.refresh()
    (shown,) = strict(server.message("snapshot", sorted(server.views)))["runs"]
    assert [r["loss"] for r in shown["rows"]] == [None, None] and shown["loss"] is None


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


def _get(url: str, **headers: str):  # noqa: ANN202
    import urllib.request

    return urllib.request.urlopen(urllib.request.Request(url, headers=headers))


def test_the_page_its_files_and_nothing_else_are_served(served):
    import urllib.error

    with _get(served.url) as page:
        assert page.headers["Content-Type"].startswith("text/html") and b"live.js" in page.read()
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]
        cookie = page.headers["Set-Cookie"].split(";", 1)[0]  # what the browser sends from then on
    for name in ("live.js", "live.css", "uPlot.iife.min.js", "uPlot.min.css"):
        with _get(served.base + "static/" + name, Cookie=cookie) as f:
            assert f.status == 200 and len(f.read()) > 100
    for path in ("static/../runs.py", "static/%2e%2e/runs.py", "runs.py", "static/nope.js", "etc/passwd"):
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(served.base + path, Cookie=cookie)
        assert err.value.code == 404, path


def test_the_page_and_its_websocket_need_the_token(served):
    """Issue 48, finding 12: any local user can reach 127.0.0.1 and claim the page's Origin, so the
    page, its files and the WebSocket need the random token the command prints (in the URL's query,
    then the cookie the page sets, or an `Authorization: token ...` header, as Jupyter does)."""
    import urllib.error

    token = served.server.token
    refusals = [
        (served.base, {}),
        (served.base + "?token=" + token[:-1] + ("A" if token[-1] != "A" else "B"), {}),
        (served.base + "static/live.js", {}),
        (served.base, {"Cookie": f"fedgpu-live-{served.server.port + 1}={token}"}),  # another page's cookie
        (served.base, {"Authorization": "token nope"}),
    ]
    for url, headers in refusals:
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(url, **headers)
        assert err.value.code == 403, (url, headers)
    with _get(served.url) as page:
        assert page.status == 200
        cookie = page.headers["Set-Cookie"]
    assert cookie.startswith(f"fedgpu-live-{served.server.port}={token};")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    with _get(served.base + "static/live.js", Authorization=f"token {token}") as f:
        assert f.status == 200
    origin = served.base.rstrip("/")
    for headers in ({}, {"Cookie": "fedgpu-live-1=x"}, {"Authorization": "token nope"}):
        with pytest.raises(InvalidStatus) as err:
            connect(served.ws, origin=origin, additional_headers=headers)  # the page's Origin, no token
        assert err.value.response.status_code == 403
    with pytest.raises(InvalidStatus) as err:
        connect(served.ws + "?token=" + token, origin="http://evil.example")  # the token, a foreign page
    assert err.value.response.status_code == 403
    for url, headers in (
        (served.ws + "?token=" + token, {}),
        (served.ws, {"Cookie": cookie.split(";", 1)[0]}),
        (served.ws, {"Authorization": f"token {token}"}),
    ):
        with connect(url, origin=origin, additional_headers=headers) as ws:
            assert strict(ws.recv(timeout=60))["type"] == "snapshot"
    assert LiveServer(served.server.root).token != token  # a new one each start


def test_only_the_pages_own_origin_may_open_the_websocket(served, tmp_path):
    summary, _ = run_in_process(FAST.format(rounds=1), tmp_path / "runs", nodes=2)
    ws_url = f"{served.ws}?token={served.server.token}"
    with pytest.raises(InvalidStatus) as err:
        connect(ws_url, origin="http://evil.example")
    assert err.value.response.status_code == 403
    with pytest.raises(InvalidStatus):
        connect(ws_url)  # no Origin: not a page of ours either
    deadline = time.monotonic() + 60
    while True:  # the server's next look (interval 0.2 s) reads the finished run's summary
        with connect(ws_url, origin=served.base.rstrip("/")) as ws:
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
    feed = Feed(broker.watcher(), logins=NodeLogins({"node": None}))  # simulated nodes share one login
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


def _site(broker: LocalBroker, login: str):  # noqa: ANN202
    client = paho_client(broker.login(login), f"test-{login}")
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    return client


def test_a_site_can_neither_spoof_freeze_flood_nor_stop_the_pages_feed(tmp_path, caplog):
    """Issue 48, finding 10 (audit-3 mqtt_site_vs_live_page.py), on a real Mosquitto with the shipped
    ACL: a site's login writes only its own node topics, and the page takes a heartbeat only for a
    node that login may speak for (`--node-logins`); its time is the page's time of receipt; NaN,
    deep nesting, a node level that is no node id and a retained heartbeat are refused, counted, and
    the feed goes on; a run shows at most `max_nodes` nodes and says how many updates it left out."""
    if (why := missing()) is not None:
        pytest.skip(why)
    broker = LocalBroker(tmp_path / "broker")
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("federation:\n  rounds: 3\n")
    caplog.set_level(logging.WARNING, logger="flwr.fedgpu")
    node, other = _site(broker, "node"), _site(broker, "site-b")

    def send(client, topic: str, body: str | dict, retain: bool = False) -> None:  # noqa: ANN001
        text = body if isinstance(body, str) else json.dumps(body)
        client.publish(topic, text, qos=1, retain=retain).wait_for_publish(timeout=30)

    # retained before the page subscribes: the broker would hand it to every page that comes later
    send(node, "fedgpu/nodes/node/1002/tasks", payload(node=1002, run="r1", task="train", state="failed"), True)
    feed = Feed(broker.watcher(), logins=NodeLogins({"node": None, "site-b": frozenset({"2000"})}))
    server = LiveServer(tmp_path / "runs", feed=feed, max_nodes=20)
    future = {"v": VERSION, "time": "9999-12-31T23:59:59.999+00:00", "run": "r1", "task": "train", "step": 1}
    try:
        deadline = time.monotonic() + 60
        while not (feed.client.is_connected() and node.is_connected() and other.is_connected()):
            assert time.monotonic() < deadline, "the test's clients could not connect"
            time.sleep(0.05)
        send(node, "fedgpu/nodes/node/1000/tasks", payload(node=1000, run="r1", task="train", state="started", step=1))
        send(node, "fedgpu/nodes/node/1001/tasks", {**future, "node": 1001, "state": "failed"})
        send(node, "fedgpu/nodes/node/1001/tasks", payload(node=1001, run="r1", task="train", state="finished", step=2))
        send(other, "fedgpu/nodes/site-b/1000/tasks", {**future, "node": 1000, "state": "failed"})  # not its node
        send(other, "fedgpu/nodes/node/1000/tasks", {**future, "node": 1000, "state": "failed"})  # the ACL drops it
        send(
            node,
            "fedgpu/nodes/node/1000/tasks",
            '{"run": "r1", "node": 1000, "task": "train", "state": "x", "step": NaN}',
        )
        send(node, "fedgpu/nodes/node/1000/tasks", "[" * 20_000)
        send(node, "fedgpu/nodes/node/1000/tasks", json.dumps({"run": "r1", "pad": "x" * MAX_HEARTBEAT}))
        send(node, "fedgpu/nodes/node/abc/tasks", payload(node="abc", run="r1", task="train", state="started"))
        send(node, "fedgpu/nodes/node/1000/tasks", payload(node=1001, run="r1", task="train", state="failed"))
        for i in range(30):  # a flood of nodes the shared login may speak for
            send(node, f"fedgpu/nodes/node/{3000 + i}/tasks", payload(node=3000 + i, run="r1", task="x", state="y"))
        send(node, "fedgpu/nodes/node/1000/tasks", payload(node=1000, run="r1", task="train", state="finished", step=1))
        deadline = time.monotonic() + 60
        while True:
            server.refresh()
            if (n := server.views["r1"].nodes.get("1000")) is not None and n.heartbeat == "train finished":
                break
            assert time.monotonic() < deadline, (feed.counts(), server.views["r1"].nodes)
            time.sleep(0.1)
        alive = feed.client.is_connected()
        snapshot = strict(server.message("snapshot", sorted(server.views)))
    finally:
        for client in (node, other):
            client.loop_stop()
            client.disconnect()
        feed.close()
        broker.stop()
    assert alive
    (shown,) = snapshot["runs"]
    assert len(shown["nodes"]) == 20 and {"1000", "1001"} <= set(shown["nodes"]) and "2000" not in shown["nodes"]
    assert shown["nodes_left_out"] == 12  # 30 flooded + 2 real nodes, 20 shown
    assert shown["nodes"]["1001"]["heartbeat"] == "train finished" and shown["nodes"]["1001"]["last_step"] == 2
    assert all(n["last_seen"] is None or n["last_seen"] < "9999" for n in shown["nodes"].values())
    assert feed.counts() == {
        "a login speaking for a node it does not own": 1,
        "not strict JSON (NaN, Infinity, or nested too deeply)": 2,
        f"a heartbeat over {MAX_HEARTBEAT} bytes": 1,
        "a topic that is not <prefix>/nodes/<login>/<node id>/tasks": 1,
        "a payload naming another node than its topic": 1,
        "a retained heartbeat (a node never retains one)": 1,
    }
    assert snapshot["channel"] == {"refused": feed.counts()}
    assert "status channel: refused a message from login site-b" in caplog.text


def test_the_feed_lives_through_an_error_in_its_handler(monkeypatch):
    """Whatever goes wrong with one message in paho's thread is caught and counted: an exception
    there would end paho's network thread, and the feed with it, silently."""
    feed = Feed(Broker("127.0.0.1", 9), logins=NodeLogins({"node": None}))  # a port nobody serves
    try:

        def broken(topic: str, body: bytes, retain: bool) -> None:  # noqa: ARG001
            raise KeyError("a bug")

        monkeypatch.setattr(feed, "read", broken)
        message = type("Message", (), {"topic": "fedgpu/nodes/node/1/tasks", "payload": b"{}", "retain": False})
        feed._on_message(None, None, message())
        assert feed.counts() == {"an error in the feed: KeyError": 1}
        monkeypatch.undo()
        beat = json.dumps(payload(node=1, run="r1", task="train", state="started")).encode()
        for login in ("lab-x", "node"):  # a login the file does not list, then one it does
            fields = {"topic": f"fedgpu/nodes/{login}/1/tasks", "payload": beat, "retain": False}
            feed._on_message(None, None, type("Message", (), fields)())
        assert feed.counts() == {"an error in the feed: KeyError": 1, "a login that --node-logins does not list": 1}
        assert feed.inbox.qsize() == 1  # node's
    finally:
        feed.close()


def test_the_node_logins_file(tmp_path, capsys):
    """`--node-logins`: each login's node ids (integers or their text), or "*" for any node; a bad
    entry stops the command with a message naming it."""
    from app.live.__main__ import main

    good = tmp_path / "logins.toml"
    good.write_text('lab-a = [5577006791947779410, "12"]\nnode = "*"\n')
    logins = NodeLogins.read(good)
    assert logins.may("lab-a", "5577006791947779410") and logins.may("lab-a", "12") and logins.may("node", "7")
    assert not logins.may("lab-a", "7") and not logins.may("lab-b", "12")
    bad = tmp_path / "bad.toml"
    bad.write_text('lab-a = ["12", "x/+"]\n')
    with pytest.raises(ValueError, match="lab-a"):
        NodeLogins.read(bad)
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path), "--node-logins", str(bad)])
    assert exit_.value.code == 2 and "--node-logins" in capsys.readouterr().err


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

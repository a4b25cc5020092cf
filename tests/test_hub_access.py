"""The Hub asked once, briefly: an answer of any status leaves the process online; no answer puts it offline, the
libraries imported already included, so no later request waits on huggingface_hub's retries."""

from __future__ import annotations

import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from launcher import hub_access


@pytest.fixture
def online(monkeypatch):
    """This process as if no offline setting were made; whatever a test switches is put back after it."""
    import datasets.config
    import huggingface_hub.constants

    for name in (*hub_access.OFFLINE_SETTINGS, "HF_ENDPOINT"):
        monkeypatch.setenv(name, "")  # recorded, so that what go_offline sets is undone
        monkeypatch.delenv(name)
    monkeypatch.setattr(hub_access, "_unanswered", None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    return monkeypatch


def test_a_hub_that_answers_leaves_the_process_online(online):
    import huggingface_hub.constants

    class NotFound(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)  # any status: the Hub is there
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        online.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}/")
        assert hub_access.probe() is None
    finally:
        server.shutdown()
        server.server_close()
    assert hub_access.offline_reason() is None and not huggingface_hub.constants.is_offline_mode()


def test_a_hub_that_cannot_be_reached_puts_the_process_offline(online):
    import datasets.config
    import huggingface_hub.constants

    with socket.socket() as closed:  # bound, never listening: a connection to it is refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        online.setenv("HF_ENDPOINT", url)
        why = hub_access.probe()
    assert why.startswith(f"the Hub at {url} could not be reached (") and hub_access.offline_reason() == why
    assert huggingface_hub.constants.is_offline_mode() and datasets.config.HF_HUB_OFFLINE
    assert hub_access.probe() == why  # asked once: the second call asks nothing
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # for the libraries imported later


def test_an_offline_setting_asks_nothing(online):
    online.setenv("FTRUN_OFFLINE", "1")
    online.setattr("urllib.request.urlopen", lambda *a, **k: pytest.fail("the Hub was asked"))
    assert hub_access.probe() == "offline (HF_HUB_OFFLINE / FTRUN_OFFLINE)"

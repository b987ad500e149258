"""No test module may import locust (or gevent's monkey patching) into the pytest process:
locust patches sockets, threads and select for gevent at import, after which every Ray and
server test of the session hangs. Collection has imported every test module before this
runs, so this catches one that does."""

from __future__ import annotations

import socket
import sys
import threading


def test_the_session_is_not_monkey_patched():
    assert "locust" not in sys.modules
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None:
        assert not monkey.is_anything_patched()
    assert socket.socket.__module__ == "socket"
    assert threading.Lock.__module__ in ("_thread", "threading")

"""`receiver`: a real HTTP server on 127.0.0.1 (a free port) that records every
request and answers with the statuses it is given, in order (200 once they run out).
`webhook`: one for the team's environment pointing at it, with its secret."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controlplane.webhooks.actions import do_create_webhook


class Receiver:
    def __init__(self) -> None:
        self.requests: list[tuple[dict, bytes]] = []
        self.statuses: list[int] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((dict(self.headers), body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/releasegate"


@pytest.fixture
def receiver():
    found = Receiver()
    thread = threading.Thread(target=found.server.serve_forever, daemon=True)
    thread.start()
    yield found
    found.server.shutdown()
    found.server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def webhook(receiver, environment, owner, settings):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = True  # the receiver is local
    return do_create_webhook(environment, receiver.url, actor=owner)

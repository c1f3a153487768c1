"""`queue_name`: a queue of the test's own; `received(queue)`: what the broker holds
in it; `silent_broker_url`: a broker that never answers (the other broker fixtures
are in tests/controlplane/conftest.py)."""

import socket
import uuid

import pytest

from controlplane import celery_app


@pytest.fixture
def silent_broker_url():
    """A Redis URL whose server takes connections and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/12"


@pytest.fixture
def queue_name() -> str:
    return f"outbox-test-{uuid.uuid4().hex[:8]}"


def received(queue: str) -> list[tuple[str, list]]:
    """(task name, args) of every message waiting in `queue` on the app's broker."""
    found = []
    with celery_app.connection_for_read() as connection:
        simple = connection.SimpleQueue(queue)
        try:
            while True:
                message = simple.get(block=True, timeout=1)
                args = message.decode()[0]
                found.append((message.headers["task"], list(args)))
                message.ack()
        except simple.Empty:
            pass
        finally:
            simple.close()
    return found

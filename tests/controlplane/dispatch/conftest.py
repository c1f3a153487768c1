"""`queue_name`: a queue of the test's own; `received(queue)`: what the broker holds
in it (the broker fixtures are in tests/controlplane/conftest.py)."""

import uuid

import pytest

from controlplane import celery_app


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

"""The transactional outbox: Celery tasks are queued as rows in the same transaction
as the write that wants them, then published once it commits (and by a relay that
retries), so a broker that is down neither loses work nor fails the request."""

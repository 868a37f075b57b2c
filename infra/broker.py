"""The Celery broker on Redis, and the publish of one task message by the web process.

`Transport` is Kombu's Redis transport (`CELERY_BROKER_TRANSPORT` when REDIS_URL is a
`redis://` URL) with one change: a channel keeps one Redis client for its commands. Kombu
builds a new `redis.Redis` for every command, a published message included (its response
callbacks, its retry policy each time); here a channel builds one.

`send_task` publishes what `app.send_task` would publish, through Celery's own message
builder (`amqp.create_task_message`: task protocol 2, the same headers) and its own publish
(`amqp.send_task_message`: the `before/after_task_publish` signals that tracing hooks, the
app's retry policy, the producer pool), to a queue the caller names. It leaves out what
`send_task` works out on every call and a turn's task does not use: routing (the queue is
known), a result (ignored), parent and root ids (a turn's task is not a subtask), the
declaration check (the workers declare their queues), and a `saferepr` of the arguments.
The message on the queue is the one `send_task` writes (tests/test_broker.py compares them).
"""

from __future__ import annotations

from contextlib import contextmanager

from celery import current_app
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    _commands = None

    @contextmanager
    def conn_or_acquire(self, client=None):
        """The channel's client for a command, built once (Kombu's builds one per call). A
        channel is used by one thread at a time, and the client's connections come from the
        channel's pool either way."""
        if client is not None:
            yield client
            return
        if self._commands is None:
            self._commands = self._create_client()
        yield self._commands


class Transport(kombu_redis.Transport):
    Channel = Channel


def send_task(name: str, task_id: str, args: tuple, queue, *, app=None) -> None:
    """Publish task `name` with `args` under id `task_id` to `queue` (a name, or a kombu
    Queue such as a worker's direct queue). Raises when the broker refuses it."""
    app = app or current_app
    amqp = app.amqp
    message = amqp.create_task_message(
        task_id,
        name,
        args,
        {},
        argsrepr=repr(args),
        kwargsrepr="{}",
        reply_to=app.thread_oid,
        ignore_result=True,
    )
    with app.producer_or_acquire() as producer, producer.connection._reraise_as_library_errors():
        amqp.send_task_message(producer, name, message, queue=queue, declare=[])

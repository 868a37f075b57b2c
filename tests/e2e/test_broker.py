"""The web process's publish of a wake-up task (infra.broker) against a real Redis: it writes
what Celery's own `send_task` writes, and Kombu's channel builds one Redis client for it."""

from __future__ import annotations

import base64
import json
import os
import uuid
from contextlib import contextmanager
from unittest import mock

import pytest
import redis
from celery import Celery

from infra import broker

TASK = "sessions_app.tasks.wake"


@pytest.fixture
def app_and_queue():
    url = os.environ.get("REDIS_URL")
    if not url:
        pytest.fail("REDIS_URL is not set: run the suite with `make test` (it starts Redis when none answers).")
    app = Celery("broker-test", set_as_current=False)
    app.conf.update(
        broker_url=url,
        broker_transport="infra.broker:Transport",
        broker_transport_options={"ack_emulation": False},
        task_ignore_result=True,
    )
    queue = f"aap-broker-test-{uuid.uuid4().hex}"  # no worker consumes it
    client = redis.Redis.from_url(url)
    yield app, queue, client
    # The queue and the bindings Kombu declared for it (send_task declares its queue).
    client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
    app.close()


def _taken(client, queue) -> dict:
    raw = client.rpop(queue)
    assert raw is not None, "nothing was published"
    message = json.loads(raw)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return message


def test_a_turn_task_message_is_the_one_celery_send_task_writes(app_and_queue):
    app, queue, client = app_and_queue
    ours, theirs = f"turn_{uuid.uuid4().hex}", f"turn_{uuid.uuid4().hex}"
    app.send_task(TASK, args=(theirs,), task_id=theirs, queue=queue)
    broker.send_task(TASK, ours, (ours,), queue, app=app)
    by_celery, by_us = _taken(client, queue), _taken(client, queue)  # LPUSH, then RPOP: oldest first

    assert by_us["body"] == [[ours], {}, by_celery["body"][2]]
    assert by_celery["body"] == [[theirs], {}, by_celery["body"][2]]
    assert by_us.keys() == by_celery.keys()
    assert by_us["content-type"] == by_celery["content-type"] == "application/json"
    assert by_us["content-encoding"] == by_celery["content-encoding"]

    # Headers: the same keys and values but for the turn's own id, and a result that is
    # ignored whatever the task says (send_task leaves it to the worker's task options).
    assert by_us["headers"].keys() == by_celery["headers"].keys()
    for key in ("id", "root_id"):
        assert by_us["headers"][key] == ours and by_celery["headers"][key] == theirs
    assert by_us["headers"]["argsrepr"] == repr((ours,))
    assert by_us["headers"]["ignore_result"] is True
    own = {"id", "root_id", "argsrepr", "ignore_result"}
    assert {k: v for k, v in by_us["headers"].items() if k not in own} == {
        k: v for k, v in by_celery["headers"].items() if k not in own
    }

    # Properties: Kombu's envelope (delivery info, encoding, priority), tags aside.
    assert by_us["properties"]["correlation_id"] == ours
    volatile = {"correlation_id", "delivery_tag"}
    assert {k: v for k, v in by_us["properties"].items() if k not in volatile} == {
        k: v for k, v in by_celery["properties"].items() if k not in volatile
    }
    assert by_us["properties"]["delivery_info"] == {"exchange": "", "routing_key": queue}


def test_a_channel_uses_one_redis_client_for_its_publishes(app_and_queue):
    app, queue, client = app_and_queue
    used = []
    original = broker.Channel.conn_or_acquire

    @contextmanager
    def recorded(channel, client=None):
        with original(channel, client) as commands:
            used.append(commands)
            yield commands

    with mock.patch.object(broker.Channel, "conn_or_acquire", recorded):
        for _ in range(5):
            turn_id = f"turn_{uuid.uuid4().hex}"
            broker.send_task(TASK, turn_id, (turn_id,), queue, app=app)
    assert len(used) == 5
    assert len({id(commands) for commands in used}) == 1  # Kombu's own channel builds one per publish
    assert client.llen(queue) == 5

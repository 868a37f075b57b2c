"""Which worker process holds a session's in-flight ACP prompt, and session release signals.

An ACP prompt that waits on the application's permission lives in one worker process (its
agent process is that process's child). While it waits, that worker keeps a short-lived
Redis key `aap:acp:holder:<session>` = its Celery node name; the service sends the session's
next turn to that node's direct queue (Celery `worker_direct`), so the answer reaches the
prompt. Without Redis (embedded mode) there is one process and nothing to route.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from infra import process, redis_connections
from infra.outages import REDIS_ERRORS

logger = logging.getLogger(__name__)

HOLDER_TTL_SECONDS = 30
RELEASE_CHANNEL = "aap:acp:release"


def _holder_key(session_id: str) -> str:
    return f"aap:acp:holder:{session_id}"


def _acp_session_key(session_id: str) -> str:
    return f"aap:acp:session:{session_id}"


def _redis():
    return redis_connections.connections()


def worker_node() -> str:
    """This process's Celery node name ('' outside a Celery worker)."""
    return process.worker_node


class Holds:
    """The sessions whose prompts this process holds, kept alive in Redis while held."""

    def __init__(self):
        self._held: set[str] = set()
        self._refresher: asyncio.Task | None = None

    async def hold(self, session_id: str) -> None:
        redis, node = _redis(), worker_node()
        if redis is None or not node:
            return
        self._held.add(session_id)
        await redis.aclient().set(_holder_key(session_id), node, ex=HOLDER_TTL_SECONDS)
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh())

    async def release(self, session_id: str) -> None:
        if session_id not in self._held:
            return
        self._held.discard(session_id)
        redis = _redis()
        try:
            await redis.aclient().delete(_holder_key(session_id))
        except REDIS_ERRORS:  # the key expires by itself
            logger.warning("could not clear the holder of %s", session_id, exc_info=True)

    async def _refresh(self) -> None:
        node = worker_node()
        while self._held:
            await asyncio.sleep(HOLDER_TTL_SECONDS / 3)
            try:
                pipe = _redis().aclient().pipeline(transaction=False)
                for session_id in list(self._held):
                    pipe.set(_holder_key(session_id), node, ex=HOLDER_TTL_SECONDS)
                await pipe.execute()
            except REDIS_ERRORS:
                logger.warning("could not refresh ACP holders", exc_info=True)


def holder_sync(session_id: str) -> str | None:
    """The node holding the session's prompt, or None (sync: called while starting a turn)."""
    redis = _redis()
    if redis is None:
        return None
    return redis.sync.get(_holder_key(session_id)) or None


# --- the ACP session id an AAP session had, for session/load after a process restart -------


async def remember_acp_session(session_id: str, acp_session_id: str, memory: dict[str, str]) -> None:
    memory[session_id] = acp_session_id
    redis = _redis()
    if redis is not None:
        await redis.aclient().set(_acp_session_key(session_id), acp_session_id, ex=30 * 24 * 3600)


async def recall_acp_session(session_id: str, memory: dict[str, str]) -> str | None:
    if session_id in memory:
        return memory[session_id]
    redis = _redis()
    if redis is not None:
        return await redis.aclient().get(_acp_session_key(session_id))
    return None


async def forget_acp_session(session_id: str, memory: dict[str, str]) -> None:
    memory.pop(session_id, None)
    redis = _redis()
    if redis is not None:
        await redis.aclient().delete(_acp_session_key(session_id), _holder_key(session_id))


# --- deleted sessions: every worker drops what it holds for them --------------------------


async def announce_deleted(session_id: str) -> None:
    redis = _redis()
    if redis is not None:
        await redis.aclient().publish(RELEASE_CHANNEL, session_id)


async def listen_deleted(on_deleted: Callable[[str], None]) -> None:
    """Run forever on the runtime loop: call `on_deleted(session_id)` for every deleted session."""
    redis = _redis()
    if redis is None:
        return
    while True:
        try:
            pubsub = redis.aclient().pubsub(ignore_subscribe_messages=True)
            await pubsub.subscribe(RELEASE_CHANNEL)
            async for message in pubsub.listen():
                if message and message.get("type") == "message":
                    on_deleted(message["data"])
        except asyncio.CancelledError:
            raise
        except Exception:  # the listener task's boundary: it must outlive any failure
            logger.warning("ACP release listener failed; reconnecting", exc_info=True)
            await asyncio.sleep(1)

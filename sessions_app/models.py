"""AAP sessions, their history and their turns."""

import json
import secrets

from django.db import models


class OrderedJSONField(models.JSONField):
    """JSON kept as the application sent it. PostgreSQL's `jsonb` reorders object keys, so on
    PostgreSQL this is a `json` column (stored as text, key order intact); elsewhere the same
    as JSONField. Not for key lookups in queries: nothing queries inside these columns."""

    def db_type(self, connection):
        return "json" if connection.vendor == "postgresql" else super().db_type(connection)

    def get_db_prep_value(self, value, connection, prepared=False):
        if connection.vendor != "postgresql":
            return super().get_db_prep_value(value, connection, prepared)
        from psycopg.types.json import Json

        if not prepared:
            value = self.get_prep_value(value)
        return Json(value, dumps=lambda obj: json.dumps(obj, cls=self.encoder))

    def from_db_value(self, value, expression, connection):
        if value is None or not isinstance(value, str):
            return value  # psycopg already decoded a `json` column (in order)
        return super().from_db_value(value, expression, connection)


def new_session_id() -> str:
    return "sess_" + secrets.token_urlsafe(24)  # 192 random bits


def new_turn_id() -> str:
    return "turn_" + secrets.token_urlsafe(18)


class Session(models.Model):
    """One conversation of a tenant with an agent.

    `options` holds what the application set (merged over turns); secret values are stored
    as Fernet ciphertext. `pending_calls` are the tool calls the last turn left for the
    application: [{"toolCallId", "name", "kind": "client" | "permission"}].
    """

    public_id = models.CharField(max_length=64, unique=True, default=new_session_id, editable=False)
    # Its own index would repeat the first column of session_tenant_newest.
    tenant = models.ForeignKey("hosting.Tenant", on_delete=models.CASCADE, related_name="sessions", db_index=False)
    agent = models.ForeignKey("agents.Agent", on_delete=models.CASCADE, related_name="sessions")
    options = OrderedJSONField(default=dict, blank=True)
    server_tools = OrderedJSONField(null=True, blank=True)
    client_tools = OrderedJSONField(null=True, blank=True)
    pending_calls = models.JSONField(default=list, blank=True)
    # The turn queued or running on this session, kept by the engine: set by the statement
    # that stores a turn, cleared by the one that ends it. Neither indexed nor a foreign key
    # in the database, so those two updates leave every index of the row as it was
    # (PostgreSQL's HOT updates: no new index entries, twice per turn). Nothing looks a
    # session up by it; a turn is deleted with its session, and a turn deleted on its own
    # (Django admin) leaves an id that no turn has, read as no active turn
    # (api.services.turns._end_active_if_lost).
    active_turn = models.ForeignKey(
        "Turn",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        related_name="+",
        db_constraint=False,
        db_index=False,
    )
    message_seq = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "-id"], name="session_tenant_newest")]

    def __str__(self) -> str:
        return self.public_id


class Message(models.Model):
    """One history message, stored as the exact JSON text accepted or produced."""

    FULL, COMPACTED = "full", "compacted"
    KINDS = [(FULL, "full"), (COMPACTED, "compacted")]

    # Its own index would repeat the first column of unique_message_position.
    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="messages", db_index=False)
    kind = models.CharField(max_length=9, choices=KINDS)
    seq = models.BigIntegerField()
    role = models.CharField(max_length=16)
    data = models.TextField()
    turn = models.ForeignKey("Turn", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["session", "kind", "seq"], name="unique_message_position")]

    def __str__(self) -> str:
        return f"{self.session_id}/{self.kind}/{self.seq}"


class Turn(models.Model):
    QUEUED, RUNNING, DONE = "queued", "running", "done"
    STATUSES = [(QUEUED, "queued"), (RUNNING, "running"), (DONE, "done")]

    id = models.CharField(primary_key=True, max_length=40, default=new_turn_id, editable=False)
    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="turns")
    status = models.CharField(max_length=8, choices=STATUSES, default=QUEUED)
    stream = models.CharField(max_length=8, default="none")
    stop_reason = models.CharField(max_length=16, blank=True)
    cancelled = models.BooleanField(default=False)
    # The application's answers to last turn's untrusted calls (never stored in history).
    permissions = models.JSONField(default=list, blank=True)
    error = models.CharField(max_length=500, blank=True, help_text="A safe sentence, never a secret.")
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    model_calls = models.PositiveIntegerField(default=0)
    # Some of the tokens were counted by the runtime: the provider reported no usage.
    usage_estimated = models.BooleanField(default=False, db_default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Written by the worker while the turn runs: liveness that survives a Redis restart.
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    # The fold of what the agent produced so far (message/none modes), for crash recovery.
    partial = models.TextField(blank=True)
    # Position of the first message the agent produced in full history (0: none stored yet).
    output_seq = models.BigIntegerField(default=0)
    # The worker that must run it (it holds the prompt this turn answers, ACP); empty: any.
    # Another worker may take it once AAP_TURN_PIN_SECONDS passed (the holder is gone).
    pinned_node = models.CharField(max_length=200, blank=True, default="", db_default="")
    # The queue it waits in (AAP_TURN_QUEUE of the web that accepted it): only workers of the
    # same queue claim it.
    queue = models.CharField(max_length=64, default="default", db_default="default")
    # The worker it is counted against: while it waits, the one its wake-up went to; once
    # claimed, the one running it (empty: none). What the next turn's wake-up is aimed by.
    worker_node = models.CharField(max_length=200, blank=True, default="", db_default="")
    # The W3C traceparent of the request that accepted it: its run continues that trace.
    trace_parent = models.CharField(max_length=64, blank=True, default="", db_default="")

    class Meta:
        indexes = [models.Index(fields=["status", "created_at"], name="turn_status_created")]

    def __str__(self) -> str:
        return self.id


class IdempotencyKey(models.Model):
    """An `Idempotency-Key` a tenant sent with a request that created something: a retry
    with the same key and request gets the same session or turn back."""

    tenant = models.ForeignKey("hosting.Tenant", on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, help_text="sha256 of the method, path and JSON body.")
    session_public_id = models.CharField(max_length=64)
    turn_id = models.CharField(max_length=40, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "key"], name="unique_idempotency_key")]
        indexes = [models.Index(fields=["created_at"], name="idempotency_created")]

    def __str__(self) -> str:
        return self.key


class Worker(models.Model):
    """A worker process that runs turns, and how many at once: what a waiting turn's place and
    wake-up are counted against.
    Its heartbeat (`seen_at`) is written by the process itself (sessions_app.engine.worker)."""

    node = models.CharField(max_length=200, unique=True)
    # The queue it takes turns from (its AAP_TURN_QUEUE).
    queue = models.CharField(max_length=64, default="default", db_default="default")
    concurrency = models.PositiveIntegerField()
    seen_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.node} ({self.concurrency})"

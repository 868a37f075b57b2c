"""Management commands: create_tenant, create_token, revoke_token, apply_agents, seed_demo.

A few run as the operator types them (a separate process, exit code, last line of output)
against the test database. The registry commands run in this process inside the test's
transaction and are read back through `GET /v1/meta` served in-process on that transaction:
that isolates `--prune`, which would otherwise remove agents the rest of the suite uses.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import uuid
from io import StringIO

import pytest
import yaml
from django.core.management import CommandError, call_command

from ..support import PYTHON, ROOT, committed

ALPHA_SECRET = f"sk-alpha-{uuid.uuid4().hex}"


def cli(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, str(ROOT / "manage.py"), *args], env=stack.env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def call(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def meta(client, token: str | None = None) -> dict[str, dict]:
    """`GET /v1/meta` in this process (it sees the test's transaction), by agent name."""
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    response = client.get("/v1/meta", **headers)
    assert response.status_code == 200, response.content
    return {agent["name"]: agent for agent in response.json()["agents"]}


# --- tenants and tokens --------------------------------------------------------------------------


def test_create_tenant_prints_a_working_token_as_its_last_line(engine):
    name = f"t2-cli-{uuid.uuid4().hex[:8]}"
    result = cli(engine, "create_tenant", name)
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip().splitlines()[-1]
    client = engine.client_with(token)
    assert client.get("/v1/sessions").json() == {"sessions": []}
    names = {agent["name"] for agent in client.meta()["agents"]}
    assert "echo" in names and "echo-private" not in names
    client.close()

    again = cli(engine, "create_tenant", name)
    assert again.returncode != 0
    assert name in again.stderr and "create_token" in again.stderr
    assert "Traceback" not in again.stderr


def test_create_token_prints_a_working_token_stored_only_as_a_hash(engine, db_access):
    from tenancy.models import ApiToken

    out = StringIO()
    committed(lambda: call_command("create_token", "other", "--name", "ci", stdout=out))
    raw = out.getvalue().strip().splitlines()[-1]
    client = engine.client_with(raw)
    assert "echo-private" in {agent["name"] for agent in client.meta()["agents"]}, "a token of 'other'"
    assert client.get("/v1/sessions").status_code == 200
    client.close()

    row = ApiToken.objects.get(token_hash=hashlib.sha256(raw.encode()).hexdigest())
    assert row.tenant.name == "other" and row.name == "ci"
    assert raw.startswith(row.prefix) and row.prefix in out.getvalue()
    stored = [str(value) for value in ApiToken.objects.filter(pk=row.pk).values().get().values()]
    assert not any(raw in value or raw[len(row.prefix) :] in value for value in stored), (
        "the token itself is not stored"
    )


def test_token_commands_explain_what_is_wrong(db_access):
    with pytest.raises(CommandError, match="No tenant named 'nobody'"):
        call("create_token", "nobody")
    with pytest.raises(CommandError, match="aap_ffffffff"):
        call("revoke_token", "aap_ffffffff")


# --- seed_demo --------------------------------------------------------------------------------------


def test_seed_demo_is_idempotent_and_prints_a_working_token(client, engine, db_access):
    """On a database `engine` has already seeded, as a restart finds it."""
    from agents.models import Agent, AgentOption, ServerTool
    from tenancy.models import Tenant

    before = meta(client)["echo"]
    counts = (Tenant.objects.count(), Agent.objects.count(), AgentOption.objects.count(), ServerTool.objects.count())
    for _ in range(2):
        token = call("seed_demo").strip().splitlines()[-1]
        response = client.get("/v1/sessions", HTTP_AUTHORIZATION=f"Bearer {token}")
        assert response.status_code == 200, response.content
    assert meta(client)["echo"] == before
    assert counts == (
        Tenant.objects.count(),
        Agent.objects.count(),
        AgentOption.objects.count(),
        ServerTool.objects.count(),
    )


# --- apply_agents -------------------------------------------------------------------------------------

ALPHA = {
    "name": "t2-alpha",
    "title": "Alpha",
    "version": "1.2.3",
    "description": "An agent of the registry tests.",
    "runtime": {"kind": "echo", "config": {"window": 5}},
    "options": [
        {"type": "select", "name": "style", "title": "Style", "options": ["plain", "upper"], "default": "plain"},
        {"type": "text", "name": "signature", "description": "Appended.", "default": "-- alpha"},
        {"type": "secret", "name": "apiKey", "default": ALPHA_SECRET},
    ],
    "tools": [
        {
            "name": "clock",
            "description": "Current time.",
            "parameters": {"type": "object", "properties": {}},
            "implementation": "clock",
        },
        {
            "name": "sum",
            "title": "Sum",
            "description": "Adds a and b.",
            "implementation": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    ],
    "capabilities": {"application": {"tools": {}}, "image": {"http": {}}},
    "tenants": ["demo"],
}
BETA = {"name": "t2-beta", "version": "0.0.1", "runtime": {"kind": "echo"}}

ALPHA_IN_META = {
    "name": "t2-alpha",
    "title": "Alpha",
    "version": "1.2.3",
    "description": "An agent of the registry tests.",
    "tools": [
        {"name": "clock", "description": "Current time.", "parameters": {"type": "object", "properties": {}}},
        {
            "name": "sum",
            "title": "Sum",
            "description": "Adds a and b.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    ],
    "options": [
        {"type": "select", "name": "style", "title": "Style", "options": ["plain", "upper"], "default": "plain"},
        {"type": "text", "name": "signature", "description": "Appended.", "default": "-- alpha"},
        {"type": "secret", "name": "apiKey", "default": "***"},
    ],
    "capabilities": {
        "history": {"compacted": {}, "full": {}},
        "stream": {"delta": {}, "message": {}, "none": {}},
        "application": {"tools": {}},
        "image": {"http": {}},
    },
}


def write(tmp_path, name: str, entries, *, wrap: bool = False):
    data = {"agents": entries} if wrap else entries
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return str(path)


def stored_secret_default(agent: str, option: str) -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            'SELECT o."default" FROM agents_agentoption o JOIN agents_agent a ON a.id = o.agent_id '
            "WHERE a.name = %s AND o.name = %s",
            [agent, option],
        )
        return cursor.fetchone()[0]


def test_apply_agents_from_yaml_and_json_is_idempotent(client, engine, db_access, tmp_path):
    from agents.models import Agent, AgentOption, ServerTool

    yaml_file = write(tmp_path, "agents.yaml", [ALPHA, BETA], wrap=True)
    json_file = write(tmp_path, "agents.json", [ALPHA, BETA])
    assert json.loads(call("apply_agents", yaml_file)) == {
        "created": ["t2-alpha", "t2-beta"],
        "updated": [],
        "removed": [],
    }
    first = meta(client, engine.tokens["demo"])
    assert first["t2-alpha"] == ALPHA_IN_META
    assert first["t2-beta"] == {
        "name": "t2-beta",
        "version": "0.0.1",
        "capabilities": {"history": {"compacted": {}, "full": {}}, "stream": {"delta": {}, "message": {}, "none": {}}},
    }
    rows = lambda: (
        Agent.objects.filter(name__startswith="t2-").count(),
        AgentOption.objects.filter(agent__name__startswith="t2-").count(),
        ServerTool.objects.filter(agent__name__startswith="t2-").count(),
    )
    assert rows() == (2, 3, 2)
    for path in (yaml_file, json_file, json_file):
        assert json.loads(call("apply_agents", path))["updated"] == ["t2-alpha", "t2-beta"]
        assert meta(client, engine.tokens["demo"]) == first
        assert rows() == (2, 3, 2)
    # Restricted to demo: not public, not for other.
    assert "t2-alpha" not in meta(client) and "t2-alpha" not in meta(client, engine.tokens["other"])
    assert "t2-beta" in meta(client)


def test_apply_agents_stores_secret_defaults_encrypted(engine, db_access, tmp_path):
    """`engine` seeds the tenant `demo` that ALPHA is restricted to."""
    from infra import crypto

    call("apply_agents", write(tmp_path, "a.yaml", [ALPHA]))
    stored = stored_secret_default("t2-alpha", "apiKey")
    assert ALPHA_SECRET not in stored and crypto.decrypt(stored) == ALPHA_SECRET

    kept = copy.deepcopy(ALPHA)
    kept["options"][2]["default"] = "***"
    call("apply_agents", write(tmp_path, "b.yaml", [kept]))
    assert crypto.decrypt(stored_secret_default("t2-alpha", "apiKey")) == ALPHA_SECRET, '"***" keeps the stored secret'

    replaced = copy.deepcopy(ALPHA)
    replaced["options"][2]["default"] = "sk-replaced"
    call("apply_agents", write(tmp_path, "c.yaml", [replaced]))
    stored = stored_secret_default("t2-alpha", "apiKey")
    assert "sk-replaced" not in stored and crypto.decrypt(stored) == "sk-replaced"


def test_apply_agents_updates_options_tools_and_access(client, engine, db_access, tmp_path):
    call("apply_agents", write(tmp_path, "v1.yaml", [ALPHA]))
    v2 = copy.deepcopy(ALPHA)
    v2.update(version="1.3.0", title="Alpha two", tenants=[], capabilities={})
    v2["options"] = [
        {"type": "select", "name": "style", "options": ["plain", "upper", "title"], "default": "title"},
        {"type": "text", "name": "greeting", "default": "hi"},
    ]
    v2["tools"] = [
        {
            "name": "clock",
            "description": "What time it is.",
            "implementation": "clock",
            "parameters": {"type": "object", "properties": {}},
        }
    ]
    report = json.loads(call("apply_agents", write(tmp_path, "v2.yaml", [v2])))
    assert report["updated"] == ["t2-alpha"]

    alpha = meta(client)["t2-alpha"]  # open to every tenant now: public
    assert alpha["version"] == "1.3.0" and alpha["title"] == "Alpha two"
    assert alpha["options"] == [
        {"type": "select", "name": "style", "options": ["plain", "upper", "title"], "default": "title"},
        {"type": "text", "name": "greeting", "default": "hi"},
    ]
    assert alpha["tools"] == [
        {"name": "clock", "description": "What time it is.", "parameters": {"type": "object", "properties": {}}}
    ]
    assert "application" not in alpha["capabilities"] and "image" not in alpha["capabilities"]
    assert "t2-alpha" in meta(client, engine.tokens["other"])


def test_apply_agents_prune_removes_the_agents_the_file_does_not_list(client, engine, db_access, tmp_path):
    from agents.models import Agent
    from agents.services import ECHO_AGENT

    call("apply_agents", write(tmp_path, "both.yaml", [ALPHA, BETA]))
    others = set(Agent.objects.exclude(name__in=["echo", "t2-alpha"]).values_list("name", flat=True))
    assert {"t2-beta", "echo-small", "echo-private"} <= others

    report = json.loads(call("apply_agents", write(tmp_path, "kept.json", [ECHO_AGENT, ALPHA]), "--prune"))
    assert set(report["removed"]) == others
    assert set(Agent.objects.values_list("name", flat=True)) == {"echo", "t2-alpha"}
    assert set(meta(client, engine.tokens["demo"])) == {"echo", "t2-alpha"}
    # Without --prune nothing is removed.
    call("apply_agents", write(tmp_path, "beta.yaml", [BETA]))
    assert set(Agent.objects.values_list("name", flat=True)) == {"echo", "t2-alpha", "t2-beta"}


def _bad(**changes) -> dict:
    entry = copy.deepcopy(ALPHA)
    entry["name"] = "t2-bad"
    entry.update(changes)
    return entry


def _bad_option(option: dict) -> dict:
    return _bad(options=[option])


def _bad_tool(tool: dict) -> dict:
    return _bad(tools=[tool])


INVALID_FILES = {
    "unknown runtime kind": ([_bad(runtime={"kind": "telepathy"})], ["telepathy", "echo"]),
    "runtime missing": ([{k: v for k, v in _bad().items() if k != "runtime"}], ["runtime", "required"]),
    "runtime config invalid": ([_bad(runtime={"kind": "echo", "config": {"window": "big"}})], ["window"]),
    "bad semver": ([_bad(version="1.0")], ["t2-bad", "semantic version"]),
    "bad semver with v": ([_bad(version="v1.2.3")], ["semantic version"]),
    "tool parameters not a JSON Schema": (
        [_bad_tool({"name": "t", "description": "d", "implementation": "clock", "parameters": {"type": "nonsense"}})],
        ["t2-bad", "JSON Schema"],
    ),
    "tool parameters not an object": (
        [_bad_tool({"name": "t", "description": "d", "implementation": "clock", "parameters": ["a"]})],
        ["JSON Schema"],
    ),
    "tool implementation unknown": (
        [_bad_tool({"name": "t", "description": "d", "implementation": "teleport"})],
        ["teleport"],
    ),
    "tool name invalid": ([_bad_tool({"name": "bad name", "description": "d", "implementation": "clock"})], ["name"]),
    "select default not a choice": (
        [_bad_option({"type": "select", "name": "style", "options": ["plain", "upper"], "default": "bold"})],
        ["t2-bad", "default", "choices"],
    ),
    "select without choices": ([_bad_option({"type": "select", "name": "style", "default": ""})], ["choices"]),
    "option type unknown": ([_bad_option({"type": "number", "name": "n", "default": "1"})], ["type"]),
    "option default not a string": ([_bad_option({"type": "text", "name": "n", "default": 5})], ["default", "string"]),
    "option without name": ([_bad_option({"type": "text", "default": ""})], ["name"]),
    "unsupported capability": ([_bad(capabilities={"history": {"forever": {}}})], ["forever"]),
    "unknown tenant": ([_bad(tenants=["nobody-here"])], ["nobody-here"]),
    "agent listed twice": ([_bad(), _bad()], ["t2-bad", "twice"]),
    "entry without name": ([{"runtime": {"kind": "echo"}}], ["name"]),
    "not a list": ({"name": "t2-bad", "runtime": {"kind": "echo"}}, ["list"]),
}


@pytest.mark.parametrize("case", list(INVALID_FILES))
def test_apply_agents_refuses_an_invalid_file_with_a_readable_message(engine, db_access, tmp_path, case):
    """`engine`: the tenants the entries name exist (they are seeded with the engine), so each
    case is refused for its own fault, whatever ran before it on this worker."""
    from agents.models import Agent

    entries, fragments = INVALID_FILES[case]
    path = write(tmp_path, "bad.yaml", entries)
    before = set(Agent.objects.values_list("name", "version", "updated_at"))
    with pytest.raises(CommandError) as refused:
        call("apply_agents", path)
    message = str(refused.value)
    for fragment in fragments:
        assert fragment.lower() in message.lower(), f"{fragment!r} not in {message!r}"
    assert set(Agent.objects.values_list("name", "version", "updated_at")) == before, "all or nothing"


@pytest.mark.parametrize(
    "name, text",
    [
        ("broken.yaml", "agents: [name: {"),
        ("broken.json", '{"agents": ['),
        ("missing.yaml", None),
    ],
)
def test_apply_agents_refuses_an_unreadable_file(tmp_path, name, text, db_access):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(CommandError, match=name):
        call("apply_agents", str(path))


def test_a_refused_file_exits_non_zero_and_says_why(engine, tmp_path, db_access):
    from agents.models import Agent

    path = write(tmp_path, "bad.json", [ALPHA, _bad(version="1.0")])
    result = cli(engine, "apply_agents", path)
    assert result.returncode != 0
    assert "t2-bad" in result.stderr and "semantic version" in result.stderr
    assert "Traceback" not in result.stderr
    assert not Agent.objects.filter(name__in=["t2-alpha", "t2-bad"]).exists(), "nothing of the file was applied"

"""The Docker Compose deployment, read without a Docker engine: docker-compose.yml, the
Dockerfile, .env.example and the README are parsed; every setting the code reads reaches the
app containers, every command, script and path they name exists in the image layout, the web
port is on loopback, the worker's role and namespaces are what the sandbox needs, and the
healthcheck's host is one the service allows. deploy/entrypoint.sh running its roles is
tests/e2e/test_compose.py.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from ..support import ROOT

APP_SERVICES = ("init", "web", "worker", "beat")
ENV_READ = re.compile(
    r"""(?:os\.environ\.get|os\.environ\[|os\.getenv|env_bool|env_list|env_int|env_float)\(?\s*["']([A-Z][A-Z0-9_]+)["']"""
)
TEST_ONLY = {"DATABASE_TEST_NAME"}
WORKER_OWN = {"DATABASE_URL", "POSTGRES_PASSWORD"}  # what the worker's environment sets apart
# What bubblewrap needs beyond Docker's default seccomp profile (deploy/seccomp-worker.json).
NAMESPACE_SYSCALLS = {
    "clone",
    "mount",
    "pivot_root",
    "sethostname",
    "umount2",
    "unshare",
}  # set by scripts/test.sh for the suite's own database
SHELL_VAR = re.compile(r"\$\{([A-Z][A-Z0-9_]*)")


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def image_env() -> set[str]:
    names = set()
    for word, rest in dockerfile():
        if word == "ENV":
            names.update(re.findall(r"([A-Z][A-Z0-9_]*)=", rest))
    return names


def env_example() -> set[str]:
    """Every variable .env.example sets or documents (commented `# NAME=` lines)."""
    return set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", (ROOT / ".env.example").read_text(), re.M))


def settings_env() -> set[str]:
    return set(ENV_READ.findall((ROOT / "hosting" / "settings.py").read_text())) - TEST_ONLY


def entrypoint_roles() -> set[str]:
    text = (ROOT / "deploy" / "entrypoint.sh").read_text()
    case = text[text.index('case "$role" in') :]
    return {label.strip() for label in re.findall(r"^\s{4}([a-z-]+)\)", case, re.M)}


def dockerignored(path: str) -> bool:
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    parts = Path(path).parts
    return any(fnmatch.fnmatch(path, p.lstrip("*/")) or p in parts for p in patterns)


def image_path(path: str) -> Path | None:
    """The repository file an absolute path of the image comes from (COPY . . into /app)."""
    if path.startswith("/app/"):
        return ROOT / path.removeprefix("/app/")
    return None


def default_of(expression: str) -> str:
    """The value of a compose `${NAME:-default}` expression when NAME is unset."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", expression)


# --- static -------------------------------------------------------------------------------


def test_every_setting_the_code_reads_reaches_the_app_containers():
    services = compose()["services"]
    documented = env_example()
    for name in APP_SERVICES:
        service = services[name]
        assert service.get("env_file") == ".env", f"{name}: every .env line must reach it (env_file: .env)"
        reaching = set(service["environment"]) | documented | image_env()
        missing = sorted(settings_env() - reaching)
        assert not missing, (
            f"{name} never gets {missing}: pass them in docker-compose.yml or document them in .env.example"
        )
    # The environment of the app containers is the same everywhere (one key, one database),
    # but for the worker's login: its own role, and no owner password.
    assert len({id(services[name]["environment"]) for name in APP_SERVICES if name != "worker"}) == 1
    shared, worker = services["web"]["environment"], services["worker"]["environment"]
    assert {k: v for k, v in worker.items() if k not in WORKER_OWN} == {
        k: v for k, v in shared.items() if k not in WORKER_OWN
    }


def test_every_documented_setting_is_read_by_something():
    read = settings_env() | {"OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL"}  # agents files (defaultEnv)
    read |= {"COMPOSE_PROJECT_NAME"}  # compose itself: the project (and volume) name
    read |= set(SHELL_VAR.findall((ROOT / "deploy" / "entrypoint.sh").read_text()))
    read |= set(SHELL_VAR.findall((ROOT / "docker-compose.yml").read_text()))
    read |= set(SHELL_VAR.findall((ROOT / "deploy" / "healthcheck.py").read_text()))
    read |= set(re.findall(r"environ\.get\(\"([A-Z_]+)\"", (ROOT / "deploy" / "healthcheck.py").read_text()))
    read |= set(re.findall(r"\{\$([A-Z_]+)\}", (ROOT / "deploy" / "Caddyfile").read_text()))
    unused = sorted(env_example() - read)
    assert not unused, f".env.example documents settings nothing reads: {unused}"


def test_commands_scripts_and_paths_exist_in_the_image():
    steps = dockerfile()
    entrypoint = [rest for word, rest in steps if word == "ENTRYPOINT"][-1]
    entry_path = yaml.safe_load(entrypoint)[0]
    source = image_path(entry_path)
    assert source is not None and source.is_file(), entry_path
    assert os.access(source, os.X_OK), f"{entry_path} must be executable"
    mode = subprocess.run(
        ["git", "ls-files", "-s", str(source.relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    assert mode and mode[0] == "100755", "the entrypoint is committed executable (a fresh clone builds a working image)"
    assert not dockerignored("deploy/entrypoint.sh") and not dockerignored("manage.py")
    assert ("WORKDIR", "/app") in steps and ("COPY", ". .") in steps
    made = " ".join(rest for word, rest in steps if word == "RUN")
    roles = entrypoint_roles()
    assert {"web", "worker", "beat", "init", "first-run"} <= roles
    assert yaml.safe_load([rest for word, rest in steps if word == "CMD"][-1])[0] in roles

    services = compose()["services"]
    for name in APP_SERVICES:
        service = services[name]
        assert service["command"][0] in roles, f"{name}: {service['command']} is no role of the entrypoint"
        for volume in service.get("volumes", []):
            source_path, target = volume.split(":")[:2]
            if source_path.startswith("./"):
                assert (ROOT / source_path).exists(), f"{name} mounts {source_path}, which the repository lacks"
            elif target.startswith("/data/"):
                assert target in made, f"{name}: the image never creates {target} (owned by its user)"
        check = service.get("healthcheck")
        if name != "init":
            assert check, f"{name} has no healthcheck"
            for word in check["test"][1:]:
                if word.startswith("/app/"):
                    assert image_path(word).is_file() and not dockerignored(word.removeprefix("/app/")), word
            assert check["test"][-1] == name
    # deploy/ (the operator's agents.yaml beside the example) at /config.
    assert services["init"]["volumes"][0] == "./deploy:/config"
    assert services["init"]["environment"]["AAP_AGENTS_FILE"] == "/config/agents.yaml"
    caddy = services["caddy"]
    assert (ROOT / caddy["volumes"][0].split(":")[0]).is_file()
    assert "flush_interval -1" in (ROOT / "deploy" / "Caddyfile").read_text()
    assert "proxy_buffering off" in (ROOT / "deploy" / "nginx.conf.example").read_text()


def test_the_acp_image_variant_adds_agentao_and_nodejs():
    steps = dockerfile()
    args = {rest.split("=")[0] for word, rest in steps if word == "ARG"}
    assert {"ACP", "NPM_PACKAGES"} <= args
    acp_step = next(rest for word, rest in steps if word == "RUN" and "$ACP" in rest)
    assert "nodejs" in acp_step and "npm" in acp_step and "agentao" in acp_step
    assert "npm install --global $NPM_PACKAGES" in acp_step
    build_args = compose()["x-app"]["build"]["args"]
    assert default_of(build_args["ACP"]) == "0"


def test_the_web_port_is_published_on_loopback_only_by_default():
    services = compose()["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            if name == "caddy":
                continue  # the TLS front faces the network by design (profile "proxy")
            host = default_of(str(port)).split(":")[0]
            assert host == "127.0.0.1", f"{name} publishes {port} beyond loopback"
    assert services["caddy"]["profiles"] == ["proxy"]


def interpolate(expression: str, values: dict) -> str:
    """A compose expression with `${NAME:?message}` / `${NAME:-default}` / `${NAME}` resolved."""

    def one(match):
        name, op, rest = match.group(1), match.group(2) or "", match.group(3) or ""
        if name in values and (values[name] or op != ":-"):
            return values[name]
        assert op != ":?", f"{name} is required: {rest}"
        return rest

    return re.sub(r"\$\{([A-Z][A-Z0-9_]*)(:[?-])?([^}]*)\}", one, expression)


def test_postgres_and_redis_take_required_passwords_from_env():
    import secrets

    import dj_database_url

    text = (ROOT / "docker-compose.yml").read_text()
    services, env = compose()["services"], compose()["x-env"]
    # Required like SECRET_KEY: no default password anywhere (Grafana's is its own profile's).
    for name in ("POSTGRES_PASSWORD", "POSTGRES_WORKER_PASSWORD", "REDIS_PASSWORD"):
        uses = re.findall(r"\$\{" + name + r"(:[?-]|\})", text)
        assert uses and set(uses) == {":?"}, f"{name} must be required (${{{name}:?...}}) wherever compose uses it"
    assert not re.search(r"PASSWORD:-", text.replace("GRAFANA_ADMIN_PASSWORD:-", ""))
    example = (ROOT / ".env.example").read_text()
    for name in ("POSTGRES_PASSWORD", "POSTGRES_WORKER_PASSWORD", "REDIS_PASSWORD"):
        assert re.search(rf"^{name}=$", example, re.M), f".env.example leaves {name} for the operator to fill in"
    assert "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'" in example

    # Passwords of the generated kind survive the URLs they go into.
    values = {name: secrets.token_urlsafe(32) for name in ("POSTGRES_PASSWORD", "POSTGRES_WORKER_PASSWORD")}
    values["REDIS_PASSWORD"] = secrets.token_urlsafe(32)
    owner = dj_database_url.parse(interpolate(env["DATABASE_URL"], values))
    assert (owner["USER"], owner["PASSWORD"], owner["HOST"]) == ("aap", values["POSTGRES_PASSWORD"], "postgres")
    postgres = services["postgres"]["environment"]
    assert interpolate(postgres["POSTGRES_PASSWORD"], values) == owner["PASSWORD"]
    assert postgres["POSTGRES_USER"] == owner["USER"] and postgres["POSTGRES_DB"] == owner["NAME"]
    redis_url = urlsplit(interpolate(env["REDIS_URL"], values))
    assert (redis_url.hostname, redis_url.password) == ("redis", values["REDIS_PASSWORD"])

    # Redis asks for it, and its healthcheck gives it (redis-cli reads REDISCLI_AUTH).
    redis = services["redis"]
    command = redis["command"]
    assert interpolate(command[command.index("--requirepass") + 1], values) == values["REDIS_PASSWORD"]
    assert interpolate(redis["environment"]["REDISCLI_AUTH"], values) == values["REDIS_PASSWORD"]
    assert redis["healthcheck"]["test"][1:] == ["redis-cli", "ping"]


def test_the_worker_logs_in_as_a_role_that_cannot_change_agents():
    services, env = compose()["services"], compose()["x-env"]
    values = {
        name: f"pw-{name.lower()}" for name in ("POSTGRES_PASSWORD", "POSTGRES_WORKER_PASSWORD", "REDIS_PASSWORD")
    }
    worker_env = services["worker"]["environment"]
    worker_url = urlsplit(interpolate(worker_env["DATABASE_URL"], values))
    owner_url = urlsplit(interpolate(env["DATABASE_URL"], values))
    # Its own role on the same database, the one init grants (AAP_WORKER_DATABASE_URL)...
    assert worker_env["DATABASE_URL"] == env["AAP_WORKER_DATABASE_URL"]
    assert worker_url.username != owner_url.username and worker_url.path == owner_url.path
    assert worker_url.password == values["POSTGRES_WORKER_PASSWORD"]
    # ...and the owner's password, which env_file would pass it with every line of .env, blanked.
    assert worker_env["POSTGRES_PASSWORD"] == ""
    for name in APP_SERVICES:
        if name != "worker":
            assert services[name]["environment"]["DATABASE_URL"] == env["DATABASE_URL"], name
    # init grants the role after every migrate (new tables included).
    text = (ROOT / "deploy" / "entrypoint.sh").read_text()
    body = text[text.index("init() {") : text.index("\n}\n", text.index("init() {"))]
    assert body.index("manage migrate") < body.index("manage grant_worker_role")
    # What it grants: sessions_app written, agents and tenants read only (but the tools their
    # MCP servers listed, which workers list), tokens hidden.
    from infra.management.commands import grant_worker_role

    writes, reads = grant_worker_role.written_tables(), grant_worker_role.read_tables()
    assert {"sessions_app_session", "sessions_app_turn", "sessions_app_message", "sessions_app_worker"} <= set(writes)
    assert {"agents_agent", "agents_agentoption", "agents_servertool", "agents_agent_tenants", "hosting_tenant"} <= set(
        reads
    )
    assert [t for t in writes if t.startswith(("agents_", "hosting_"))] == ["agents_mcptoollist"]
    assert not set(reads) & set(writes)
    assert "hosting_apitoken" not in reads + writes


def test_the_worker_container_may_start_agents_in_namespaces():
    services = compose()["services"]
    options = services["worker"]["security_opt"]
    assert "seccomp=./deploy/seccomp-worker.json" in options
    assert "systempaths=unconfined" in options  # a PID namespace mounts its own /proc...
    assert "no-new-privileges:true" in options  # ...which no setuid program can make root write to
    assert not any(o.split("=")[0] in ("seccomp", "apparmor") and o.endswith("unconfined") for o in options)
    for name, service in services.items():
        if name != "worker":
            assert "security_opt" not in service, f"{name} keeps Docker's defaults"

    profile = json.loads((ROOT / "deploy" / "seccomp-worker.json").read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    *default, added = profile["syscalls"]
    # Docker's default profile, then one rule: exactly what bubblewrap needs, for every process.
    assert added == {"names": sorted(NAMESPACE_SYSCALLS), "action": "SCMP_ACT_ALLOW", "comment": added["comment"]}
    unconditional = {
        name
        for rule in default
        if rule["action"] == "SCMP_ACT_ALLOW" and not rule.get("args") and not rule.get("includes")
        for name in rule["names"]
    }
    assert not unconditional & NAMESPACE_SYSCALLS, "the default part grants them only with CAP_SYS_ADMIN"
    assert not unconditional & {"bpf", "keyctl", "add_key", "request_key", "setns", "kexec_load", "open_by_handle_at"}
    assert {"landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self"} <= unconditional
    privileged = next(rule for rule in default if rule.get("includes") == {"caps": ["CAP_SYS_ADMIN"]})
    assert NAMESPACE_SYSCALLS - {"pivot_root"} <= set(privileged["names"])

    # bubblewrap is in the image, without recommends, installed as root before USER.
    steps = dockerfile()
    index = next(i for i, (word, rest) in enumerate(steps) if word == "RUN" and "bubblewrap" in rest)
    assert "--no-install-recommends bubblewrap" in steps[index][1]
    assert index < next(i for i, (word, _) in enumerate(steps) if word == "USER")


def test_the_healthcheck_host_is_one_the_service_allows():
    import importlib.util

    spec = importlib.util.spec_from_file_location("healthcheck", ROOT / "deploy" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from django.http.request import validate_host

    for allowed in ("aap.example.com", ".example.com", "*", "127.0.0.1,localhost", " ,aap.example.com"):
        hosts = [h.strip() for h in allowed.split(",") if h.strip()]
        os.environ["ALLOWED_HOSTS"] = allowed
        try:
            assert validate_host(module.allowed_host(), hosts), allowed
        finally:
            del os.environ["ALLOWED_HOSTS"]


def test_the_readme_deploy_steps_name_services_roles_and_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Deploy with Docker Compose") :]
    section = section[: section.index("\n## ", 4)]
    block = section[section.index("```sh") + 5 : section.index("```", section.index("```sh") + 5)]
    services, roles = compose()["services"], entrypoint_roles()
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands[0] == "cp .env.example .env" and (ROOT / ".env.example").is_file()
    seen_first_run = False
    for command in commands:
        words = command.split()
        if words[:2] == ["docker", "compose"]:
            if "run" in words:
                service = words[words.index("--rm") + 1]
                assert service in services, command
                role = words[words.index(service) + 1]
                assert role in roles, command
                seen_first_run |= role == "first-run"
            if "exec" in words:
                assert words[words.index("exec") + 1] in services, command
        for word in words:
            if word.startswith("deploy/") and word != "deploy/agents.yaml":  # first-run makes it
                assert (ROOT / word).is_file(), command
    assert seen_first_run, "the walk-through creates the first tenant"
    # The agents file the walk-through edits is the one the init service applies.
    assert services["init"]["volumes"][0].startswith("./deploy:")
    assert services["init"]["environment"]["AAP_AGENTS_FILE"] == "/config/agents.yaml"
    assert "deploy/agents.yaml" in block and (ROOT / "deploy" / "agents.example.yaml").is_file()
    # Every setting the deploy section names is one .env.example documents.
    named = set(re.findall(r"`([A-Z][A-Z0-9_]{3,})`", section))
    assert named <= env_example(), sorted(named - env_example())

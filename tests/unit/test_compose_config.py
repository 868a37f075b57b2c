"""docker-compose.yml rendered with a sample .env: every variable .env.example documents
reaches the service it is meant for, with the value the operator wrote.

Rendered the way `docker compose config` renders it (tests/compose_render.py): interpolation
from `.env`, merge keys, `env_file` then `environment`.
"""

from __future__ import annotations

import pytest

from tests.compose_render import MissingVariable, documented, render

APP_SERVICES = ("init", "web", "worker", "beat")
# What docker-compose.yml sets itself whatever .env says (.env.example says so beside each).
COMPOSE_SETS = {"AAP_METRICS_ADDR": "0.0.0.0"}


def sample_value(name: str) -> str:
    return f"sample-{name.lower().replace('_', '-')}"


def sample_dotenv() -> str:
    return "".join(f"{name}={sample_value(name)}\n" for name in documented())


@pytest.fixture(scope="module")
def config() -> dict:
    return render(sample_dotenv())


def test_every_documented_variable_reaches_every_app_service(config):
    services = config["services"]
    for service in APP_SERVICES:
        env = services[service]["resolved_environment"]
        for name in documented():
            if name in COMPOSE_SETS:
                assert env[name] == COMPOSE_SETS[name], (service, name)
            elif service == "worker" and name == "POSTGRES_PASSWORD":
                assert env[name] == "", "the database owner's password must not reach the worker"
            else:
                assert env.get(name) == sample_value(name), f"{service} does not get {name} from .env"


def test_compose_only_variables_reach_the_services_they_configure(config):
    services = config["services"]
    owner, worker, redis = (
        sample_value(n) for n in ("POSTGRES_PASSWORD", "POSTGRES_WORKER_PASSWORD", "REDIS_PASSWORD")
    )
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == owner
    assert f"max_connections={sample_value('POSTGRES_MAX_CONNECTIONS')}" in services["postgres"]["command"]
    assert redis in services["redis"]["command"] and services["redis"]["environment"]["REDISCLI_AUTH"] == redis
    for service in APP_SERVICES:
        env = services[service]["resolved_environment"]
        assert env["REDIS_URL"] == f"redis://:{redis}@redis:6379/0"
        assert env["AAP_WORKER_DATABASE_URL"] == f"postgres://aap_worker:{worker}@postgres:5432/aap"
        role = ("aap_worker", worker) if service == "worker" else ("aap", owner)
        assert env["DATABASE_URL"] == f"postgres://{role[0]}:{role[1]}@postgres:5432/aap", service
        build = services[service]["build"]["args"]
        assert build == {"ACP": sample_value("AAP_IMAGE_ACP"), "NPM_PACKAGES": sample_value("AAP_IMAGE_NPM_PACKAGES")}
    assert services["web"]["ports"] == [f"{sample_value('AAP_BIND')}:{sample_value('AAP_PORT')}:8000"]
    assert services["caddy"]["environment"]["AAP_DOMAIN"] == sample_value("AAP_DOMAIN")
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == sample_value("GRAFANA_ADMIN_PASSWORD")


def test_the_model_endpoint_reaches_init_which_applies_the_agents_file(config):
    init = config["services"]["init"]["resolved_environment"]
    for name in ("OPENAI_BASE_URL", "OPENAI_MODEL", "OPENAI_API_KEY"):
        assert init[name] == sample_value(name)
    assert init["AAP_AGENTS_FILE"] == "/config/agents.yaml"


def test_defaults_apply_when_only_the_required_settings_are_given():
    required = (
        "SECRET_KEY",
        "HOSTING_ENCRYPTION_KEYS",
        "POSTGRES_PASSWORD",
        "POSTGRES_WORKER_PASSWORD",
        "REDIS_PASSWORD",
    )
    config = render("".join(f"{name}=x{i}\n" for i, name in enumerate(required)))
    services = config["services"]
    assert services["web"]["ports"] == ["127.0.0.1:8000:8000"]
    assert "max_connections=200" in services["postgres"]["command"]
    assert services["web"]["resolved_environment"]["AAP_METRICS"] == "off"
    for name in required:
        dotenv = "".join(f"{other}=x\n" for other in required if other != name)
        with pytest.raises(MissingVariable, match=name):
            render(dotenv)

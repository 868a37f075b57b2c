"""docker-compose.yml rendered as `docker compose config` would, without Docker.

Variables are interpolated from a `.env` (compose's rules: `$$`, `$NAME`, `${NAME}`,
`${NAME:-default}`, `${NAME-default}`, `${NAME:?error}`, `${NAME?error}`, `${NAME:+alt}`,
`${NAME+alt}`), YAML merge keys are resolved by the loader, and each service's environment
is its `env_file` lines overridden by its `environment`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.support import ROOT

VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<bare>[A-Za-z_][A-Za-z0-9_]*)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\})"
)


class MissingVariable(Exception):
    """What compose refuses to start with: a `${NAME:?message}` whose NAME is unset."""


def parse_dotenv(text: str) -> dict[str, str]:
    values = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name.strip()] = value
    return values


def interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        name = match["bare"] or match["name"]
        op, arg = match["op"], match["arg"] or ""
        present = name in env
        filled = present and env[name] != ""
        ok = filled if op and op.startswith(":") else present
        if op in (":-", "-"):
            return env[name] if ok else interpolate(arg, env)
        if op in (":?", "?"):
            if not ok:
                raise MissingVariable(f"{name}: {arg}")
            return env[name]
        if op in (":+", "+"):
            return interpolate(arg, env) if ok else ""
        return env.get(name, "")

    return VARIABLE.sub(one, value)


def as_mapping(environment: Any) -> dict[str, str]:
    if isinstance(environment, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in environment)
    return {k: "" if v is None else str(v) for k, v in (environment or {}).items()}


def interpolated(dotenv: str, compose_file: Path = ROOT / "docker-compose.yml") -> dict:
    """The file as compose validates it: YAML (merge keys resolved) with variables interpolated."""
    return interpolate(yaml.safe_load(compose_file.read_text()), parse_dotenv(dotenv))


def render(dotenv: str, compose_file: Path = ROOT / "docker-compose.yml") -> dict:
    """The rendered configuration; each service gains `resolved_environment`."""
    env = parse_dotenv(dotenv)
    config = interpolated(dotenv, compose_file)
    for service in config["services"].values():
        resolved: dict[str, str] = {}
        env_files = service.get("env_file") or []
        for name in [env_files] if isinstance(env_files, str) else env_files:
            assert name == ".env", f"only the project's .env is rendered here, not {name}"
            resolved.update(env)
        resolved.update(as_mapping(service.get("environment")))
        service["resolved_environment"] = resolved
    return config


def documented() -> list[str]:
    """Every variable .env.example sets or documents (`NAME=` and commented `# NAME=`)."""
    text = (ROOT / ".env.example").read_text()
    return re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", text, re.M)

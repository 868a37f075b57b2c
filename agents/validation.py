"""Checks of an agent as a whole (its runtime with its options), shared by the admin form
and `apply_agents`, so an agent that could not run a single turn is never saved."""

from __future__ import annotations


def model_source_error(runtime_kind: str, runtime_config, options: list[dict]) -> str | None:
    """Why an agent of this kind would have no model to call, or None.

    An `openai` agent takes its model from a `model` option (its default, or the value the
    application sets) or else from `model` in its runtime configuration.
    """
    if runtime_kind != "openai":
        return None
    config = runtime_config if isinstance(runtime_config, dict) else {}
    if str(config.get("model") or "").strip():
        return None
    if any(isinstance(option, dict) and option.get("name") == "model" for option in options):
        return None
    return (
        'An openai agent needs a model to call: put "model" in the runtime configuration '
        '(e.g. {"model": "gpt-4o-mini"}) or add a text option named \'model\'.'
    )


def mcp_option_error(runtime_config, options: list[dict]) -> str | None:
    """Why the agent's MCP servers take a value from an option it does not declare, or None."""
    from .runtimes.mcp_config import options_named

    config = runtime_config if isinstance(runtime_config, dict) else {}
    servers = config.get("mcpServers")
    if not isinstance(servers, list):
        return None
    declared = {option.get("name") for option in options if isinstance(option, dict)}
    missing = sorted(options_named([s for s in servers if isinstance(s, dict)]) - declared)
    if missing:
        return (
            f"The MCP servers take the value of option {', '.join(repr(m) for m in missing)}, which this agent "
            "does not declare; add it to the agent's options (a secret option for a key)."
        )
    return None

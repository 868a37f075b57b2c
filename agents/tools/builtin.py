"""Built-in host tools: clock and add."""

from datetime import UTC, datetime
from numbers import Real

from . import HostTool, ToolInputError, register


async def _clock(arguments: dict, settings: dict) -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _number(arguments: dict, key: str):
    value = arguments.get(key)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ToolInputError(f"'{key}' must be a number.")
    return value


async def _add(arguments: dict, settings: dict) -> str:
    total = _number(arguments, "a") + _number(arguments, "b")
    if (
        isinstance(total, float)
        and total.is_integer()
        and not (isinstance(arguments["a"], float) or isinstance(arguments["b"], float))
    ):
        total = int(total)
    return str(total)


register(
    HostTool(
        name="clock",
        title="Clock",
        description="Returns the current UTC time in ISO 8601.",
        parameters={"type": "object", "properties": {}, "additionalProperties": False},
        run=_clock,
    )
)
register(
    HostTool(
        name="add",
        title="Add two numbers",
        description="Returns a + b.",
        parameters={
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        run=_add,
    )
)

"""The `openai` runtime: any model behind an OpenAI-compatible Chat Completions API.

Options (declared by the operator, overridable by the application): `model`, `apiKey`
(secret), `baseUrl`. Configuration: see `OpenAIRuntime.config_schema`. Provider failures end
the turn with stop reason `error` and a short safe sentence (status and kind, never the key,
the request or the provider's message); an answer only counts as finished with a finish
reason. Each failure is logged once with the provider's own text, secrets redacted.

By job: `loop` (the agent loop and the runtime class), `conversion` (AAP messages to Chat
Completions messages and back), `compaction` (the context budget and summaries), `client`
(pooled model clients, the raw request, the network guard, safe errors), `state` (what a
turn keeps).
"""

from .client import safe_error
from .conversion import estimate_tokens
from .loop import OpenAIRuntime

__all__ = ["OpenAIRuntime", "estimate_tokens", "safe_error"]

"""The parts of the `acp` runtime: agent processes, ACP sessions and prompts, the client
methods agents call (confined files, terminals), and the routing of turns to the worker
that holds a session's prompt."""

"""How many of the project's files one echo turn runs code from (`python -m bench.turn_files`).

The embedded mode (SQLite, no Redis) in this process, driven through the ASGI application:
a session, a first turn (warm: imports and caches), then the turn that is counted, a short
`delta` stream from POST to `turn_stop`. A profile hook on every thread (set before any
thread of the web or the engine starts) records the file of every function called while
that turn runs; module bodies (imports) are not counted. Prints the count and the files.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    var = tempfile.mkdtemp(prefix="aap-turn-files-")
    os.environ.update(
        DJANGO_SETTINGS_MODULE="hosting.settings",
        SECRET_KEY=os.environ.get("SECRET_KEY", "bench-only-secret-key-" + "x" * 40),
        HOSTING_VAR_DIR=var,
        DEBUG="0",
        REDIS_URL="",
        DATABASE_URL="",
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    out = io.StringIO()
    call_command("seed_demo", stdout=out)
    token = out.getvalue().strip().splitlines()[-1]

    import httpx

    from hosting.asgi import application

    root = f"{ROOT}/"
    seen: set[str] = set()
    recording = False

    def hook(frame, event, arg):
        name = frame.f_code.co_filename
        if (
            recording
            and name.startswith(root)
            and "/.venv/" not in name
            and "/bench/" not in name
            and frame.f_code.co_name != "<module>"
        ):
            seen.add(name[len(root) :])

    threading.setprofile(hook)
    sys.setprofile(hook)

    async def turns() -> str:
        nonlocal recording
        transport = httpx.ASGITransport(app=application)
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", headers=headers) as client:
            session = (await client.post("/v1/sessions", json={"agent": {"name": "echo"}})).json()["sessionId"]
            body = {"messages": [{"role": "user", "content": "warm"}], "stream": "delta"}
            await client.post(f"/v1/sessions/{session}/turns", json=body)
            recording = True
            body = {"messages": [{"role": "user", "content": "hello"}], "stream": "delta"}
            response = await client.post(f"/v1/sessions/{session}/turns", json=body)
            recording = False
            return response.text

    text = asyncio.run(turns())
    sys.setprofile(None)
    threading.setprofile(None)
    if "turn_stop" not in text:
        print(f"the counted turn did not end: {text[-300:]}", file=sys.stderr)
        return 1
    print(f"{len(seen)} project files run code for one echo turn:")
    for name in sorted(seen):
        print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

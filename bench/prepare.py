"""Migrate and empty the bench database, then seed it: `manage.py migrate`, `flush`,
`seed_demo` and `apply_agents FILE` in one process (one Django start-up instead of four).
Prints the demo tenant's token as the last line, like seed_demo.

    python -m bench.prepare AGENTS_FILE
"""

from __future__ import annotations

import io
import sys


def main() -> None:
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", interactive=False, verbosity=0)
    call_command("flush", interactive=False, verbosity=0)
    out = io.StringIO()
    call_command("seed_demo", stdout=out)
    call_command("apply_agents", sys.argv[1], stdout=io.StringIO())
    print(out.getvalue().strip().splitlines()[-1])


if __name__ == "__main__":
    main()

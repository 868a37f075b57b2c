import pytest

# The escape suites' model server and planted key (a module that defines its own `model` keeps it).
from .escape import key_file, model  # noqa: F401


@pytest.fixture
def client(stack):
    """The demo tenant's AAP client on whichever stack the test runs against."""
    client = stack.client()
    yield client
    client.close()

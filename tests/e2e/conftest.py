import pytest


@pytest.fixture
def client(stack):
    """The demo tenant's AAP client on whichever stack the test runs against."""
    client = stack.client()
    yield client
    client.close()

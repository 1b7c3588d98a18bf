import pytest
from situation import become_subreaper, live_children


@pytest.fixture(autouse=True, scope="session")
def _subreaper():
    become_subreaper()


@pytest.fixture(autouse=True)
def no_process_outlives_a_test():
    """After every sandbox test no process started through it is alive (see situation.become_subreaper)."""
    before = set(live_children())
    yield
    assert set(live_children()) - before == set()

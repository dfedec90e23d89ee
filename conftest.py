"""Repository-wide pytest hooks."""


def pytest_sessionfinish(session, exitstatus):
    """A marker selection that matches no test (pytest's exit 5) is not a failure."""
    if exitstatus == 5:
        session.exitstatus = 0

"""Repository-wide pytest hooks."""
import os


def pytest_configure(config):
    """Under CI the oracle tests (transformers) must run, never skip: CI installs the ``test``
    extra, so a missing torch or transformers is a broken install, reported as one."""
    if os.environ.get("CI"):
        import torch  # noqa: F401
        import transformers  # noqa: F401


def pytest_sessionfinish(session, exitstatus):
    """A marker selection that matches no test (pytest's exit 5) is not a failure."""
    if exitstatus == 5:
        session.exitstatus = 0

"""CI cannot pass on nothing: the suite-wide hooks of conftest.py, run on small suites of their own.

Each case copies this directory's conftest.py next to a two-line test file and runs pytest on it
in a subprocess, with and without ``CI`` set, and checks the exit status.
"""
from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture
def suite(pytester, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_small="""
        import pytest

        def test_runs():
            assert 1 + 1 == 2

        def test_skips():
            pytest.skip("an optional package is missing")
    """)
    return pytester


def test_a_skip_fails_the_run_under_ci(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*CI is set and 1 test(s) skipped, which fails the run*test_skips*"])


def test_a_skip_is_only_reported_outside_ci(suite):
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK


@pytest.mark.parametrize("value", ["0", "false", ""])
def test_ci_off_values(suite, monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert suite.runpytest("-p", "no:cacheprovider").ret == pytest.ExitCode.OK


def test_a_selection_that_runs_nothing_fails(suite, monkeypatch):
    """`pytest -k typo` selects nothing: pytest's exit status 5, no longer mapped to success."""
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-p", "no:cacheprovider", "-k", "no_such_test")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_ci_script_sets_ci_and_runs_the_readme_command():
    import re

    ci = (README.parent / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", README.read_text(), flags=re.S)
    lines = [line for line in ci.splitlines() if line and not line.startswith("#")]
    assert "export CI=true" in lines
    assert lines[-1] == commands[1].strip()  # the last thing it runs is exactly the README's

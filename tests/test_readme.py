"""The README is what a new user follows: its example runs, its commands are the ones CI and a
first install use, and it points only at files the user has."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", README.read_text(), flags=re.S)


def test_readme_examples_run():
    """Every Python example (the v1 engine loop, the v2 chunked/speculative loop) runs as shown,
    asserts included."""
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    first, second = commands()[:2]
    assert "pagedkv report" in first
    assert "pytest" in second
    ci = (README.parent / ".ci" / "run").read_text()
    assert second.strip() in ci


def test_the_main_job_installs_no_torch():
    """The first command installs the plot extra only: no torch, no transformers (GBs of CUDA)."""
    installs = re.findall(r'pip install "([^"]+)"', commands()[0])
    assert installs == [".[plot]"]
    assert "model" not in commands()[0] and "torch" not in commands()[0]


def test_readme_points_only_at_files_the_user_has():
    text = README.read_text()
    assert "../shared" not in text
    assert "DESIGN.md" not in text  # the design lives in the repository: docs/design.md
    assert "docs/design.md" in text
    for path in re.findall(r"`(src/pagedkv/[\w/.]+)`", text):
        assert (README.parent / path).exists(), path


def test_nothing_in_the_package_refers_to_shared():
    """Users have no ../shared: code, help texts, messages and docstrings must not send them there."""
    root = README.parent / "src" / "pagedkv"
    offenders = [str(p.relative_to(root)) for p in root.rglob("*")
                 if p.suffix in (".py", ".md", ".txt") and "../shared" in p.read_text(encoding="utf-8")]
    assert offenders == []

"""Repository facts: CI runs the README's test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = readme.split("```bash\n")
    commands = [b.split("\n```")[0].strip() for b in blocks[1:]]
    test_command = next(c for c in commands if c.endswith("pytest"))
    assert test_command in ci.splitlines()

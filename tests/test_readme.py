"""The README's first two commands are what CI runs: `.ci/run` must contain them, the first one minus
its blocking `tandem up` (CI runs `.ci/smoke_up.py` in its place), the second one verbatim."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_commands() -> None:
    install_and_run, test = _readme_commands()[:2]
    assert install_and_run.endswith(" && tandem up"), install_and_run
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install_and_run.removesuffix(" && tandem up") in ci
    assert "python .ci/smoke_up.py" in ci
    assert test in ci
    # nothing is installed before the README's own install line
    first_install = next(i for i, line in enumerate(ci) if "pip install" in line)
    assert ci[first_install] == install_and_run.removesuffix(" && tandem up")


def test_readme_test_command_runs_pytest_on_tests() -> None:
    test = _readme_commands()[1]
    assert "pip install -e '.[test]'" in test and test.endswith("python -m pytest -q tests")

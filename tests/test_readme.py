"""The README's two set-up lines exist, name real things, and CI runs exactly its test line."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def _line_after(marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", README)
    assert match, f"no code block after <!-- {marker} --> in README.md"
    return match.group(1)


def test_run_line_names_existing_config_and_entry_point():
    line = _line_after("ci:run")
    assert line.startswith("pip install torch==2.13.0 && ")  # CPU torch first, always
    configs = re.findall(r"--config (\S+)", line)
    assert configs and all((ROOT / c).is_file() for c in configs)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lightning-llm"] == "lightning_llm.cli:main"
    assert "lightning-llm fit" in line


def test_test_line_is_what_ci_runs():
    line = _line_after("ci:test")
    assert line.startswith("pip install torch==2.13.0 && ") and "pytest" in line and '".[dev]"' in line
    extracted = subprocess.run(
        [
            "awk",
            "/<!-- ci:test -->/ {found=1; next} found && /^```/ {if (inblock) exit; inblock=1; next} "
            "found && inblock {print; exit}",
            "README.md",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert extracted == line
    assert "<!-- ci:test -->" in (ROOT / ".ci" / "run").read_text()


MAIN_CONFIG = re.search(r"--config (\S+)", _line_after("ci:run")).group(1)
_REAL = "model: smollm2-135m" in (ROOT / MAIN_CONFIG).read_text()


@(pytest.mark.pretrained if _REAL else lambda f: f)
def test_python_dash_m_runs_the_readme_config(tmp_path, tiny_backbone, request):
    if _REAL:
        request.getfixturevalue("smollm2_dir")  # the shared, converted SmolLM2 (fetched once)
    config = MAIN_CONFIG
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_llm",
            "fit",
            "--config",
            str(ROOT / config),
            "--trainer.fast_dev_run=true",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train/" in proc.stdout + proc.stderr  # progress (train/loss, train/reward...) is printed

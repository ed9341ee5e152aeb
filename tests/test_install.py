"""The cookbook installs beside the torch and Megatron-Core a GPU image already has, and replaces neither.

GPU images (PAI, NGC) ship Python 3.12 with a CUDA build of torch and, usually, Megatron-Core. pip's own resolver
decides, from the cookbook's real metadata, what `pip install -e .` would change. It runs here in a fresh Python 3.12
virtual environment holding a stub torch and a stub megatron-core: dist-info folders that each declare one version
and nothing else. That is honest for this question because the resolver reads only installed metadata, and cheap (no
5 GB CUDA wheel per CI run); CI's own default environment is a real install of both (ci/setup_env.sh), and the full
install on a real torch 2.11.0+cu130 ran once, recorded in docs/installing.md. The controls, a torch below the
cookbook's floor and a megatron-core below its range, must come out replaced: the check can fail.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _python312() -> str | None:
    """A working Python 3.12 (pyenv's shims answer for versions they do not activate, so each is run)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for candidate in ["python3.12", *map(str, sorted(pyenv.glob("versions/3.12*/bin/python3.12")))]:
        try:
            if subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                              capture_output=True, timeout=30).returncode == 0:
                return candidate
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


PYTHON312 = _python312()


def _stub(site: Path, name: str, version: str) -> None:
    """An installed distribution as pip's resolver sees it: a dist-info folder declaring `name` at `version`."""
    folder = name.replace("-", "_")
    for old in site.glob(f"{folder}-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = site / f"{folder}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def _would_install(python: Path, report: Path) -> dict[str, str]:
    """name -> version of everything `pip install -e .` would install or replace (the extras hold nothing that
    depends on torch; leaving them out halves the resolution, about 30 s with pip's cache warm)."""
    done = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                           "-e", str(ROOT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


@pytest.mark.skipif(PYTHON312 is None, reason="no Python 3.12 on this machine (GPU images' Python)")
def test_install_keeps_the_torch_and_megatron_core_a_gpu_image_has(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([PYTHON312, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # An NGC container's pre-release build of the floor release: the lowest torch the cookbook keeps (PyPI's
    # 2.11.0+cu130, what the lent GPU machines have, sorts above it), beside the Megatron-Core of late-2026 images.
    _stub(site, "torch", "2.11.0a0+6c3e8d5.nv26.02")
    _stub(site, "megatron-core", "0.19.2")
    plan = _would_install(python, tmp_path / "report.json")
    assert "torch" not in plan, f"installing beside the image's torch would replace it with {plan['torch']}"
    assert "megatron-core" not in plan, f"the image's megatron-core 0.19.2 would become {plan['megatron-core']}"
    assert "pai-cookbook" in plan, plan
    # The controls: what lies outside the ranges is replaced, so the check can fail.
    _stub(site, "torch", "2.5.1")
    _stub(site, "megatron-core", "0.15.3")
    plan = _would_install(python, tmp_path / "report.json")
    assert "torch" in plan, "a torch below the floor was kept"
    assert plan["megatron-core"].startswith("0.19."), f"megatron-core 0.15.3 was kept or replaced oddly: {plan}"



def test_the_range_checked_at_import_is_the_one_pyproject_declares():
    import tomllib
    from packaging.requirements import Requirement

    from pai_cookbook.core.machine import versions

    declared = {Requirement(d).name: Requirement(d).specifier
                for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert declared["megatron-core"] == versions.MEGATRON_CORE and declared["torch"] == versions.TORCH
    assert set(versions.TESTED) == {"0.16", "0.19"}


@pytest.mark.parametrize("command", ["pai_cookbook.plan", "pai_cookbook.convert", "pai_cookbook.harness"])
def test_a_command_under_a_megatron_core_outside_the_range_says_one_line(command, tmp_path):
    """`python -m pai_cookbook.<command>` beside a Megatron-Core outside the range: exit 2 and the refusal as one line,
    as its bad input is said (it was an import traceback); a plain import still raises."""
    import subprocess
    import sys

    metadata = tmp_path / "megatron_core-0.5.0.dist-info"  # found before the installed one: PYTHONPATH comes first
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.5.0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    ran = subprocess.run([sys.executable, "-m", command, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
    assert ran.stderr.startswith("error: megatron-core 0.5.0 is installed, but the cookbook is tested on megatron-core")
    imported = subprocess.run([sys.executable, "-c", "import pai_cookbook"], env=env, capture_output=True, text=True,
                              timeout=120)
    assert imported.returncode == 1 and "RuntimeError: megatron-core 0.5.0 is installed" in imported.stderr

"""A built wheel holds the whole program and runs without the source tree (issue 10).

The wheel is built from a copy of the sources (so nothing is written into the working tree) and
installed with ``pip --target``; tests/wheel_check.py then imports every module from there and runs
the CLI and the window. CI (.ci/run) does the same in a second fresh venv with the dependencies.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
SOURCES = {"app": "shardscope/app", "backend": "shardscope/backend", "widgets": "shardscope/widgets",
           "resources": "shardscope/resources"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in (*SOURCES, "setup.py", "pyproject.toml", "README.md", "LICENSE"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        elif path.exists():
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(src)], check=True, capture_output=True, timeout=600)
    return next(out.glob("shardscope-*.whl"))


def test_wheel_holds_every_module_and_resource(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    expected = {"shardscope/__init__.py", "shardscope/__main__.py"}
    for folder, target in SOURCES.items():
        for f in (ROOT / folder).rglob("*"):
            rel = f.relative_to(ROOT / folder)
            if f.is_file() and "__pycache__" not in rel.parts and rel.parts[0] != "package":
                if f.suffix in (".py", ".png", ".svg", ".qss", ".json"):
                    expected.add(f"{target}/{rel.as_posix()}")
    assert expected - names == set(), "left out of the wheel"
    assert any(n.startswith("shardscope/resources/screenshots/") for n in names)
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("fsspec") for r in requires), requires
    pyside = next(r for r in requires if r.startswith("PySide6-Essentials"))
    assert "!=6.12.0" in pyside, pyside
    assert "shardscope = shardscope.app.cli:main" in entry_points


def test_installed_wheel_imports_and_runs_without_the_sources(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    # run from outside the source tree, the target first on the path: the editable install must not answer
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "wheel_check.py"), "--site", str(site),
                           "--script", str(site / "bin" / "shardscope")], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    assert "modules import from" in proc.stdout

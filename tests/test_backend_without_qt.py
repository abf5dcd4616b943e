"""backend/ imports and works without Qt: importing PySide6, shiboken6 or pyqtgraph fails in its process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path


def test_backend_imports_without_qt(fixtures):
    """Every backend module imports and works where importing PySide6, shiboken6 or pyqtgraph fails."""
    code = textwrap.dedent(f"""
        import importlib, json, pkgutil, sys

        BLOCKED = ("PySide6", "shiboken6", "pyqtgraph")
        tried = []

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    tried.append(name)
                    raise ImportError(f"{{name}} is blocked in this test")
                return None

        sys.meta_path.insert(0, Block())
        import shardscope.backend as backend

        modules = []
        def failed(name):
            raise SystemExit(f"cannot import {{name}}: {{sys.exc_info()[1]!r}}")
        for info in pkgutil.walk_packages(backend.__path__, "shardscope.backend.", onerror=failed):
            importlib.import_module(info.name)
            modules.append(info.name)
        from shardscope import report
        from shardscope.backend.formats import open_checkpoint
        from shardscope.backend.checkpoint.verify import verify
        problems = verify(open_checkpoint({str(fixtures['nopg'])!r}), deep=True)
        print(json.dumps({{"modules": modules, "tried": tried, "problems": len(problems),
                          "qt_loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["tried"] == [] and out["qt_loaded"] == [] and out["problems"] == 0
    # the walk reached every module file under backend/ (a package left out would be missed here)
    src = Path(__file__).parent.parent / "backend"
    on_disk = {".".join(("shardscope", "backend", *f.relative_to(src).with_suffix("").parts)).removesuffix(".__init__")
               for f in src.rglob("*.py") if f.name != "__main__.py"} - {"shardscope.backend"}
    assert on_disk <= set(out["modules"]), on_disk - set(out["modules"])

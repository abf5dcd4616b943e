"""Session fixtures: real checkpoints written by torch's own dcp.save in multi-process gloo runs."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# A suite started in the background by a non-interactive shell (`bash .ci/run &`) inherits SIGINT ignored, and so
# would every CLI it starts: their Ctrl-C tests (follow detaching, an interrupted download) would then hang.
# A handler here is reset to the default at exec, so the children get Python's KeyboardInterrupt again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# QSettings (window geometry, column widths, recent files) live under XDG_CONFIG_HOME: tests, and the windows
# they start in subprocesses, never read or write the user's own, nor what an earlier test run left there.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="shardscope-test-config-")
atexit.register(shutil.rmtree, os.environ["XDG_CONFIG_HOME"], ignore_errors=True)
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

# Markers (declared in pyproject.toml) come from what a test uses: a module whose tests start training runs or real
# writers (torchrun, Lightning, DeepSpeed, Megatron), the soak or the fuzzers says `pytestmark = pytest.mark.slow`
# itself, as the window modules whose tests start no qtbot say `gui` and the SLURM and S3 modules say theirs; a test
# that asks for a Qt widget (`qtbot`, `window`) is `gui` and one that asks for the S3 server (`s3`) is `s3` wherever it
# is. The fast subset: pytest -m "not slow and not slurm and not s3 and not gui"; a test of it that takes longer than
# QUICK_LIMIT_S is named at the end of the run, so a new module cannot slow the subset unseen.
QUICK_MARKERS = ("slow", "slurm", "s3", "gui")
QUICK_LIMIT_S = 15.0
_slow_quick_tests: list[tuple[float, str]] = []


def pytest_collection_modifyitems(config, items):
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        source = getattr(item.function, "__code__", None)
        names = set(source.co_names) if source else set()
        if "qtbot" in uses or "window" in uses:
            item.add_marker(pytest.mark.gui)
        if "s3" in uses or "S3Server" in names:
            item.add_marker(pytest.mark.s3)


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > QUICK_LIMIT_S and not set(report.keywords) & set(QUICK_MARKERS):
        _slow_quick_tests.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _slow_quick_tests:
        terminalreporter.section(f"quick tests over {QUICK_LIMIT_S:.0f} s (mark them slow, or make them quick)")
        for duration, nodeid in sorted(_slow_quick_tests, reverse=True):
            terminalreporter.write_line(f"{duration:7.1f}s {nodeid}")


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    os.environ["SHARDSCOPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    os.environ["SHARDSCOPE_DATA_DIR"] = str(tmp_path_factory.mktemp("data"))
    os.environ["SHARDSCOPE_LOG"] = str(tmp_path_factory.mktemp("log") / "shardscope.log")


@pytest.fixture(autouse=True)
def _address_space_restored():
    """The reader caps this process's address space only while it unpickles; a cap left behind would be
    inherited by every process a later test starts (torch does not import under it)."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    yield
    assert resource.getrlimit(resource.RLIMIT_AS) == before, "an address-space limit was left set"


# The scripts that write the session's fixture checkpoints: their bytes (and torch's version) key the cache below
FIXTURE_SCRIPTS = ("make_fixtures.py", "make_deepspeed_fixtures.py", "make_megatron_fixtures.py", "gloo_retry.py")


def fixture_root(tmp_path_factory, sub: str) -> Path:
    """Where the fixtures of ``sub`` live: under SHARDSCOPE_FIXTURES when set; else in an on-disk cache shared by
    every test run on this machine (``$SHARDSCOPE_FIXTURE_CACHE``, default ``~/.cache/shardscope/test-fixtures``),
    in a folder keyed by Python's and torch's versions and a hash of the scripts that write them, so a change to
    either writes them anew; SHARDSCOPE_FIXTURE_CACHE=off writes them into this session's temporary folder. Each
    script writes a marker per fixture once it is whole, so an interrupted run's leftovers are written again."""
    import hashlib

    root = os.environ.get("SHARDSCOPE_FIXTURES")
    if root:
        return Path(root) / sub if sub else Path(root)
    cache = os.environ.get("SHARDSCOPE_FIXTURE_CACHE", str(Path.home() / ".cache" / "shardscope" / "test-fixtures"))
    if cache == "off":
        return tmp_path_factory.mktemp(sub or "fixtures")
    import torch

    key = hashlib.sha256(f"{sys.version_info[:2]} {torch.__version__}".encode())
    for name in FIXTURE_SCRIPTS:
        key.update((HERE / name).read_bytes())
    return Path(cache) / key.hexdigest()[:16] / sub


def _write_fixtures(script: str, root: Path, timeout: int) -> None:
    """Run ``script`` to write (or complete) the fixtures under ``root``, one writer at a time (a lock beside them:
    two test runs sharing the cache wait for each other), failing the test session with why when it fails."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name or 'fixtures'}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run([sys.executable, str(HERE / script), str(root)], capture_output=True, text=True,
                              timeout=timeout)
    if proc.returncode != 0:  # say why: the fixtures are what most tests stand on
        pytest.fail(f"tests/{script} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-8000:]}",
                    pytrace=False)


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory) -> dict[str, Path]:
    """All fixture checkpoints; written once (:func:`fixture_root` says where), reused while their scripts and torch
    stay the same."""
    root = fixture_root(tmp_path_factory, "")
    _write_fixtures("make_fixtures.py", root, 1800)
    from make_fixtures import FIXTURES

    return {name: root / name for name in FIXTURES}


@pytest.fixture(scope="session")
def deepspeed_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """DeepSpeed ZeRO saves written by DeepSpeed itself (tests/make_deepspeed_fixtures.py: stages 1-3, fp32 and
    bf16, 2 and 3 ranks), each ``<name>/ckpt`` (``latest``, ``global_step2/``) beside ``<name>/reference.pt``
    (DeepSpeed's own consolidation); written once (:func:`fixture_root`)."""
    root = fixture_root(tmp_path_factory, "deepspeed")
    _write_fixtures("make_deepspeed_fixtures.py", root, 1800)
    from make_deepspeed_fixtures import VARIANTS

    return {name: root / name for name in VARIANTS}


@pytest.fixture(scope="session")
def megatron_run(tmp_path_factory) -> Path:
    """A Megatron-Core torch_dist save dir written by Megatron-Core itself (tests/make_megatron_fixtures.py: tensor
    parallel 2 over 2 gloo ranks, ``iter_0000100/`` to ``iter_0000300/`` and ``latest_checkpointed_iteration.txt``);
    written once (:func:`fixture_root`)."""
    root = fixture_root(tmp_path_factory, "megatron")
    _write_fixtures("make_megatron_fixtures.py", root, 900)
    return root / "run"


@pytest.fixture
def copy_of(fixtures, tmp_path):
    """A writable copy of a fixture checkpoint, for tests that damage it."""

    def make(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(fixtures[name], dst)
        return dst

    return make


@pytest.fixture
def window(qtbot):
    """A main window, quiet (no modal message boxes) and not shown; a module may define its own."""
    from shardscope.app.main_window import MainWindow

    win = MainWindow()
    qtbot.addWidget(win)
    win.quiet = True  # no modal message boxes
    return win


# the CLI in a fresh process that prints its own peak RSS last. NOTE: VmHWM, not ru_maxrss: Linux carries
# ru_maxrss over fork and exec, so a child of a pytest process that had grown to 1 GB "peaked" at 1 GB
PEAK_SCRIPT = ("import sys\nfrom shardscope.app.cli.main import main\nrc = main(sys.argv[1:])\n"
               "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM')][0].split()[1]\n"
               "print('PEAK_KB', hwm, file=sys.stderr)\nsys.exit(rc)")


def run_cli_peak(*args: object, timeout: float = 300) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI in a subprocess; the completed process and its own peak RSS in MiB (-1: not reached)."""
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    line = [x for x in proc.stderr.splitlines() if x.startswith("PEAK_KB")]
    return proc, int(line[-1].split()[1]) // 1024 if line else -1


def run_cli(*args: str, check: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ})
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr}")
    return proc


def wait_for(cond, what: str, timeout: float = 240.0, interval: float = 0.2):
    """Poll ``cond`` until it returns something true (returned), failing after ``timeout`` s: the deadline a
    real torchrun or SLURM job meets on a loaded 2-core machine."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def cli_in_process(capsys, *args: object) -> tuple[int, str, str]:
    """One ``shardscope`` command line through the real entry point, in this process (fast): its exit code, stdout
    and stderr. The one in-process CLI of the tests (``run_cli`` is the one in a fresh process)."""
    from shardscope.app.cli.main import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err

"""Every module compiles on each supported Python, and the command line (``python -m dymem_tf``) runs.

The venv's interpreter alone cannot catch syntax that only a newer Python accepts (PEP 701 f-strings reusing the
outer quote are 3.12+): each supported interpreter found on the machine byte-compiles the whole tree.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = ("dymem_tf", "tensorboard_plugin_dymem", "bench", "examples", "tests", "tools")
SUPPORTED_PYTHONS = ("3.10", "3.11", "3.12")  # pyproject.toml: requires-python = ">=3.10,<3.13"

# Run by each interpreter: compile every file named on stdin (nothing is written), print the failures.
COMPILE_ALL = """
import sys
failed = 0
for path in sys.stdin.read().splitlines():
    with open(path, "rb") as fh:
        src = fh.read()
    try:
        compile(src, path, "exec")
    except SyntaxError as err:
        failed += 1
        print(f"{err.filename}:{err.lineno}: {err.msg}: {(err.text or '').strip()}")
sys.exit(1 if failed else 0)
"""


def python_sources() -> list[str]:
    """Every ``.py`` file of the repository's root and source folders (caches and hidden folders left out)."""
    files = glob.glob(os.path.join(REPO, "*.py"))
    for top in SOURCE_DIRS:
        for root, dirs, names in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
            files += [os.path.join(root, n) for n in names if n.endswith(".py")]
    return sorted(files)


def interpreter_version(path: str) -> str | None:
    """``"3.11"`` for a working interpreter at ``path``; None when it does not run (e.g. an inactive pyenv shim)."""
    try:
        proc = subprocess.run([path, "-I", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` (``"3.10"``) from pyenv's versions or ``python3.X`` on PATH, or None."""
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = sorted(glob.glob(os.path.join(pyenv_root, "versions", f"{version}*", "bin", "python")),
                        reverse=True)
    candidates.append(shutil.which(f"python{version}"))
    if interpreter_version(sys.executable) == version:
        candidates.insert(0, sys.executable)
    for path in candidates:
        if path and interpreter_version(path) == version:
            return path
    return None


def test_sources_are_found():
    files = python_sources()
    for expected in ("dymem_tf/cli.py", "bench/run_all.py", "examples/common.py", "tests/test_compat.py",
                     "tools/build_backend/dymem_backend.py", "setup.py"):
        assert os.path.join(REPO, expected) in files


@pytest.mark.parametrize("version", SUPPORTED_PYTHONS)
def test_every_module_compiles(version):
    python = find_python(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (looked in ~/.pyenv/versions/{version}* and for "
                    f"python{version} on PATH)")
    proc = subprocess.run([python, "-I", "-c", COMPILE_ALL], input="\n".join(python_sources()),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"Python {version} ({python}) cannot compile:\n{proc.stdout}{proc.stderr}"


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m dymem_tf ARGS`` from the repository root in a fresh interpreter."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "dymem_tf", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_help():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: dymem" in proc.stdout and "{plan,selfcheck,replay}" in proc.stdout
    assert "examples:" in proc.stdout and ":mod:" not in proc.stdout and "``" not in proc.stdout  # no raw reST
    replay = run_cli("replay", "--help")
    assert replay.returncode == 0 and "usage: dymem replay" in replay.stdout


def test_the_dymem_command_is_installed_and_says_its_version():
    import dymem_tf

    command = shutil.which("dymem", path=os.path.dirname(sys.executable))
    assert command, "the dymem console script is missing next to this Python: reinstall (pip install -e .)"
    proc = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"dymem_tf {dymem_tf.__version__}", proc


def test_cli_dry_run(tmp_path):
    from dymem_tf.planning import planner

    saved = tmp_path / "plan.json"
    proc = run_cli("plan", "--model", "mobilenet", "--batch", "1", "--image-size", "32", "--budget", "none",
                   "--save", str(saved))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "mobilenet: batch 1, 32x32" in out and "ops in the train step" in out
    assert "dymem_tf plan: policy=dymem" in out and f"plan saved to {saved}" in out
    table = out[re.search(r"^policy +swaps", out, re.M).start():].splitlines()[1:]
    rows = {line.split()[0]: line.split() for line in table if line.strip()}
    assert set(rows) == set(planner.POLICIES)
    plan = json.loads(saved.read_text())
    assert plan["policy"] == "dymem" and plan["batch_size"] == 1
    assert int(rows["dymem"][1]) == len(plan["swaps"]) and rows["dymem"][2] == "0"  # no budget: no state offloaded


def test_cli_dry_run_offloads_optimizer_state_where_the_budget_needs_it():
    proc = run_cli("plan", "--model", "mobilenet", "--batch", "1", "--image-size", "32", "--policy", "dymem",
                   "--budget", "30MiB", "--profile", "cpu", "--no-offload-weights")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "offloaded state :" in out and "optimizer variables" in out, out
    row = [line.split() for line in out.splitlines() if line.startswith("dymem ")][0]
    assert int(row[2]) > 0


def test_cli_dry_run_offloads_weights_where_the_budget_needs_it():
    proc = run_cli("plan", "--model", "mobilenet", "--batch", "1", "--image-size", "32", "--policy", "dymem",
                   "--budget", "20MiB", "--profile", "cpu")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "offloaded weights:" in out, out
    row = [line.split() for line in out.splitlines() if line.startswith("dymem ")][0]
    assert int(row[3]) > 0, row


@pytest.mark.parametrize("args, message", [
    (("plan",), "the following arguments are required: --model"),
    (("plan", "--model", "mobilenet", "--profile", "cpu", "--device", "cpu"), "error: --device is the former name"),
    (("plan", "--model", "mobilenet", "--budget", "12 parsecs"), "is not a valid budget"),
    (("plan", "--model", "mobilenet", "--policy", "fastest"), "error: unknown policy 'fastest'"),
])
def test_cli_bad_arguments(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------------ native build
def setup_py_libraries(monkeypatch) -> dict[str, set[str]]:
    """``{"_dymem_gtbm": {"dymem_tf/cc/allocator/gtbm_allocator.cc", ...}, ...}``: the sources setup.py compiles per
    library (setup.py run with ``setuptools.setup`` replaced, so nothing is built)."""
    import runpy

    import setuptools

    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.chdir(REPO)
    runpy.run_path(os.path.join(REPO, "setup.py"), run_name="setup_under_test")
    return {ext.name.rsplit(".", 1)[-1]: {src.replace(os.sep, "/") for src in ext.sources}
            for ext in captured["ext_modules"]}


def bazel_targets() -> dict[str, set[str]]:
    """``{target name: its srcs}`` of every rule in BUILD; ``srcs`` is a sum of string lists and list constants
    (``NAME = [...]`` at the top level)."""
    import re

    with open(os.path.join(REPO, "BUILD"), encoding="utf-8") as fh:
        text = fh.read()
    lists = {name: set(re.findall(r'"([^"]+)"', body))
             for name, body in re.findall(r"^([A-Z_]+)\s*=\s*\[(.*?)\]", text, flags=re.S | re.M)}
    term = r"(?:\[[^\]]*\]|[A-Z_]+)"
    rules = re.findall(rf'name\s*=\s*"([^"]+)",\s*srcs\s*=\s*({term}(?:\s*\+\s*{term})*)', text, flags=re.S)
    return {name: set().union(*(set(re.findall(r'"([^"]+)"', part)) if part.startswith("[") else lists[part]
                                for part in re.split(r"\s*\+\s*", srcs)))
            for name, srcs in rules}


def test_bazel_build_compiles_what_setup_py_compiles(monkeypatch):
    """BUILD says it compiles the same sources per library as setup.py: each library's .cc files are the same,
    every .cc under dymem_tf/cc outside a tests/ folder is in a library, and every file BUILD names exists."""
    libraries = setup_py_libraries(monkeypatch)
    targets = bazel_targets()
    named = set().union(*targets.values())
    missing = sorted(src for src in named if not os.path.exists(os.path.join(REPO, src)))
    assert not missing, f"BUILD names files that do not exist: {missing}"
    assert set(libraries) == {"_dymem_gtbm", "_dymem_ops", "_dymem_replay"}
    for library, sources in libraries.items():
        assert f"{library}.so" in targets, f"BUILD has no target {library}.so"
        in_build = {src for src in targets[f"{library}.so"] if src.endswith(".cc")}
        assert in_build == sources, f"{library}: BUILD compiles {sorted(in_build)}, setup.py {sorted(sources)}"
    cc_files = {os.path.relpath(path, REPO).replace(os.sep, "/")
                for path in glob.glob(os.path.join(REPO, "dymem_tf", "cc", "**", "*.cc"), recursive=True)}
    cc_files = {path for path in cc_files if "/tests/" not in path}
    assert cc_files and cc_files == set().union(*libraries.values())


def test_the_readme_dry_run_plans_swaps():
    """The README's dry-run command, run as written there, plans something: Dymem swaps to fit the budget without a
    modelled stall, where vDNN's and TFLMS' schedules stall (what the README says of it)."""
    import re

    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    (command,) = re.findall(r"`(dymem plan --[^`]*)`", readme)
    args = command.split()
    assert args == ["dymem", "plan", "--model", "resnet50", "--batch", "64", "--image-size", "224", "--budget", "5GiB",
                    "--profile", "h200"]
    proc = run_cli(*args[1:], timeout=600)  # python -m dymem_tf is the dymem command
    assert proc.returncode == 0, proc.stderr
    header = re.search(r"^policy\s+swaps", proc.stdout, re.MULTILINE)  # tabulate's column spacing varies
    assert header, proc.stdout
    table = proc.stdout[header.start():].splitlines()[1:]
    rows = {line.split()[0]: line.split() for line in table if line.strip()}
    assert not [line for line in table if "error" in line], table
    assert int(rows["none"][1]) == 0 and int(rows["dymem"][1]) > 0
    assert "[fits]" in proc.stdout and "the step fits the budget without swapping" not in proc.stdout
    stall = {policy: float(row[-1]) for policy, row in rows.items()}  # stall ms, the last column
    assert stall["dymem"] == 0.0 and stall["vdnn"] > 0 and stall["tflms"] > 0


def test_a_failed_calls_per_step_variable_is_released():
    """Every tf.function call of the eager context shares one step container: a call that fails between a
    TemporaryVariable (Grappler's in-place gradient sum) and its destruction leaves the variable there, and the
    next call of the same graph failed with AlreadyExistsError (InceptionV3's plan after its plain step ran out
    of memory under memory_budget="auto"). After release_step_resources the graph runs again."""
    import tensorflow as tf

    from dymem_tf import compat

    @tf.function
    def accumulate(fail):
        v = tf.raw_ops.TemporaryVariable(shape=[4], dtype=tf.float32, var_name="dymem_test_sum")
        v = tf.raw_ops.Assign(ref=v, value=tf.ones([4]))
        # the failure, after the variable was made and before it is destroyed
        check = tf.debugging.assert_equal(tf.logical_and(fail, tf.reduce_sum(v) > 0), False)
        with tf.control_dependencies([check]):
            return tf.raw_ops.DestroyTemporaryVariable(ref=v, var_name="dymem_test_sum")

    with pytest.raises(tf.errors.InvalidArgumentError):
        accumulate(tf.constant(True))
    with pytest.raises(tf.errors.AlreadyExistsError):
        accumulate(tf.constant(False))
    compat.release_step_resources()
    assert accumulate(tf.constant(False)).numpy().tolist() == [1.0] * 4
    assert accumulate(tf.constant(False)).numpy().tolist() == [1.0] * 4  # destroyed by a call that ran through


# A tf.function on another thread holds a step resource (a TemporaryVariable) and waits inside the call, in a
# py_function, while this thread releases the step resources; then it destroys the variable. In a fresh interpreter:
# emptying the step container under a running call frees the container that call is using.
OTHER_THREAD = r"""
import json, threading
import tensorflow as tf
from dymem_tf import compat

entered, go = threading.Event(), threading.Event()

def wait(x):
    entered.set()
    go.wait(120)
    return x

@tf.function
def hold():
    v = tf.raw_ops.TemporaryVariable(shape=[4], dtype=tf.float32, var_name="dymem_other_thread")
    v = tf.raw_ops.Assign(ref=v, value=tf.ones([4]))
    with tf.control_dependencies([v.op]):
        waited = tf.py_function(wait, [tf.constant(1.0)], tf.float32)
    with tf.control_dependencies([waited]):
        return tf.raw_ops.DestroyTemporaryVariable(ref=v, var_name="dymem_other_thread")

out = {}
def other():
    try:
        out["value"] = hold().numpy().tolist()
    except Exception as err:  # the variable gone from under the call
        out["error"] = f"{type(err).__name__}: {err}"

thread = threading.Thread(target=other)
thread.start()
assert entered.wait(120)
out["released_while_running"] = compat.release_step_resources()
go.set()
thread.join(120)
out["released_after"] = compat.release_step_resources()  # nothing runs elsewhere now
print("RESULT" + json.dumps(out), flush=True)
"""


def test_releasing_step_resources_leaves_a_call_on_another_thread_alone():
    """TF's EndStep empties the step container when no *step* is open, and nothing opens one: a tf.function running
    on another thread (which holds the container) is no step, so the release waits for a moment when no other
    thread is inside TensorFlow's execution, and says so."""
    from conftest import proc_result, run_python

    proc = run_python(OTHER_THREAD, timeout=300)
    out = proc_result(proc, "the two-thread script")  # before: the release crashed the process (SIGSEGV)
    assert out.get("value") == [1.0] * 4, out  # the other call's variable was still there to destroy
    assert out["released_while_running"] is False and out["released_after"] is True
    assert "resources were not released: thread(s) Thread-1 (other) are running TensorFlow" in proc.stderr


def test_a_failure_to_release_step_resources_leaves_the_callers_error(monkeypatch, caplog):
    """release_step_resources runs inside ``except ResourceExhaustedError``: a failure to find TF's C API there is a
    logged warning, and the out-of-memory error is what the caller sees."""
    import ctypes

    import tensorflow as tf

    from dymem_tf import compat

    def no_library(*args, **kwargs):
        raise OSError("libtensorflow_cc.so.2: cannot open shared object file")

    compat._tf_c_api.cache_clear()  # looked up again, through the failing loader
    compat._step_functions.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    try:
        with pytest.raises(tf.errors.ResourceExhaustedError, match="OOM when allocating"):
            try:
                raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")
            except tf.errors.ResourceExhaustedError:
                assert compat.release_step_resources() is False
                raise
    finally:
        monkeypatch.undo()
        compat._tf_c_api.cache_clear()
        compat._step_functions.cache_clear()
    assert any("failed step's resources" in r.getMessage() and "cannot open shared object" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING"), caplog.text


def test_reading_the_eager_context_leaves_ctypes_pythonapi_as_it_was(monkeypatch):
    """The capsule's pointer is read through a private prototype: ``ctypes.pythonapi.PyCapsule_GetPointer``, shared
    by the whole process, keeps the restype and argtypes its other users gave it."""
    import ctypes

    from dymem_tf import compat

    shared = ctypes.pythonapi.PyCapsule_GetPointer
    monkeypatch.setattr(shared, "restype", ctypes.c_int)  # ctypes' defaults, whatever an earlier test left
    monkeypatch.setattr(shared, "argtypes", None)
    assert compat._eager_context_pointer() > 0
    assert compat.release_step_resources() is True
    assert ctypes.pythonapi.PyCapsule_GetPointer is shared
    assert (shared.restype, shared.argtypes) == (ctypes.c_int, None)

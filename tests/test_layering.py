"""The import rule of CONTRIBUTING.md ("Sub-packages and the import rule"), enforced: which sub-package may import what.

``planning`` is the TensorFlow-free core (it must import and plan without TensorFlow installed); ``memory`` loads
TensorFlow only inside the functions that need it, so the replay tool runs in any process; the TensorBoard plugin
package never imports dymem_tf (TensorBoard's process must not register the allocator); Keras is imported only by
the ``keras`` sub-package, at the top of the stack.
"""
import ast
import glob
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# package folder -> (modules forbidden anywhere in it, modules forbidden at module level only)
RULES = {
    "dymem_tf/planning": ({"tensorflow", "keras", "tensorboard", "tensorboard_plugin_dymem", "dymem_tf.keras",
                           "dymem_tf.passes", "dymem_tf.memory", "dymem_tf.observe", "dymem_tf.ops"}, set()),
    "dymem_tf/memory": ({"keras", "dymem_tf.keras", "dymem_tf.passes", "dymem_tf.observe", "dymem_tf.planning"},
                        {"tensorflow"}),
    "dymem_tf/ops": ({"keras", "dymem_tf.keras", "dymem_tf.passes", "dymem_tf.observe", "dymem_tf.planning"},
                     set()),
    "dymem_tf/passes": ({"keras", "dymem_tf.keras", "dymem_tf.observe"}, set()),
    "dymem_tf/observe": ({"keras", "dymem_tf.keras", "dymem_tf.passes"}, set()),
    "tensorboard_plugin_dymem": ({"dymem_tf", "tensorflow", "keras"}, set()),
}


def imported_modules(path: str) -> list[tuple[str, bool]]:
    """(dotted module, imported at module level) for every import statement of the file at ``path``."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(f"{node.module}.{alias.name}", id(node) in top) for alias in node.names]
    return found


def violates(module: str, forbidden: set[str]) -> bool:
    return any(module == f or module.startswith(f + ".") for f in forbidden)


def rule_breaches(package: str) -> list[str]:
    anywhere, top_level = RULES[package]
    breaches = []
    for path in sorted(glob.glob(os.path.join(REPO, package, "*.py"))):
        for module, at_top in imported_modules(path):
            if violates(module, anywhere) or (at_top and violates(module, top_level)):
                breaches.append(f"{os.path.relpath(path, REPO)} imports {module}")
    return breaches


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_keeps_the_import_rule(package):
    assert rule_breaches(package) == []


def test_rule_check_catches_a_breach(tmp_path, monkeypatch):
    fake = tmp_path / "dymem_tf" / "planning"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from tensorflow.python.framework import ops\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    assert rule_breaches("dymem_tf/planning") == ["dymem_tf/planning/bad.py imports tensorflow.python.framework.ops"]


def test_only_the_public_api_and_the_cli_import_the_keras_subpackage():
    users = []
    for path in glob.glob(os.path.join(REPO, "dymem_tf", "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, REPO)
        if rel.startswith(os.path.join("dymem_tf", "keras")) or rel in ("dymem_tf/__init__.py", "dymem_tf/cli.py"):
            continue
        users += [f"{rel}: {m}" for m, _ in imported_modules(path) if violates(m, {"dymem_tf.keras"})]
    assert users == []


def run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)


# TensorFlow and Keras made unimportable, as on a machine without them.
WITHOUT_TF = """
import sys
sys.modules["tensorflow"] = None
sys.modules["keras"] = None
import dymem_tf
from dymem_tf.memory import replay
from dymem_tf.planning import analysis, cost_model, device_profiles, first_step, plan, planner, simulator, update_deferral
from dymem_tf.planning.analysis import StepGraph
spec, prev = {}, None
for i in range(1, 7):  # a chain of six 8 MB feature maps, each read again by its gradient op
    spec[f"f{i}"] = {"inputs": [prev] if prev else [], "bytes": 8_000_000, "flops": 1e13, "type": "Conv2D"}
    prev = f"f{i}"
spec["dloss"] = {"inputs": [prev], "bytes": 1000, "flops": 1e13, "backward": True}
grad = "dloss"
for i in range(6, 0, -1):
    spec[f"b{i}"] = {"inputs": [grad, f"f{i}"], "bytes": 1000, "flops": 1e13, "backward": True}
    grad = f"b{i}"
p = planner.make_plan(StepGraph.from_spec(spec), "dymem", profile="h200", min_swap_bytes=1)
print("swaps", len(p.swaps), sys.modules["tensorflow"] is not None)
"""


def test_planning_core_and_replay_run_without_tensorflow():
    proc = run(WITHOUT_TF)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[0] == "swaps" and int(words[1]) > 0 and words[2] == "False"


def test_planning_and_replay_do_not_load_tensorflow_even_when_it_is_installed():
    proc = run("import sys, dymem_tf.planning.planner, dymem_tf.planning.simulator, dymem_tf.memory.replay\n"
               "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


PLANNING = sorted(f"dymem_tf.planning.{os.path.basename(p)[:-3]}"
                  for p in glob.glob(os.path.join(REPO, "dymem_tf", "planning", "*.py"))
                  if not p.endswith("__init__.py"))


def planning_imports(module: str) -> set[str]:
    """The planning modules that ``module``'s import statements name, at module level or inside a function (a late
    import that hides a cycle is still one): ``from dymem_tf.planning.plan import Plan``, ``from
    dymem_tf.planning import plan`` and the relative forms."""
    path = os.path.join(REPO, *module.split(".")) + ".py"
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    named = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "dymem_tf.planning" + (f".{node.module}" if node.module else "") if node.level == 1 else node.module
            named += [f"{base}.{alias.name}" for alias in node.names] + [base]
    return {m for m in PLANNING for name in named if name == m or name.startswith(m + ".")} - {module}


def test_planning_modules_import_one_another_without_a_cycle():
    """No planning module imports, directly or through others, one that imports it back: a cycle makes which
    half-initialised module a name is missing from depend on which module a process imports first."""
    import networkx as nx

    graph = nx.DiGraph((module, dep) for module in PLANNING for dep in planning_imports(module))
    assert list(nx.simple_cycles(graph)) == []


def test_the_cycle_check_sees_late_and_relative_imports(tmp_path, monkeypatch):
    fake = tmp_path / "dymem_tf" / "planning"
    fake.mkdir(parents=True)
    (fake / "a.py").write_text("from .b import x\n")
    (fake / "b.py").write_text("def f():\n    from dymem_tf.planning import a\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "PLANNING", ["dymem_tf.planning.a", "dymem_tf.planning.b"])
    assert planning_imports("dymem_tf.planning.a") == {"dymem_tf.planning.b"}
    assert planning_imports("dymem_tf.planning.b") == {"dymem_tf.planning.a"}


@pytest.mark.parametrize("first", PLANNING)
def test_every_planning_module_imports_first_in_a_fresh_interpreter_without_tensorflow(first):
    """Each planning module imported first (then all the others) in a fresh interpreter: none fails on a name a
    half-initialised module lacks, and none loads TensorFlow or Keras."""
    rest = [m for m in PLANNING if m != first]
    proc = run(f"import importlib, sys\nfor name in {[first] + rest!r}:\n    importlib.import_module(name)\n"
               "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_tensorboard_plugin_does_not_import_dymem_tf():
    proc = run("import sys, tensorboard_plugin_dymem.plugin\n"
               "print(sorted(m for m in sys.modules if m == 'dymem_tf' or m.startswith('dymem_tf.')))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("order", ["dymem_tf first", "tensorflow first", "keras first"])
def test_gtbm_is_registered_whichever_is_imported_first(order):
    imports = {"dymem_tf first": "import dymem_tf; import tensorflow as tf",
               "tensorflow first": "import tensorflow as tf; import dymem_tf",
               "keras first": "import keras; import dymem_tf; import tensorflow as tf"}[order]
    proc = run(imports + "\nfrom dymem_tf.memory import allocator\n"
               "x = tf.zeros([1024, 1024])\n"
               "print(allocator.is_active(), allocator.memory_stats()['bytes_in_use'] >= 4 << 20,"
               " tf.__loader__ is tf.__spec__.loader and type(tf.__loader__).__module__ != 'dymem_tf')")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "True"]


def test_internals_of_tensorflow_and_keras_are_reached_only_through_compat():
    """``tensorflow.python``, ``keras.src`` and stack-frame introspection live in ``dymem_tf/compat.py`` alone."""
    users = []
    for path in glob.glob(os.path.join(REPO, "dymem_tf", "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, REPO)
        if rel == os.path.join("dymem_tf", "compat.py"):
            continue
        users += [f"{rel}: {m}" for m, _ in imported_modules(path)
                  if violates(m, {"tensorflow.python", "keras.src"})]
        if "sys._getframe" in open(path, encoding="utf-8").read():
            users.append(f"{rel}: sys._getframe")
    assert users == []


@pytest.mark.parametrize("tf_version, keras_version, problem", [
    ("2.21.0", "3.15.1", None),
    ("2.21.3rc1", "3.10.0", None),
    ("2.20.0", "3.15.1", "TensorFlow 2.20.0 is not supported: dymem_tf works with TensorFlow 2.21.x"),
    ("2.22.0", "3.15.1", "TensorFlow 2.22.0 is not supported"),
    ("2.21.0", "3.9.2", "Keras 3.9.2 is not supported: dymem_tf works with Keras >= 3.10, < 4.0"),
    ("2.21.0", "4.0.0", "Keras 4.0.0 is not supported"),
])
def test_version_gate_names_the_supported_versions(tf_version, keras_version, problem):
    from dymem_tf import compat

    found = compat.version_problem(tf_version, keras_version)
    assert (found is None) if problem is None else found.startswith(problem)

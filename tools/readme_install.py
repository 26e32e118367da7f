"""Follow the README's "Install" section in a fresh virtual environment, as a new user would.

    python tools/readme_install.py [--keep DIR]

Reads the shell commands of the README's Install block (the first fenced block under "## Install") and the wheel
commands of the paragraph after it, and runs them with a new venv's ``bin`` first on ``PATH``, in an empty folder:
``git clone <this repository>`` clones this checkout's committed HEAD. Then, from that folder (not the clone), it
trains a tiny model with ``DymemCallback()`` from the installed package and runs ``dymem --version``. After the
source install, it installs the wheel the README's ``pip wheel`` command builds in its place, and imports it again.
Prints each command and its time; exits non-zero at the first failure. TensorFlow comes from pip's cache when
``make install`` ran before (CI), so the run takes the native build's minutes, not a download's.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QUICK_START = """
import numpy as np
import tensorflow as tf
import dymem_tf
import keras

assert os.path.dirname(dymem_tf.__file__).startswith(sys.prefix), dymem_tf.__file__  # the installed package
model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
                          keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
cb = dymem_tf.DymemCallback()
model.fit(np.zeros((16, 8, 8, 3), "float32"), np.zeros(16, "int64"), batch_size=8, verbose=0, callbacks=[cb])
plan = dymem_tf.DymemCallback(None)
model.fit(np.zeros((16, 8, 8, 3), "float32"), np.zeros(16, "int64"), batch_size=8, verbose=0, callbacks=[plan])
assert cb.records == [] and plan.plan is not None, (cb.records, plan.plan)
print("quick start: trained with DymemCallback() and DymemCallback(None)")
"""


def readme_commands(readme: str) -> tuple[list[str], list[str]]:
    """The Install block's shell commands, and the ``pip wheel`` / ``pip install dist/...`` commands after it."""
    section = readme[readme.index("## Install"):]
    section = section[:section.index("\n## ", 1)]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    install = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    wheel = re.findall(r"`(pip (?:wheel|install dist/)[^`]*)`", section)
    if len(install) < 3 or len(wheel) != 2:
        raise SystemExit(f"README's Install section changed shape: {install} / {wheel}")
    return install, wheel


def run(command: str, cwd: str, env: dict) -> None:
    started = time.perf_counter()
    lines = command.splitlines()
    print(f"$ {lines[0]}" + (" ..." if len(lines) > 1 else ""), flush=True)
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)
    said = proc.stdout.strip().splitlines()
    print(f"  ({time.perf_counter() - started:.0f} s, exit {proc.returncode})" + (f": {said[-1]}" if said else ""),
          flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"failed: {command}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", default="", help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args(argv)
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        install, wheel = readme_commands(fh.read())
    work = args.keep or tempfile.mkdtemp(prefix="dymem_install_")
    os.makedirs(work, exist_ok=True)
    try:
        venv = os.path.join(work, "venv")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        env.update(PATH=os.path.join(venv, "bin") + os.pathsep + env.get("PATH", ""), TF_CPP_MIN_LOG_LEVEL="3",
                   PIP_DISABLE_PIP_VERSION_CHECK="1")
        for command in install:
            run(command.replace("<this repository>", REPO), work, env)
        run(f"python -c {_quote('import os, sys' + QUICK_START)}", work, env)
        run("dymem --version", work, env)
        run("pip uninstall -y dymem_tf", work, env)  # the wheel goes into an environment without dymem_tf
        for command in wheel:
            run(command, work, env)
        run("python -c 'import tensorflow as tf, dymem_tf; print(dymem_tf.__file__, dymem_tf.__version__)'", work,
            env)
        print("README install: ok")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _quote(code: str) -> str:
    return "'" + code.replace("'", "'\"'\"'") + "'"


if __name__ == "__main__":
    sys.exit(main())

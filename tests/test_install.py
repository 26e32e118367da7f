"""The README's Install section, followed in a fresh virtual environment (tools/readme_install.py): TensorFlow,
``pip install --no-build-isolation`` of a clone, the quick start from the installed package, ``dymem --version``,
then the wheel of ``pip wheel`` installed in its place and imported. Minutes: the native build runs once."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_readme_install_works_in_a_fresh_virtual_environment():
    if subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: the README's 'git clone' has nothing to clone")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "readme_install.py")], capture_output=True,
                          text=True, timeout=2400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "quick start: trained with DymemCallback() and DymemCallback(None)" in proc.stdout
    assert "README install: ok" in proc.stdout

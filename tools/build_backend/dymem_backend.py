"""In-tree PEP 517 build backend for dymem_tf.

It delegates every hook to setuptools; ``setup.py`` compiles ``dymem_tf/cc`` against the TensorFlow that is
installed in the build environment (``tf.sysconfig`` flags). The native libraries are tied to that exact TF
version, which the build records in ``dymem_tf/_build_info.json`` for the loader to check at import time.
"""
from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (re-export the PEP 517/660 hooks)

TF_REQUIREMENT = "tensorflow>=2.21,<2.22"


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + [TF_REQUIREMENT]


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + [TF_REQUIREMENT]

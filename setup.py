"""Compiles the native libraries of dymem_tf against the installed TensorFlow.

Three shared libraries are built from ``dymem_tf/cc``, one folder per concern:

* ``_dymem_gtbm``: the GTBM allocator (``allocator/`` and the core in ``gtbm/``). It registers itself with TF's
  allocator factory, so it must be loaded before TF's first CPU allocation; it is kept apart from the ops for that
  reason.
* ``_dymem_ops``: the swap kernels and the host pool (``ops/``) and the graph pass after Grappler (``pass/``).
* ``_dymem_replay``: the GTBM core and its trace replay engine only (``gtbm/``: plain C++17, not linked to TF, no
  allocator registration), loaded with ctypes by ``python -m dymem_tf.memory.replay`` at any time.

Flags come from ``tf.sysconfig``; TF's headers are included with ``-isystem`` so that ``-Wall -Wextra -Werror``
applies to our own sources only.
"""
import glob
import json
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CC_DIR = os.path.join("dymem_tf", "cc")


def _sources(*folders):
    """The ``.cc`` files directly in the given folders of ``dymem_tf/cc`` (not their ``tests/``), sorted."""
    return sorted(f for folder in folders for f in glob.glob(os.path.join(CC_DIR, folder, "*.cc")))


CORE_SOURCES = _sources("gtbm")  # TF-free: the allocator core and the replay engine
GTBM_SOURCES = _sources("allocator") + CORE_SOURCES
OPS_SOURCES = _sources("ops", "pass")
REPLAY_SOURCES = CORE_SOURCES
REPLAY_EXT = "dymem_tf._dymem_replay"


class TensorFlowBuildExt(build_ext):
    """build_ext that adds TensorFlow's compile and link flags and records the TF version."""

    def build_extensions(self):
        import tensorflow as tf  # imported lazily: only the build needs it

        compile_flags, include_dirs = [], []
        for flag in tf.sysconfig.get_compile_flags():
            if flag.startswith("-I"):
                include_dirs.append(flag[2:])
            else:
                compile_flags.append(flag)
        system_includes = [arg for inc in include_dirs for arg in ("-isystem", inc)]
        link_flags = tf.sysconfig.get_link_flags()
        tf_lib_dir = [f[2:] for f in link_flags if f.startswith("-L")]
        if tf.test.is_built_with_gpu_support():
            # pip TF defines neither GOOGLE_CUDA nor TENSORFLOW_USE_ROCM for custom ops: opt in to the GPU kernels
            # (they only use the DeviceContext's copy functions, so no nvcc is needed).
            compile_flags.append("-DDYMEM_GPU_KERNELS=1")
        warnings = ["-Wall", "-Wextra", "-Werror"]
        if os.environ.get("DYMEM_NO_WERROR"):
            warnings.remove("-Werror")
        # setuptools adds the interpreter's CFLAGS; drop the C-only ones g++ warns about.
        for attr in ("compiler_so", "compiler_so_cxx"):
            cmd = getattr(self.compiler, attr, None)
            if cmd:
                setattr(self.compiler, attr, [a for a in cmd if a not in ("-Wstrict-prototypes",)])
        for ext in self.extensions:
            ext.extra_compile_args = (
                compile_flags + system_includes + warnings
                # -DNDEBUG as in TF's own build: without it graph/edgeset.h's EdgeSet has another layout, and code
                # that walks a Graph's edges (the graph pass) reads garbage.
                + ["-O2", "-DNDEBUG", "-fPIC", "-fvisibility=default", f'-DDYMEM_TF_VERSION="{tf.__version__}"']
            )
            ext.extra_link_args = link_flags + [f"-Wl,-rpath,{d}" for d in tf_lib_dir] + ["-lpthread"]
            if ext.name == REPLAY_EXT:  # TF-free: must not pull libtensorflow_framework into a bare process
                ext.extra_link_args = ["-lpthread"]
        self._tf_version = tf.__version__
        self._flags = tf.sysconfig.get_compile_flags()
        super().build_extensions()
        self._write_build_info()

    def _write_build_info(self):
        info = {
            "tensorflow_version": self._tf_version,
            "python": sys.version.split()[0],
            "compile_flags": [f for f in self._flags if not f.startswith("-I")],
        }
        targets = {os.path.join(self.build_lib, "dymem_tf")}
        if self.inplace or self.editable_mode:
            targets.add(os.path.join(HERE, "dymem_tf"))
        for target in targets:
            os.makedirs(target, exist_ok=True)
            with open(os.path.join(target, "_build_info.json"), "w") as fh:
                json.dump(info, fh, indent=2)

    def get_outputs(self):
        return super().get_outputs() + [os.path.join(self.build_lib, "dymem_tf", "_build_info.json")]


ext_modules = []
if GTBM_SOURCES:
    ext_modules.append(Extension("dymem_tf._dymem_gtbm", sources=GTBM_SOURCES, language="c++"))
if REPLAY_SOURCES:
    ext_modules.append(Extension(REPLAY_EXT, sources=REPLAY_SOURCES, language="c++"))
if OPS_SOURCES:
    ext_modules.append(Extension("dymem_tf._dymem_ops", sources=OPS_SOURCES, language="c++"))

setup(ext_modules=ext_modules, cmdclass={"build_ext": TensorFlowBuildExt})

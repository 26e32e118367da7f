# dymem_tf — the two commands a new machine needs:
#   make demo   trains a Keras model with and without Dymem and prints the memory table (the main job)
#   make test   builds the native libraries and runs the whole test suite
# Both create .venv, install TensorFlow and build dymem_tf/cc against it first.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.dymem-installed
CXX    ?= g++
NATIVE_SRC := $(shell find dymem_tf/cc -name '*.cc' -o -name '*.h')
# The allocator core (no TensorFlow) that the standalone test links: dymem_tf/cc/gtbm/ without the replay engine.
CORE_SRC   := $(filter-out %/replay.cc,$(sort $(wildcard dymem_tf/cc/gtbm/*.cc)))
CORE_TEST  := dymem_tf/cc/gtbm/tests/gtbm_core_test.cc
# RegionAllocator, the region + placement code shared by GTBM on the CPU device and on GPUs, with the host stand-in
# for TF's GPU sub-allocator (dymem_tf/cc/allocator/region_selftest.cc); linked against the venv's TensorFlow.
REGION_SRC  := $(addprefix dymem_tf/cc/allocator/,region_allocator.cc mobility.cc config.cc region_selftest.cc) \
               $(CORE_SRC)
REGION_TEST := dymem_tf/cc/allocator/tests/region_allocator_test.cc
# TF's flags (headers as -isystem so that -Werror covers our code only); evaluated only by the targets using them.
TF_CFLAGS = $(shell $(PY) -c "import tensorflow as tf; print(' '.join('-isystem ' + f[2:] if f.startswith('-I') else f for f in tf.sysconfig.get_compile_flags()))" 2>/dev/null)
TF_LFLAGS = $(shell $(PY) -c "import tensorflow as tf; fl = tf.sysconfig.get_link_flags(); print(' '.join(fl + ['-Wl,-rpath,' + f[2:] for f in fl if f.startswith('-L')]))" 2>/dev/null)

.PHONY: all install install-check demo test test-fast native-test asan ubsan region-test region-asan bench bench-quick browser-deps keras-conformance clean

all: install

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# TensorFlow first (the build compiles against it), then dymem_tf itself, editable, without build isolation so the
# libraries are built against exactly the TF in the venv.
$(STAMP): $(PY) pyproject.toml setup.py $(NATIVE_SRC)
	$(PIP) install -q "tensorflow>=2.21,<2.22" "setuptools>=68" wheel
	$(PIP) install -q --no-build-isolation -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/train_resnet50.py --compare --deterministic

test: install browser-deps
	$(PY) -m pytest -q -ra

# The README's Install section followed in a fresh virtual environment (tests/test_install.py runs it too).
install-check:
	$(PYTHON) tools/readme_install.py

# Without the browser and the slow model tests: the edit-compile-test loop.
test-fast: install
	$(PY) -m pytest -q -ra -m "not slow and not browser"

# Headless Chromium for the TensorBoard plugin's browser test (Debian packages; best effort, the test skips
# with the reason when it cannot be installed).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
	    >/dev/null 2>&1 || echo "note: chromium could not be installed; browser tests will skip"; }

build:
	mkdir -p build

native-test: build
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -pthread $(CORE_SRC) $(CORE_TEST) -o build/gtbm_core_test
	./build/gtbm_core_test

asan: build
	$(CXX) -std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all -pthread \
	  $(CORE_SRC) $(CORE_TEST) -o build/gtbm_core_test_asan
	ASAN_OPTIONS=detect_leaks=1 ./build/gtbm_core_test_asan

# The RegionAllocator test (randomised, multi-threaded) on the CPU; needs the venv (make install) for TF's headers.
region-test: build
	$(CXX) -std=c++17 -O2 -DNDEBUG -Wall -Wextra -Werror -pthread $(TF_CFLAGS) $(REGION_SRC) $(REGION_TEST) \
	  $(TF_LFLAGS) -o build/region_allocator_test
	./build/region_allocator_test

# The same under AddressSanitizer (TensorFlow itself is not instrumented; our code and TF's inline headers are).
# No UBSan here: GCC's -fsanitize=undefined rejects a constexpr in the absl headers TF ships.
region-asan: build
	$(CXX) -std=c++17 -O1 -g -DNDEBUG -fno-omit-frame-pointer -fsanitize=address \
	  -Wall -Wextra -Werror -pthread $(TF_CFLAGS) $(REGION_SRC) $(REGION_TEST) $(TF_LFLAGS) \
	  -o build/region_allocator_test_asan
	ASAN_OPTIONS=detect_leaks=1 ./build/region_allocator_test_asan

ubsan: build
	$(CXX) -std=c++17 -O1 -g -fsanitize=undefined -fno-sanitize-recover=all -pthread \
	  $(CORE_SRC) $(CORE_TEST) -o build/gtbm_core_test_ubsan
	./build/gtbm_core_test_ubsan

# Keras's own tests (trainers, every offline callback, models) run twice, without and with DymemCallback appended to
# every fit; fails on a test that passes only without it, and prints how many fits swapped (docs/reliability.md).
# keras.src.trainers.trainer_test imports jax, which only this target installs.
keras-conformance: install
	$(PIP) install -q "jax>=0.4.30,<0.11"
	$(PY) -m tools.keras_conformance

bench: install
	$(PY) bench/run_all.py

bench-quick: install
	$(PY) bench/run_all.py --quick

clean:
	rm -rf build dist *.egg-info dymem_tf/*.so dymem_tf/_build_info.json

"""Byte sizes are read by one parser (dymem_tf.units): the library's budgets and environment variables, the host
pool's cache limit and the bench's configuration all agree on what "MB" and "MiB" mean."""
import os
import random

import pytest

from dymem_tf import units
from dymem_tf.memory import allocator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), (" 7 ", 7), ("0", 0), (12, 12),
    ("1KiB", KiB), ("1kib", KiB), ("512MiB", 512 * MiB), ("512 mib", 512 * MiB), ("1GiB", GiB), ("2TiB", 2 * TiB),
    ("1kB", 1000), ("1KB", 1000), ("512MB", 512 * 10**6), ("512mb", 512 * 10**6), ("2GB", 2 * 10**9),
    ("3TB", 3 * 10**12), ("1.5GiB", 3 * GiB // 2), ("0.5KB", 500), ("64M", 64 * MiB), ("1b", 1),
])
def test_parse_bytes_iec_si_and_bare(text, expected):
    assert units.parse_bytes(text) == expected


@pytest.mark.parametrize("text, reason", [
    ("12 parsecs", "unknown unit 'parsecs'"), ("1GiBs", "unknown unit 'GiBs'"), ("", "expected a non-negative"),
    ("-1MiB", "expected a non-negative"), ("1.2.3", "expected a non-negative"), ("MiB", "expected a non-negative"),
    ("9223372036854775808", "too large"), ("8388608TiB", "too large"), (-3, "negative"),
])
def test_parse_bytes_names_the_bad_text(text, reason):
    with pytest.raises(ValueError) as err:
        units.parse_bytes(text)
    assert f"invalid byte count {text!r}" in str(err.value) and reason in str(err.value)


def test_rounded_up_figures_are_never_below_the_bytes():
    """An "at least" figure rounded to the nearest can name less than is needed, even the refused budget itself:
    ``up=True`` rounds up, in every unit; where the two still read alike, the hint gives the bytes."""
    format_bytes, mib, parse_bytes = units.format_bytes, units.mib, units.parse_bytes
    assert mib(3 * MiB) == mib(3 * MiB, up=True) == "3.0 MiB"
    assert mib(3 * MiB + 1, up=True) == "3.1 MiB" and mib(3 * MiB + 1) == "3.0 MiB"
    assert format_bytes(1536, up=True) == "1.5 KiB" and format_bytes(1537, up=True) == "1.6 KiB"
    assert format_bytes(1000, up=True) == "1000 B" and format_bytes(3 * TiB + 50, up=True) == "3.1 TiB"
    rng = random.Random(0)
    for n in [rng.randrange(1, 1 << 50) >> rng.randrange(50) for _ in range(3000)]:
        assert parse_bytes(format_bytes(n, up=True).replace(" ", "")) >= n, n
        assert float(mib(n, up=True).split()[0]) * MiB >= n, n
    assert units.at_least(3 * MiB + 1, 3 * MiB) == "3.1 MiB"
    needed, refused = int(3.38 * MiB), int(3.36 * MiB)  # both read "3.4 MiB"
    assert units.at_least(needed, refused) == f"3.4 MiB ({needed} bytes)"
    assert units.at_least(needed, refused, units.mib) == f"3.4 MiB ({needed} bytes)"


def test_allocator_parse_bytes_is_the_units_parser():
    assert allocator.parse_bytes is units.parse_bytes


def test_env_bytes(monkeypatch):
    monkeypatch.delenv("DYMEM_TEST_BYTES", raising=False)
    assert units.env_bytes("DYMEM_TEST_BYTES") is None
    monkeypatch.setenv("DYMEM_TEST_BYTES", "  ")
    assert units.env_bytes("DYMEM_TEST_BYTES") is None
    monkeypatch.setenv("DYMEM_TEST_BYTES", "1GiB")
    assert units.env_bytes("DYMEM_TEST_BYTES") == GiB
    monkeypatch.setenv("DYMEM_TEST_BYTES", "1 gigabyte")
    with pytest.raises(ValueError, match=r"DYMEM_TEST_BYTES='1 gigabyte' is not a valid cache size: invalid byte"):
        units.env_bytes("DYMEM_TEST_BYTES", "cache size")


HOST_POOL_CACHE = "from dymem_tf.memory import host_pool; print(host_pool.host_pool_stats()['cache_limit'])"


def test_host_pool_cache_env_accepts_units(python_subprocess):
    proc = python_subprocess(HOST_POOL_CACHE, env={"DYMEM_HOST_POOL_CACHE_BYTES": "512MiB"})
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) == 512 * MiB  # was the 1 GiB default: strtoll stopped at "M"


def test_host_pool_cache_env_malformed_raises(python_subprocess):
    proc = python_subprocess(HOST_POOL_CACHE, env={"DYMEM_HOST_POOL_CACHE_BYTES": "lots"})
    assert proc.returncode != 0
    assert "ValueError: DYMEM_HOST_POOL_CACHE_BYTES='lots' is not a valid host pool cache size" in proc.stderr


def test_bench_reads_sizes_with_the_library_parser(python_subprocess):
    code = ("import sys; sys.path.insert(0, 'bench'); import run_all; "
            "print(run_all.units.__file__, run_all.units.parse_bytes('512MB'), run_all.units.parse_bytes('1kib'), "
            "'tensorflow' in sys.modules)")
    proc = python_subprocess(code)
    assert proc.returncode == 0, proc.stderr
    path, mb, kib, tf_imported = proc.stdout.split()
    assert os.path.samefile(path, os.path.join(REPO, "dymem_tf", "units.py"))
    assert (int(mb), int(kib), tf_imported) == (512 * 10**6, KiB, "False")  # "MB" was read as MiB


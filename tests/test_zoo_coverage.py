"""bench/zoo_coverage.py: one small model measured end to end (dry run, the callback's pass, the least-memory and
plain plans of one trace), and the docs section rendered from saved results."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import zoo_coverage  # noqa: E402

MiB = 1 << 20


def test_a_small_model_is_measured_as_the_table_reports_it():
    """MobileNet at 32 px (the smallest it builds at, after refusing 16): planned, with swaps, a least-memory peak
    under the plain one, the pass's own seconds, and a dry run that swaps what the pass's plan swaps."""
    entry = zoo_coverage.measure_model("mobilenet", sizes=(16, 32), batch=2)
    assert entry["image_size"] == 32 and 16 in entry["refused_sizes"]
    assert entry["planned"] and entry["swaps"] > 0, entry
    assert entry["least_peak"] < entry["plain_peak"]
    assert 0 < entry["pass_s"] < entry["trace_s"] and entry["pass_stages"]["capture"] > 0
    assert 0 < entry["tf_s"] < entry["trace_s"]
    assert entry["dry_run_s"] > 0 and entry["dry_run_swaps"] == entry["pass_swaps"]
    assert entry["ops"] > 100 and "pass_skipped" not in entry


def _entry(model, ops, planned=True, **extra):
    entry = {"model": model, "image_size": 64, "batch": 4, "ops": ops, "planned": planned, "pass_s": 1.0,
             "dry_run_s": 2.5, "tf_s": 2.0, "trace_s": 3.5}
    if planned:
        entry.update(swaps=10, least_peak=50 * MiB, plain_peak=100 * MiB)
    else:
        entry.update(why="unknown-shape: tensor x | y has an unknown static shape", plain_peak=100 * MiB)
    entry.update(extra)
    return entry


def test_the_section_lists_every_model_and_checks_the_targets():
    payload = {"command": "python bench/zoo_coverage.py --models a,b,c,d", "commit": "abc1234", "batch": 4,
               "sizes": [64, 96], "models": {
                   "big": _entry("big", 40_000, pass_s=4.0, dry_run_s=40.0),
                   "small": _entry("small", 1_000),
                   "loop": _entry("loop", 2_000, planned=False),
                   "broken": {"model": "broken", "error": "timed out after 10 s"}}}
    section = zoo_coverage.report(payload)
    assert section.startswith(zoo_coverage.BEGIN) and section.endswith(zoo_coverage.END)
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0][2:] for r in rows] == ["broken", "small", "loop", "big"]  # by ops, errors first
    small = rows[1].split(" | ")
    assert small[3] == "yes" and small[4] == "10" and small[5] == "50.0 / 100.0" and small[6] == "0.50"
    assert small[9] == "2.5x"
    assert "no: unknown-shape: tensor x / y has an unknown static shape" in rows[2]  # no "|" inside a cell
    assert "error: timed out" in rows[0]
    assert "3 of 4 models planned" not in section and "2 of 4 models planned (1 did not finish: broken)" in section
    assert "passes over 3 s: big" in section and "(2 of 3 within 3x)" in section


def test_the_section_goes_after_the_pass_time_section_and_replaces_itself(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# B\n\n<!-- pass-time:begin -->\nP\n<!-- pass-time:end -->\n\n## Later\n")
    monkeypatch.setattr(zoo_coverage, "REPO", str(tmp_path))
    zoo_coverage.write_section(f"{zoo_coverage.BEGIN}\none\n{zoo_coverage.END}")
    zoo_coverage.write_section(f"{zoo_coverage.BEGIN}\ntwo\n{zoo_coverage.END}")
    text = (docs / "benchmarks.md").read_text()
    assert text.count(zoo_coverage.BEGIN) == 1 and "two" in text and "one" not in text
    assert text.index("pass-time:end") < text.index(zoo_coverage.BEGIN) < text.index("## Later")


def test_the_dry_run_traces_the_step_once():
    """The optimizer's slots are built before the trace, as the callback builds them: an optimizer built inside the
    trace creates variables there, and TensorFlow traces the whole step again (the dry run's largest cost)."""
    import keras

    import dymem_tf

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
    traced, step = [], model.train_step

    def counting(data):
        traced.append(1)
        return step(data)

    model.train_step = counting  # Keras' train function calls the model's train_step once per trace
    plan = dymem_tf.dry_run(model, batch_size=4, memory_budget=None)
    assert len(traced) == 1 and model.optimizer.built and plan.batch_size == 4

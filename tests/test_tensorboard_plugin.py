"""The TensorBoard "Dymem" plugin: HTTP routes (werkzeug test client) and the page in headless Chromium.

The browser tests train a small CNN with ``DymemCallback(memory_budget=None, log_dir=..., trace_allocations=True)``
(and a ``policy="none"``
baseline), start ``tensorboard`` on the log dir, open the Dymem tab and check that every view draws the run's data.
Screenshots go to ``artifacts/`` and the main one to ``docs/img/tensorboard_dymem.png``.
"""
import contextlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib.metadata import entry_points

import numpy as np
import pytest
from werkzeug.test import Client

from dymem_tf.observe import summaries
from dymem_tf.planning import planner
from tensorboard_plugin_dymem import logdata
from tensorboard_plugin_dymem.plugin import DymemPlugin

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(REPO, "artifacts")
DOC_SCREENSHOT = os.path.join(REPO, "docs", "img", "tensorboard_dymem.png")
PREFIX = "/data/plugin/dymem"


# ---------------------------------------------------------------------------------------------------- HTTP routes
def make_plugin(logdir):
    from tensorboard.plugins import base_plugin

    return DymemPlugin(base_plugin.TBContext(logdir=None if logdir is None else str(logdir)))


def get(plugin, route, query=""):
    """(status, headers, body) of one plugin route."""
    client = Client(plugin.get_plugin_apps()[route])
    response = client.get(f"{PREFIX}{route}{query}")
    return response.status_code, response.headers, response.get_data()


def get_json(plugin, route, query=""):
    status, headers, body = get(plugin, route, query)
    assert headers["Content-Type"].startswith("application/json")
    return status, json.loads(body)


@pytest.fixture
def logdir(tmp_path):
    """Two small runs written by hand, and one whose plan is corrupt."""
    for run in ("with", "corrupt"):
        with summaries.DymemSummaryWriter(str(tmp_path / run)) as writer:
            writer.write_step(0, {"bytes_in_use": 10, "peak_bytes_in_use": 20})
    (tmp_path / "corrupt" / "dymem" / "plugins" / "dymem" / "plan.json").write_text('{"swaps": [')
    return tmp_path


def test_entry_point_and_metadata():
    names = {ep.name: ep.value for ep in entry_points(group="tensorboard_plugins")}
    assert names.get("dymem") == "tensorboard_plugin_dymem.plugin:DymemPlugin", \
        "run `pip install -e .` so that TensorBoard finds the plugin"
    plugin = make_plugin(None)
    meta = plugin.frontend_metadata()
    assert plugin.plugin_name == "dymem" and meta.tab_name == "Dymem" and meta.es_module_path == "/index.js"
    assert set(plugin.get_plugin_apps()) == {"/index.js", "/style.css", "/runs", "/data"}


def test_static_files_are_served(logdir):
    plugin = make_plugin(logdir)
    status, headers, body = get(plugin, "/index.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert b"export async function render()" in body
    status, headers, body = get(plugin, "/style.css")
    assert status == 200 and headers["Content-Type"].startswith("text/css") and b".dymem-message" in body


def test_runs_and_data(logdir):
    plugin = make_plugin(logdir)
    assert plugin.is_active()
    status, body = get_json(plugin, "/runs")
    assert status == 200 and body["runs"] == ["corrupt/dymem", "with/dymem"] and body["message"] is None
    status, body = get_json(plugin, "/data", "?run=with/dymem")
    assert status == 200 and body["run"] == "with/dymem" and body["steps"][0]["peak_bytes_in_use"] == 20
    assert any("No plan yet" in m["text"] for m in body["messages"])


def test_corrupt_file_is_a_message_not_an_error(logdir):
    status, body = get_json(make_plugin(logdir), "/data", "?run=corrupt/dymem")
    assert status == 200 and body["plan"] is None
    errors = [m for m in body["messages"] if m["level"] == "error"]
    assert errors and errors[0]["file"] == "plan.json" and "plan.json is not valid JSON" in errors[0]["text"]


@pytest.mark.parametrize("query, status, text", [
    ("", 400, "no run given"),
    ("?run=nope", 404, "run 'nope' has no Dymem data"),
    ("?run=../etc", 404, "outside the log directory"),
    ("?run=with/dymem/../../..", 404, "outside the log directory"),
])
def test_bad_run_names_get_json_errors(logdir, query, status, text):
    got, body = get_json(make_plugin(logdir), "/data", query)
    assert got == status and text in body["error"] and "Traceback" not in body["error"]


def test_unexpected_failure_is_a_json_error(logdir, monkeypatch):
    def boom(*_):
        raise MemoryError("simulated")

    monkeypatch.setattr(logdata, "load_run", boom)
    status, body = get_json(make_plugin(logdir), "/data", "?run=with/dymem")
    assert status == 500 and body["error"] == "reading run 'with/dymem' failed: MemoryError: simulated"


@pytest.mark.parametrize("kind", ["empty", "missing", "none"])
def test_without_dymem_data_the_page_gets_a_message(tmp_path, kind):
    logdir = {"empty": tmp_path, "missing": tmp_path / "nowhere", "none": None}[kind]
    plugin = make_plugin(logdir)
    assert not plugin.is_active()
    status, body = get_json(plugin, "/runs")
    assert status == 200 and body["runs"] == []
    expected = {"empty": "No Dymem data under", "missing": "does not exist", "none": "without --logdir"}[kind]
    assert expected in body["message"]
    status, body = get_json(plugin, "/data", "?run=x")
    assert status == 404 and "error" in body


def test_logdir_spec_is_refused_clearly():
    from argparse import Namespace

    from tensorboard.plugins import base_plugin

    plugin = DymemPlugin(base_plugin.TBContext(logdir="", flags=Namespace(logdir_spec="a:/tmp/a,b:/tmp/b")))
    status, body = get_json(plugin, "/runs")
    assert status == 200 and body["runs"] == [] and "--logdir only" in body["message"]


def test_remote_logdirs_are_refused_clearly():
    status, body = get_json(make_plugin("gs://bucket/logs"), "/runs")
    assert status == 200 and body["runs"] == [] and "local log directories only" in body["message"]


def test_next_to_a_keras_tensorboard_callback(tmp_path):
    """Given the Keras TensorBoard callback's log dir, the callback writes the run ``dymem`` next to Keras' runs.

    (Without a log dir it writes nothing: tests/test_fit_side_effects.py.)"""
    import keras

    import dymem_tf

    keras.utils.set_random_seed(1)
    model = small_cnn(16)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(1).normal(size=(16, 16, 16, 3)).astype("float32")
    y = np.arange(16) % 10
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[keras.callbacks.TensorBoard(str(tmp_path)),
                         dymem_tf.DymemCallback(memory_budget=None, verbose=0, log_dir=str(tmp_path))])
    assert {"train", "dymem"} <= set(os.listdir(tmp_path))
    assert logdata.list_runs(str(tmp_path)) == ["dymem"]
    data = logdata.load_run(str(tmp_path), "dymem")
    assert data["plan"]["policy"] == "dymem" and [r["step"] for r in data["steps"]] == [0, 1]
    assert not [m for m in data["messages"] if m["level"] == "error"]


# ------------------------------------------------------------------------------------------------------- browser
CHROME_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", "--window-size=1400,1800"]


def _find(*names):
    for name in names:
        path = shutil.which(name) or (name if os.path.isabs(name) and os.access(name, os.X_OK) else None)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through selenium; skips (with the reason) when it cannot be found or started."""
    chromium = _find("chromium", "chromium-browser", "google-chrome", "/usr/bin/chromium")
    driver_path = _find("chromedriver", "/usr/bin/chromedriver")
    if not chromium or not driver_path:
        pytest.skip(f"headless Chromium not available (chromium: {chromium}, chromedriver: {driver_path}); "
                    f"install it with `apt-get install -y chromium chromium-driver` (make browser-deps)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[test])")
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="dymem-chromium-")
    for arg in CHROME_ARGS + [f"--user-data-dir={profile}"]:
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except WebDriverException as err:
        shutil.rmtree(profile, ignore_errors=True)
        pytest.skip(f"headless Chromium could not be started: {err.msg or err}".splitlines()[0])
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _free_port():
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tensorboard(logdir):
    """``tensorboard --logdir LOGDIR`` on a free port; yields its URL once it answers, kills it afterwards."""
    port = _free_port()
    log = tempfile.TemporaryFile()
    env = dict(os.environ, DYMEM_GTBM="0", TF_CPP_MIN_LOG_LEVEL="3")  # the viewer needs no allocator
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", str(port),
                             "--host", "127.0.0.1", "--reload_interval", "5"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                log.seek(0)
                output = log.read().decode(errors="replace")[-3000:]
                pytest.fail(f"tensorboard exited with {proc.returncode}:\n{output}")
            try:
                with urllib.request.urlopen(f"{url}/data/plugins_listing", timeout=5) as response:
                    if "dymem" in json.loads(response.read()):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("tensorboard did not answer within 180 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def small_cnn(size):
    import keras

    inp = keras.Input((size, size, 3))
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    b = keras.layers.BatchNormalization()(keras.layers.Conv2D(8, 3, padding="same")(a))
    c = keras.layers.Activation("relu")(keras.layers.Add()([a, b]))
    d = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(c)
    e = keras.layers.Concatenate()([c, keras.layers.Conv2D(8, 1)(d)])
    return keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(e)))


def train_run(log_dir, policy, device=None, budget=None, size=32, batch=16, steps=3, calibrate=False):
    """Three steps of a small CNN on random images with the Dymem callback, writing to ``log_dir`` with an
    allocator trace (``log_dir=None``: no summaries)."""
    import keras

    import dymem_tf

    keras.utils.set_random_seed(3)
    model = small_cnn(size)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(batch * steps, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch * steps,))
    # calibrate=False: the planner alone decides (its refusal and its tightest plan are what the fixture needs)
    callback = dymem_tf.DymemCallback(memory_budget=budget, policy=policy, device=device, min_swap_bytes=4096,
                                      calibrate=calibrate, log_dir=log_dir and str(log_dir),
                                      trace_allocations=bool(log_dir), verbose=0)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    return callback


CALIBRATED_BUDGET = 256 << 20


def tightest_run(log_dir, min_peak: int, device, tries: int = 3):
    """``train_run`` under the tightest budget that a plan with a least peak of ``min_peak`` meets. TF lists some
    nodes of each new instantiation in another order, and the plan of the next one may need a few KB more: its
    refusal's least peak is then the next try's."""
    from dymem_tf.planning.planner import BudgetTooSmallError

    for attempt in range(tries):
        tightest = math.ceil(min_peak / (1 - planner.DEFAULT_HEADROOM)) + 1
        try:
            return train_run(log_dir, "dymem", budget=tightest, device=device)
        except BudgetTooSmallError as err:
            if attempt == tries - 1 or err.min_peak_bytes is None or err.min_peak_bytes <= min_peak:
                raise
            min_peak = err.min_peak_bytes


@pytest.fixture(scope="module")
def trained_logdir(tmp_path_factory):
    """Runs ``with/dymem`` (Dymem plan), ``without/dymem`` (policy none), ``slow-link/dymem`` (a budget that needs
    more swaps than a 1 GB/s host link can hide, so some swap-ins stall), ``calibrated/dymem`` (a budget with the
    first-step calibration: a probe plan, then a calibrated one) and ``corrupt/dymem`` (a damaged copy)."""
    from dymem_tf.memory import allocator
    from dymem_tf.planning.device_profiles import get_profile
    from dymem_tf.planning.planner import BudgetTooSmallError

    if not allocator.is_active():
        pytest.fail("the GTBM allocator is not active in the test process: the trace needs it")
    root = tmp_path_factory.mktemp("tb_logs")
    # batch 32: the plan's swaps save more than a pageblock (at 16 they save less, and nothing is swapped)
    callback = train_run(root / "with", "dymem", batch=32)
    assert callback.plan is not None and callback.plan.swaps, "the plan should swap feature maps of the CNN"
    train_run(root / "without", "none", batch=32)
    link = get_profile("cpu", h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    with pytest.raises(BudgetTooSmallError) as too_small:
        train_run(None, "dymem", budget=1 << 20, device=link)
    # the tightest budget the planner can meet swaps tensors whose copies the slow link cannot hide
    # the callback plans with DEFAULT_HEADROOM of the budget kept free
    slow = tightest_run(root / "slow-link", too_small.value.min_peak_bytes, link)
    assert slow.plan.predicted.stall_s > 0, "the tightest budget over a 1 GB/s link should stall the step"
    calibrated = train_run(root / "calibrated", "dymem", budget=CALIBRATED_BUDGET, calibrate=True)
    assert [r.plan.params.stage for r in calibrated.records] == ["probe", "calibrated"]
    shutil.copytree(root / "with" / "dymem" / "plugins", root / "corrupt" / "dymem" / "plugins")
    corrupt = root / "corrupt" / "dymem" / "plugins" / "dymem"
    (corrupt / "plan.json").write_text((corrupt / "plan.json").read_text()[:100])
    (corrupt / "trace.csv").write_text("id,lower,upper\n1,2,3\n")
    return root


@pytest.fixture(scope="module")
def dashboard(trained_logdir, browser):
    with tensorboard(trained_logdir) as url:
        yield url, browser


def open_dymem(driver, url):
    """Load TensorBoard's Dymem tab and switch into the plugin's iframe once the page has drawn."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.switch_to.default_content()
    driver.get(f"{url}/#dymem")
    frame = WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "iframe"))[0]
    driver.switch_to.frame(frame)
    wait_drawn(driver)


def wait_drawn(driver, timeout=60):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(lambda d: d.find_elements(
        By.CSS_SELECTOR, "#dymem-root:not([data-state=loading])"))
    return driver.find_element(By.ID, "dymem-root").get_attribute("data-state")


def select_runs(driver, run_a, run_b=""):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    Select(driver.find_element(By.ID, "dymem-run-a")).select_by_value(run_a)
    Select(driver.find_element(By.ID, "dymem-run-b")).select_by_value(run_b)
    expected = [run_a] + ([run_b] if run_b else [])
    # One atomic read of the page: the panes are replaced while a selection is being drawn.
    WebDriverWait(driver, 60).until(lambda d: d.execute_script(
        "const root = document.getElementById('dymem-root');"
        "return root.dataset.state === 'ready' && "
        "[...root.querySelectorAll('.dymem-pane')].map((p) => p.dataset.run).join('|') === arguments[0];",
        "|".join(expected)))


def screenshot(driver, name):
    """Save the plugin page (``#dymem-root``) as ``artifacts/<name>.png``; returns the path."""
    from selenium.webdriver.common.by import By

    os.makedirs(ARTIFACTS, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.switch_to.default_content()
    driver.set_window_size(1400, min(height + 300, 8000))
    driver.switch_to.frame(driver.find_element(By.CSS_SELECTOR, "iframe"))
    path = os.path.join(ARTIFACTS, f"{name}.png")
    driver.find_element(By.ID, "dymem-root").screenshot(path)
    return path


UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def assert_label(text, value):
    """The label shows ``value`` in the page's binary units, to the printed precision (0.1 of the unit)."""
    number, unit = re.search(r"(-?[\d.]+) (B|KiB|MiB|GiB)\b", text).groups()
    expected_unit = next(u for u, size in reversed(UNITS.items()) if abs(value) >= size or u == "B")
    assert unit == expected_unit, (text, value)
    assert abs(float(number) * UNITS[unit] - value) <= 0.05 * UNITS[unit] * (1 + 1e-9) + 0.5, (text, value)


def peak_of_trace(path):
    """(peak bytes, live buffers) of an allocator trace, by a plain sweep over its events."""
    rows = logdata.read_trace(str(path))
    events = sorted([(r.lower, r.size) for r in rows] + [(r.upper, -r.size) for r in rows])
    in_use = best = 0
    best_t = None
    for t, delta in events:
        in_use += delta
        if in_use > best:
            best, best_t = in_use, t
    return best, [r for r in rows if r.lower <= best_t < r.upper]


def attr(element, name, cast=str):
    return cast(element.get_attribute(name))


@pytest.mark.browser
def test_views_draw_the_training_run(dashboard, trained_logdir):
    from selenium.webdriver.common.by import By

    url, driver = dashboard
    open_dymem(driver, url)
    runs = [o.get_attribute("value") for o in driver.find_elements(By.CSS_SELECTOR, "#dymem-run-a option")]
    assert runs == ["calibrated/dymem", "corrupt/dymem", "slow-link/dymem", "with/dymem", "without/dymem"]
    select_runs(driver, "with/dymem")
    pdir = trained_logdir / "with" / "dymem" / "plugins" / "dymem"
    plan = json.loads((pdir / "plan.json").read_text())
    pane = driver.find_element(By.ID, "dymem-pane-a")
    assert pane.get_attribute("data-run") == "with/dymem"
    assert not pane.find_elements(By.CSS_SELECTOR, ".dymem-message-error")

    # summary: figures from plan.json
    summary = driver.find_element(By.ID, "dymem-summary-a")
    swaps = summary.find_element(By.CSS_SELECTOR, "[data-key=num_swaps] dd")
    assert attr(swaps, "data-value", int) == len(plan["swaps"]) and swaps.text == str(len(plan["swaps"]))
    peak = summary.find_element(By.CSS_SELECTOR, "[data-key=predicted_peak_bytes] dd")
    assert attr(peak, "data-value", int) == plan["predicted"]["peak_bytes"]
    assert_label(peak.text, plan["predicted"]["peak_bytes"])
    assert summary.find_element(By.CSS_SELECTOR, "[data-key=policy] dd").text == "dymem"

    # (1) memory timeline: modelled per layer and measured from the trace
    timeline = driver.find_element(By.ID, "dymem-timeline-a")
    model_chart = timeline.find_element(By.CSS_SELECTOR, "figure[data-source=model]")
    points = json.loads((pdir / "timeline.json").read_text())["points"]
    assert attr(model_chart, "data-points", int) == len(points) == plan["num_layers"]
    assert attr(model_chart, "data-peak-bytes", int) == plan["predicted"]["peak_bytes"]
    assert_label(model_chart.find_element(By.CSS_SELECTOR, ".dymem-peak-label").text, plan["predicted"]["peak_bytes"])
    groups = {a.get_attribute("data-group") for a in model_chart.find_elements(By.CSS_SELECTOR, ".dymem-area")}
    assert {"transient", "mobile"} <= groups
    assert model_chart.find_elements(By.CSS_SELECTOR, "[data-line=no_swap]")
    trace_chart = timeline.find_element(By.CSS_SELECTOR, "figure[data-source=trace]")
    assert trace_chart.find_elements(By.CSS_SELECTOR, "[data-line=reserved]")
    trace_peak, live = peak_of_trace(pdir / "trace.csv")

    # (2) pool map at the peak of the trace
    pool = driver.find_element(By.ID, "dymem-pool-a")
    blocks = pool.find_elements(By.CSS_SELECTOR, "g.dymem-block")
    assert attr(pool, "data-count", int) == len(blocks) == len(live)
    assert sorted(attr(b, "data-size", int) for b in blocks) == sorted(r.size for r in live)
    in_use = pool.find_element(By.CSS_SELECTOR, "[data-key=in_use_bytes] dd")
    assert attr(in_use, "data-value", int) == trace_peak
    assert_label(in_use.text, trace_peak)
    assert 0 <= attr(pool, "data-fragmentation", float) <= 1
    # one name per figure: "fragmentation" is the gaps' 1 - largest gap / free, 1 - in use / reserved is the
    # reserved overhead (in the summary and beside the pool map)
    labels = [dt.text for dt in pane.find_elements(By.CSS_SELECTOR, ".dymem-figure dt")]
    assert [t for t in labels if "ragmentation" in t] == ["Fragmentation (1 − largest gap / free)"]
    assert [t for t in labels if "in use / reserved" in t] == ["Reserved overhead (1 − in use / reserved, last step)"] * 2
    assert {b.get_attribute("data-group") for b in blocks} <= set(logdata.GROUPS)

    # (3) swap schedule: one row per swapped tensor of plan.json, stalls marked
    schedule = driver.find_element(By.ID, "dymem-schedule-a")
    rows = schedule.find_elements(By.CSS_SELECTOR, "g.dymem-swap")
    assert attr(schedule, "data-count", int) == len(rows) == len(plan["swaps"])
    assert {r.get_attribute("data-tensor"): attr(r, "data-bytes", int) for r in rows} == \
        {s["tensor"]: s["bytes"] for s in plan["swaps"]}
    for r in rows:
        decision = next(s for s in plan["swaps"] if s["tensor"] == r.get_attribute("data-tensor"))
        assert attr(r, "data-producer-layer", int) == decision["producer_layer"]
        assert attr(r, "data-trigger-layer", int) == decision["swap_ins"][0]["trigger_layer"]
        assert attr(r, "data-swap-ins", int) == len(decision["swap_ins"])
        assert len(r.find_elements(By.CSS_SELECTOR, ".dymem-swap-in")) == len(decision["swap_ins"])
    stalled = sum(1 for s in plan["swaps"] for si in s["swap_ins"] if si["predicted_stall_s"] > 0)
    assert attr(schedule, "data-stalls", int) == stalled == len(schedule.find_elements(By.CSS_SELECTOR,
                                                                                    ".dymem-swap-in.dymem-stall"))
    assert f"{len(plan['swaps'])} swapped tensors" in schedule.find_element(By.CSS_SELECTOR,
                                                                          ".dymem-schedule-summary").text

    # (4) largest tensors at the peak, sortable
    tensors = driver.find_element(By.ID, "dymem-tensors-a")
    table_rows = tensors.find_elements(By.CSS_SELECTOR, "tr.dymem-tensor-row")
    assert attr(tensors, "data-count", int) == len(table_rows) == min(len(live), logdata.MAX_PEAK_TENSORS)
    assert attr(tensors, "data-total", int) == len(live)
    sizes = [attr(r, "data-size", int) for r in table_rows]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == max(r.size for r in live)
    assert table_rows[0].find_element(By.CSS_SELECTOR, "td[data-key=op]").get_attribute("title") == \
        max(live, key=lambda r: (r.size, -r.id)).op
    screenshot(driver, "tensorboard_dymem_run")

    header = tensors.find_element(By.CSS_SELECTOR, "th[data-sort-key=size]")
    header.click()
    assert header.get_attribute("aria-sort") == "ascending"
    ascending = [attr(r, "data-size", int) for r in tensors.find_elements(By.CSS_SELECTOR, "tr.dymem-tensor-row")]
    assert ascending == sorted(sizes)
    tensors.find_element(By.CSS_SELECTOR, "th[data-sort-key=op]").click()
    assert driver.execute_script(
        "const ops = [...arguments[0].querySelectorAll('tr.dymem-tensor-row')].map((r) => r.dataset.op);"
        "return ops.every((op, i) => i === 0 || ops[i - 1].localeCompare(op) <= 0);", tensors)


def plan_lines(run_dir):
    return [json.loads(line) for line in (run_dir / "plugins" / "dymem" / "plans.jsonl").read_text().splitlines()]


@pytest.mark.browser
def test_predicted_vs_measured_per_plan(dashboard, trained_logdir):
    """The "Predicted vs measured" view: per plan the predicted and the measured device peak of its first step (and
    for the calibrated plan the calibration), and the measured step peaks against the prediction and the budget."""
    from selenium.webdriver.common.by import By

    url, driver = dashboard
    open_dymem(driver, url)
    for run, stages in (("with/dymem", [None]), ("calibrated/dymem", ["probe", "calibrated"])):
        select_runs(driver, run)
        run_dir = trained_logdir / run
        written = plan_lines(run_dir)
        assert [p["stage"] for p in written] == stages
        view = driver.find_element(By.ID, "dymem-measured-a")
        assert not view.find_elements(By.CSS_SELECTOR, ".dymem-message-error")
        rows = view.find_elements(By.CSS_SELECTOR, "tr.dymem-plan-row")
        assert attr(view, "data-count", int) == attr(view, "data-measured", int) == len(rows) == len(written)
        for row, plan in zip(rows, written):
            m = plan["measured"]
            # exact unless memory other objects of this test process freed during the step hid the step's own peak
            # (then the row shows an upper bound, "≤")
            assert m["outcome"] == "ran", m
            assert attr(row, "data-exact") == str(m["exact"]).lower()
            assert attr(row, "data-stage") == (plan["stage"] or "")
            assert attr(row, "data-predicted-bytes", int) == plan["predicted_peak_bytes"]
            assert attr(row, "data-measured-bytes", int) == m["peak_bytes"]
            assert attr(row, "data-in-use-bytes", int) == m["peak_bytes_in_use"]
            assert_label(row.find_element(By.CSS_SELECTOR, "td[data-key=predicted_peak_bytes]").text,
                         plan["predicted_peak_bytes"])
            assert_label(row.find_element(By.CSS_SELECTOR, "td[data-key=measured_peak_bytes]").text, m["peak_bytes"])
            if m["exact"]:
                assert attr(row, "data-error", float) == pytest.approx(m["error"])
                assert row.find_element(By.CSS_SELECTOR, "td[data-key=error]").text.endswith(" %")
            else:
                assert "≤" in row.find_element(By.CSS_SELECTOR, "td[data-key=measured_peak_bytes]").text
        calibration_rows = view.find_elements(By.CSS_SELECTOR, "tr.dymem-calibration-row")
        if run == "with/dymem":
            assert calibration_rows == []
            summary = driver.find_element(By.CSS_SELECTOR, "#dymem-summary-a [data-key=first_step_peak_bytes] dd")
            assert attr(summary, "data-value", int) == written[0]["measured"]["peak_bytes"]
        else:
            (cal_row,) = calibration_rows
            cal = written[1]["calibration"]
            assert attr(cal_row, "data-index", int) == 1
            # the probe simulated again with the kernel temporaries its step measured: never below the plan's own
            # prediction, far above it where Eigen's convolution gradients take im2col workspaces (oneDNN off)
            assert attr(cal_row, "data-raw-predicted-bytes", int) == cal["predicted_peak_bytes"] >= \
                written[0]["predicted_peak_bytes"]
            assert attr(cal_row, "data-measured-bytes", int) == cal["measured_peak_bytes"]
            assert attr(cal_row, "data-headroom", float) == pytest.approx(cal["headroom"])
            assert attr(cal_row, "data-calibrated-bytes", int) == written[1]["measured"]["calibrated_predicted_peak_bytes"]
            assert "headroom" in cal_row.text
        # the measured step peaks against the plan's prediction and the budget
        steps = [json.loads(line) for line in
                 (run_dir / "plugins" / "dymem" / "steps.jsonl").read_text().splitlines()]
        chart = view.find_element(By.CSS_SELECTOR, "figure[data-source=steps]")
        assert attr(chart, "data-points", int) == len(steps) == 3
        assert attr(chart, "data-peak-bytes", int) == max(s["peak_bytes_reserved"] for s in steps)
        assert len(chart.find_elements(By.CSS_SELECTOR, "circle.dymem-step-point")) == len(steps)
        assert {l.get_attribute("data-line") for l in chart.find_elements(By.CSS_SELECTOR, "path.dymem-line")} >= \
            {"reserved", "in_use", "predicted"}
        assert [attr(m, "data-plan", int) for m in chart.find_elements(By.CSS_SELECTOR, "line.dymem-marker")] == \
            list(range(len(written)))
        if run == "calibrated/dymem":
            assert attr(chart, "data-budget-bytes", int) == CALIBRATED_BUDGET
            assert attr(chart, "data-over-budget", int) == 0
            budget = chart.find_element(By.CSS_SELECTOR, "[data-line=budget]")
            assert attr(budget, "data-bytes", int) == CALIBRATED_BUDGET
            screenshot(driver, "tensorboard_dymem_measured")


@pytest.mark.browser
def test_two_runs_side_by_side(dashboard, trained_logdir):
    from selenium.webdriver.common.by import By

    url, driver = dashboard
    open_dymem(driver, url)
    select_runs(driver, "with/dymem", "without/dymem")
    panes = driver.find_elements(By.CSS_SELECTOR, "#dymem-panes.dymem-compare > .dymem-pane")
    assert [p.get_attribute("id") for p in panes] == ["dymem-pane-a", "dymem-pane-b"]
    baseline = json.loads((trained_logdir / "without" / "dymem" / "plugins" / "dymem" / "plan.json").read_text())
    assert baseline["policy"] == "none" and baseline["swaps"] == []
    schedule_b = driver.find_element(By.ID, "dymem-schedule-b")
    assert attr(schedule_b, "data-count", int) == 0
    assert "swaps nothing" in schedule_b.find_element(By.CSS_SELECTOR, ".dymem-message").text
    peak_b = driver.find_element(By.CSS_SELECTOR, "#dymem-timeline-b figure[data-source=model]")
    assert attr(peak_b, "data-peak-bytes", int) == baseline["predicted"]["peak_bytes"]
    peak_a = driver.find_element(By.CSS_SELECTOR, "#dymem-timeline-a figure[data-source=model]")
    assert attr(peak_a, "data-peak-bytes", int) < attr(peak_b, "data-peak-bytes", int), \
        "swapping lowers the modelled peak"
    assert driver.find_elements(By.CSS_SELECTOR, "#dymem-pool-b g.dymem-block")
    path = screenshot(driver, "tensorboard_dymem_compare")
    os.makedirs(os.path.dirname(DOC_SCREENSHOT), exist_ok=True)
    shutil.copyfile(path, DOC_SCREENSHOT)


@pytest.mark.browser
def test_stalls_are_highlighted(dashboard, trained_logdir):
    from selenium.webdriver.common.by import By

    url, driver = dashboard
    open_dymem(driver, url)
    select_runs(driver, "slow-link/dymem")
    plan = json.loads((trained_logdir / "slow-link" / "dymem" / "plugins" / "dymem" / "plan.json").read_text())
    stalls = {s["tensor"]: sum(si["predicted_stall_s"] for si in s["swap_ins"]) for s in plan["swaps"]}
    schedule = driver.find_element(By.ID, "dymem-schedule-a")
    stalled_ins = sum(1 for s in plan["swaps"] for si in s["swap_ins"] if si["predicted_stall_s"] > 0)
    assert attr(schedule, "data-stalls", int) == stalled_ins > 0
    assert len(schedule.find_elements(By.CSS_SELECTOR, ".dymem-swap-in.dymem-stall")) == stalled_ins
    marked = {g.get_attribute("data-tensor") for g in schedule.find_elements(By.CSS_SELECTOR, "g.dymem-stalled")}
    assert marked == {t for t, stall in stalls.items() if stall > 0}
    for g in schedule.find_elements(By.CSS_SELECTOR, "g.dymem-swap"):
        assert attr(g, "data-stall-s", float) == pytest.approx(stalls[g.get_attribute("data-tensor")])
    summary = driver.find_element(By.CSS_SELECTOR, "#dymem-summary-a [data-key=stall_s] dd")
    assert attr(summary, "data-value", float) == pytest.approx(plan["predicted"]["stall_s"])
    screenshot(driver, "tensorboard_dymem_stalls")


@pytest.mark.browser
def test_corrupt_run_shows_what_is_wrong(dashboard):
    from selenium.webdriver.common.by import By

    url, driver = dashboard
    open_dymem(driver, url)
    select_runs(driver, "corrupt/dymem")
    errors = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#dymem-pane-a .dymem-message-error")]
    assert any(e.startswith("plan.json is not valid JSON") for e in errors), errors
    assert any("trace.csv lacks the column(s) size, group, offset" in e for e in errors), errors
    # what is intact still draws: the timeline and the schedule of the run
    assert driver.find_elements(By.CSS_SELECTOR, "#dymem-timeline-a figure[data-source=model]")
    assert attr(driver.find_element(By.ID, "dymem-schedule-a"), "data-count", int) > 0
    screenshot(driver, "tensorboard_dymem_corrupt")


@pytest.mark.browser
def test_empty_logdir_shows_a_message(browser, tmp_path):
    from selenium.webdriver.common.by import By

    with tensorboard(tmp_path) as url:
        open_dymem(browser, url)
        assert wait_drawn(browser) == "empty"
        message = browser.find_element(By.CSS_SELECTOR, "#dymem-global-messages .dymem-message[data-kind=empty]")
        assert "No Dymem data under" in message.text and "DymemCallback(log_dir=" in message.text
        assert not browser.find_elements(By.CSS_SELECTOR, ".dymem-pane")
        screenshot(browser, "tensorboard_dymem_empty")


def test_the_schedule_keeps_whether_a_swap_is_offloaded_optimizer_state():
    from tensorboard_plugin_dymem import logdata

    plan = {"num_layers": 9, "swaps": [
        {"tensor": "conv/Relu:0", "bytes": 64, "producer_layer": 1, "swap_ins": []},
        {"tensor": "adam_m:0", "bytes": 32, "producer_layer": 0, "kind": "variable",
         "swap_ins": [{"trigger_op": "g", "trigger_layer": 6, "consumers": ["read_m"],
                       "start_layer_of_consumers": 7}]},
        {"tensor": "kernel:0", "bytes": 32, "producer_layer": 0, "kind": "weight",
         "route": {"reads": ["read_k"], "clones": [], "reroutes": [["g", "read_k"]], "writes": ["upd"]},
         "swap_ins": [{"trigger_op": "f0", "trigger_layer": 1, "consumers": ["f1"], "start_layer_of_consumers": 2},
                      {"trigger_op": "g0", "trigger_layer": 6, "consumers": ["g", "upd"],
                       "start_layer_of_consumers": 7}]}]}
    schedule = logdata.schedule_from_plan(plan)
    # a plan from before kinds: "tensor"
    assert [s["kind"] for s in schedule["swaps"]] == ["tensor", "variable", "weight"]
    assert len(schedule["swaps"][2]["swap_ins"]) == 2

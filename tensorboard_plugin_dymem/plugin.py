"""The TensorBoard "Dymem" plugin: serves the page in ``static/`` and the data of the runs under ``--logdir``.

Registered through the ``tensorboard_plugins`` entry point in pyproject.toml. Routes (under
``/data/plugin/dymem``): ``/index.js`` and ``/style.css`` (the page), ``/runs`` (runs with Dymem data) and
``/data?run=NAME`` (everything the views draw, see :func:`tensorboard_plugin_dymem.logdata.load_run`).
Errors are JSON objects ``{"error": message}`` with a 4xx/5xx status, never a stack trace.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tensorboard_plugin_dymem import logdata

logger = logging.getLogger(__name__)

_STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_STATIC_TYPES = {"/index.js": ("index.js", "text/javascript"), "/style.css": ("style.css", "text/css")}
_RUNS_TTL_S = 5.0  # how long a walk of the log directory is reused (is_active runs on every page refresh)


class DymemPlugin(base_plugin.TBPlugin):
    """Memory plan, modelled timeline, swap schedule and GTBM pool state of Dymem runs."""

    plugin_name = logdata.PLUGIN_NAME

    def __init__(self, context):
        self._logdir = os.path.expanduser(context.logdir) if getattr(context, "logdir", None) else ""
        self._logdir_spec = getattr(getattr(context, "flags", None), "logdir_spec", "") or ""
        self._runs_cache: tuple[float, list[str]] | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------------------- TBPlugin API
    def get_plugin_apps(self):
        return {
            "/index.js": self._serve_static,
            "/style.css": self._serve_static,
            "/runs": self._serve_runs,
            "/data": self._serve_data,
        }

    def is_active(self):
        try:
            return bool(self._runs())
        except OSError:
            return False

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Dymem")

    # -------------------------------------------------------------------------------------------------- helpers
    def _logdir_problem(self) -> str | None:
        if not self._logdir:
            if self._logdir_spec:
                return "The Dymem plugin reads runs under --logdir only; start TensorBoard with --logdir."
            return "TensorBoard was started without --logdir, so there are no Dymem runs to show."
        if "://" in self._logdir:
            return (f"The Dymem plugin reads local log directories only; {self._logdir!r} is remote. "
                    f"Copy the runs to a local directory.")
        if not os.path.isdir(self._logdir):
            return f"The log directory {self._logdir!r} does not exist (yet)."
        return None

    def _runs(self, refresh: bool = False) -> list[str]:
        if self._logdir_problem():
            return []
        now = time.monotonic()
        with self._lock:
            cached = self._runs_cache
        if cached is not None and not refresh and now - cached[0] < _RUNS_TTL_S:
            return cached[1]
        runs = logdata.list_runs(self._logdir)
        with self._lock:
            self._runs_cache = (now, runs)
        return runs

    # --------------------------------------------------------------------------------------------------- routes
    @wrappers.Request.application
    def _serve_static(self, request):
        name, mimetype = _STATIC_TYPES[request.path[request.path.rfind("/"):]]
        try:
            with open(os.path.join(_STATIC_DIR, name), "rb") as fh:
                body = fh.read()
        except OSError:
            return _error(request, f"the plugin's {name} is missing from the installed package", 500)
        return http_util.Respond(request, body, mimetype)

    @wrappers.Request.application
    def _serve_runs(self, request):
        problem = self._logdir_problem()
        try:
            runs = [] if problem else self._runs(refresh=True)
        except OSError as err:
            return _error(request, f"cannot list the log directory: {err.strerror or err}", 500)
        if not problem and not runs:
            problem = (f"No Dymem data under {self._logdir!r}. Train with "
                       f"dymem_tf.DymemCallback(log_dir=...) and point --logdir at that directory.")
        return http_util.Respond(request, {"logdir": self._logdir, "runs": runs, "message": problem},
                                 "application/json")

    @wrappers.Request.application
    def _serve_data(self, request):
        problem = self._logdir_problem()
        if problem:
            return _error(request, problem, 404)
        run = request.args.get("run", "")
        try:
            payload = logdata.load_run(self._logdir, run)
        except logdata.DataError as err:
            return _error(request, str(err), 404 if run else 400)
        except Exception as err:  # pylint: disable=broad-except  (the page gets a message, the log the trace)
            logger.exception("Dymem plugin: reading run %r failed", run)
            return _error(request, f"reading run {run!r} failed: {type(err).__name__}: {err}", 500)
        return http_util.Respond(request, payload, "application/json")


def _error(request, message: str, code: int):
    return http_util.Respond(request, {"error": message}, "application/json", code=code)

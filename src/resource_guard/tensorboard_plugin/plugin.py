"""The Resource Guard tab of TensorBoard: a dynamic plugin (the ``tensorboard_plugins`` entry point)
that serves the views of :mod:`resource_guard.tensorboard_plugin.views` as JSON and a static frontend
(``static/``: plain HTML, JavaScript and CSS, nothing fetched from the network).

Routes, below ``/data/plugin/resource_guard``: ``/runs``, ``/overview?run=``, ``/steps?run=``,
``/memory?run=``, ``/plan?run=``, ``/ops?run=``, ``/compare?a=&b=``, ``/memory.png?run=`` and ``/static/*``.
"""

from __future__ import annotations

import json
import mimetypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from resource_guard.tensorboard_plugin import views
from resource_guard.tensorboard_plugin.compare import compare_reports
from resource_guard.tensorboard_plugin.runs import find_runs, read_json, run_by_name

__all__ = ["PLUGIN_NAME", "TAB_NAME", "ResourceGuardPlugin"]

PLUGIN_NAME = "resource_guard"
TAB_NAME = "Resource Guard"
STATIC_DIR = Path(__file__).parent / "static"
_STATIC_FILES = ("index.js", "style.css")


class ResourceGuardPlugin(base_plugin.TBPlugin):
    """Reads the runs below TensorBoard's ``--logdir`` that wrote ``report.json`` or ``guard.json``."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        super().__init__(context)
        self._logdir = context.logdir or ""

    def get_plugin_apps(self) -> dict[str, Callable[..., Any]]:
        routes: dict[str, Callable[[wrappers.Request], wrappers.Response]] = {
            "/runs": self._runs,
            "/overview": self._view(views.overview),
            "/steps": self._view(views.step_time),
            "/memory": self._view(views.memory),
            "/plan": self._view(views.plan),
            "/ops": self._view(views.ops),
            "/compare": self._compare,
            "/memory.png": self._picture,
            "/static/*": self._static,
        }
        return {path: wrappers.Request.application(handler) for path, handler in routes.items()}

    def is_active(self) -> bool:
        return bool(self._logdir) and bool(find_runs(self._logdir))

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/static/index.js", tab_name=TAB_NAME)

    # -- routes ----------------------------------------------------------------------------------
    def _runs(self, request: wrappers.Request) -> wrappers.Response:
        runs = [
            {"name": r.name, "report": r.report_path.is_file(), "guard": r.guard_path.is_file()}
            for r in find_runs(self._logdir)
        ]
        return _json(runs)

    def _view(self, view: Callable[[Any], dict[str, Any]]) -> Callable[[wrappers.Request], wrappers.Response]:
        def serve(request: wrappers.Request) -> wrappers.Response:
            run = run_by_name(self._logdir, request.args.get("run", ""))
            if run is None:
                return _json({"error": f"no run {request.args.get('run')!r}"}, status=404)
            return _json(view(run))

        return serve

    def _compare(self, request: wrappers.Request) -> wrappers.Response:
        pair = [run_by_name(self._logdir, request.args.get(k, "")) for k in ("a", "b")]
        a, b = (read_json(r.report_path) if r is not None else None for r in pair)
        if a is None or b is None:
            return _json({"error": "both runs need a report.json"}, status=404)
        return _json({"a": request.args["a"], "b": request.args["b"], **compare_reports(a, b)})

    def _picture(self, request: wrappers.Request) -> wrappers.Response:
        run = run_by_name(self._logdir, request.args.get("run", ""))
        if run is None or not run.picture_path.is_file():
            return wrappers.Response("no memory.png", status=404, content_type="text/plain")
        return wrappers.Response(run.picture_path.read_bytes(), content_type="image/png")

    def _static(self, request: wrappers.Request) -> wrappers.Response:
        name = request.path.rsplit("/", 1)[-1]
        if name not in _STATIC_FILES:  # a fixed list: no path below the package is reachable otherwise
            return wrappers.Response("not found", status=404, content_type="text/plain")
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if name.endswith(".js"):
            kind = "text/javascript"
        return wrappers.Response((STATIC_DIR / name).read_bytes(), content_type=kind)


def _json(data: Any, status: int = 200) -> wrappers.Response:
    body = json.dumps(data, default=str, allow_nan=False)
    return wrappers.Response(body, status=status, content_type="application/json")

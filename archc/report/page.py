"""The report's JSON as one self-contained HTML page: the data embedded as it is, the page's
JavaScript and CSS (``assets/``, written for it) inlined, and each kernel's source highlighted
by Pygments now, so the page needs nothing from a network."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import jinja2
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

from archc.report.data import to_json

ASSETS = resources.files("archc.report") / "assets"
HIGHLIGHT_CLASS = "hl"       # the CSS class Pygments' rules are scoped to (report.css's `pre.hl`)


def _asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def script_json(text: str) -> str:
    """JSON text that can sit inside a <script> element: `</` and `<!--` written with an
    escaped slash and bracket, which JSON reads back as the same characters."""
    return text.replace("</", "<\\/").replace("<!--", "\\u003c!--")


def highlighted(data: dict[str, Any]) -> dict[str, str]:
    """Kernel name → its source as highlighted HTML (Pygments escapes the text)."""
    formatter = HtmlFormatter(nowrap=True)
    return {k["name"]: highlight(k["source"], PythonLexer(), formatter) for k in data["kernels"]}


def render(data: dict[str, Any]) -> str:
    """The page of `data` (``report.data.build``)."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
    page = env.from_string(_asset("page.html"))
    return page.render(
        title=f"archc report: {jinja2.utils.markupsafe.escape(data['model'])}",
        css=_asset("report.css"), js=_asset("report.js"),
        highlight_css=HtmlFormatter().get_style_defs(f".{HIGHLIGHT_CLASS}"),
        data=script_json(to_json(data)),
        highlighted=script_json(json.dumps(highlighted(data))))

"""A griffe extension for the API reference (mkdocs.yml): the package's docstrings are Google-style with
reST inline markup, read here as Markdown.

- ``:class:`~resource_guard.Plan``` (any role) becomes ```Plan``` (``~`` keeps the last name, as Sphinx
  does); ``:func:`text <target>``` becomes ```text```.
- ``Example:`` opens griffe's examples section (it knows ``Examples:``), so ``>>>`` lines are shown as
  Python sessions, not as Markdown quotes.
- A paragraph's closing ``::`` (reST's literal block marker) becomes ``:``; the indented block after it
  is a code block in Markdown too.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":[a-z]+:`(~?)([^`<]*?)(?:\s*<[^`>]*>)?`")
_EXAMPLE = re.compile(r"^(\s*)Example::?\s*$", re.M)
_LITERAL = re.compile(r"(\S)::$", re.M)


def _short(match: re.Match[str]) -> str:
    tilde, text = match.group(1), match.group(2).strip()
    return f"`{text.rsplit('.', 1)[-1] if tilde else text}`"


def rst_to_markdown(text: str) -> str:
    """The reST inline markup of ``text`` in Markdown.

    >>> rst_to_markdown("see :class:`~resource_guard.Plan` and :func:`plan`::")
    'see `Plan` and `plan`:'
    """
    text = _ROLE.sub(_short, text)
    text = _EXAMPLE.sub(r"\1Examples:", text)
    return _LITERAL.sub(r"\1:", text)


class RstToMarkdown(griffe.Extension):
    """Rewrite every docstring of the loaded package once its object tree is complete."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)

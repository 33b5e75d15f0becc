"""The analyzer's report, one form a module: ``markdown`` (report.md), ``as_json`` (report.json), ``figures`` (the
PNGs, matplotlib imported lazily), ``page`` (report.html: one self-contained page with ``strips``, the token strips of
the worst sequences), ``files`` (writes them into one directory and prints the stdout summary) and ``comparison``
(two dumps side by side). ``tables``, ``sentences``, ``configs`` and ``formatting`` are the parts they share.
"""

from .comparison import render_comparison, write_comparison
from .files import summary_text, write_html_report, write_report
from .markdown import render_markdown

__all__ = ["render_comparison", "render_markdown", "summary_text", "write_comparison", "write_html_report",
           "write_report"]

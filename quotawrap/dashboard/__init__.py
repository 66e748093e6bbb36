"""The dashboard: a local web page of what ``quotawrap status`` knows, updating by itself.

:mod:`.pages` answers each of its paths (the page, its script and style, ``data.json``) from
:func:`quotawrap.books.status.status_snapshot`; :mod:`.server` serves them for ``quotawrap dashboard``
with the standard library, and the gateway (``quotawrap serve``) serves the same answers under
:data:`~.pages.DASHBOARD_PATH`. See docs/dashboard.md.
"""

"""The ``/admin`` dashboard: its access rules (``auth``), the figures it shows
(``overview``) and its page and static files (``static/``: HTML, a small vanilla script and
uPlot, shipped in the package: no CDN, no build step). The routes are ``routes/admin.py``."""

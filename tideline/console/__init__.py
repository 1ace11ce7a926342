"""The operations console (``tideline console``): a page a person can glance at, and its JSON endpoints.

- :mod:`.panels` — each panel is what a status command computes (``log describe``, ``capture
  status``, ``log groups``, ``project status``, ``schemas list``), called the same way;
- :mod:`.state` — the latest panels and the charts' time series, refreshed by a sampler thread;
- :mod:`.app` — the FastAPI app: the page (``static/``: plain HTML, JS and CSS, charts drawn
  as SVG, nothing fetched from elsewhere) and ``/api/<panel>``.
"""

"""View-models of the dashboard: the read model's answers (``precision_lab.store.views``) and the services' results
turned into DataFrames, Plotly figures and text.

- ``sessions``: the session list with headlines; uploads and samples -> new sessions.
- ``overview``: runs, first non-finite producers, top offenders, diagnosis cards, error vs order.
- ``ops``: the filtered, sorted op table, a page at a time (the work done in DuckDB).
- ``detail``: one record against number formats (histogram overlays, exact counts, headroom).
- ``diff``: reference | candidate | metrics per op, and the N-run view.
- ``timeline``: a long run's alerts, heatmap, series and module tree.
- ``common``: pages of a table, severity, number text, markdown escaping, server paths kept from browsers.
- ``page``: the Streamlit side (the page table, store, pickers, navigation, errors); the only module here
  that imports streamlit, so the others are usable and tested without it.
- ``html_report``: the static HTML page of a session, drawn with the same figures.
"""

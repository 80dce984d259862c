"""View-models of the dashboard: store queries turned into DataFrames and Plotly figures.

- ``sessions``: the session list with headlines; uploads and samples -> new sessions.
- ``upload``: browser uploads written safely to disk; the sample dumps.
- ``overview``: runs, first non-finite producers, top offenders, diagnosis cards, error vs order.
- ``ops``: the filtered, sorted, paginated op table (work done in DuckDB).
- ``detail``: one record against number formats (histogram overlays, exact counts, headroom).
- ``diff``: reference | candidate | metrics per op, and the N-run view.
- ``common``: severity, number text, markdown escaping.
- ``page``: the Streamlit side (store, URL state, navigation, errors); the only module here
  that imports streamlit, so the others are usable and tested without it.
"""

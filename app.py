"""Precision Lab dashboard: ``streamlit run app.py``.

Routes between the page scripts in ``pages/`` (registered once, in
``precision_lab.ui.page.PAGES``); the pages call ``precision_lab.ui`` and
render.  Torch is imported only by the pages' library calls that need it, so
the app starts fast.
"""

import streamlit as st

from precision_lab.ui.page import PAGE_ICON, navigation, page_run, routed, show_error, sweep_scratch

st.set_page_config(page_title="Precision Lab", page_icon=PAGE_ICON, layout="wide")
sweep_scratch()  # leftovers of ingests killed in an earlier server process; once per process

current = navigation()
routed()
try:
    with page_run():  # the database is let go between page runs: other processes write meanwhile
        current.run()
except Exception as e:  # no traceback ever reaches the visitor
    show_error(e, "This page could not be shown")

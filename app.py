"""Precision Lab dashboard: ``streamlit run app.py``.

Routes between the page scripts in ``pages/``; the pages call
``precision_lab.ui`` and render.  Torch is imported only by the pages'
library calls that need it, so the app starts fast.
"""

import streamlit as st

from precision_lab.ui.page import PAGE_ICON, PAGES, page_run, routed, show_error, sweep_scratch

st.set_page_config(page_title="Precision Lab", page_icon=PAGE_ICON, layout="wide")
sweep_scratch()  # leftovers of ingests killed in an earlier server process; once per process

pages = [
    st.Page(PAGES["sessions"], title="Sessions", icon=":material/folder_open:", url_path="sessions", default=True),
    st.Page(PAGES["overview"], title="Overview", icon=":material/monitoring:", url_path="overview"),
    st.Page(PAGES["ops"], title="Ops", icon=":material/table_rows:", url_path="ops"),
    st.Page(PAGES["detail"], title="Op detail", icon=":material/bar_chart:", url_path="op_detail"),
    st.Page(PAGES["diff"], title="Diff", icon=":material/compare_arrows:", url_path="diff"),
    st.Page(PAGES["timeline"], title="Timeline", icon=":material/timeline:", url_path="timeline"),
]
current = st.navigation(pages)
routed()
try:
    with page_run():  # the database is let go between page runs: other processes write meanwhile
        current.run()
except Exception as e:  # no traceback ever reaches the visitor
    show_error(e, "This page could not be shown")

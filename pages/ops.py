import streamlit as st

from precision_lab.ui import ops as ov
from precision_lab.ui import page
from precision_lab.ui.common import escape_md as plain
from precision_lab.ui.common import style_severity

store, acc, info = page.require_session("ops")
run = page.choose_run(store, info.session_id)
if run is None:
    st.info("This session holds no runs.")
    st.stop()
st.write(
    f"Every record of run {plain(run.name)}: its statistics and, where it was compared with the "
    "reference, the error and verdict. Rows are coloured by severity; select one to open its detail."
)

opts = ov.filter_choices(store, run.run_id)
# the filters live in the URL (?role=&type=&step=&rank=&q=&problems=&sort=&desc=&page=; each widget's key is its
# parameter), so a copied link opens the same table; values the run does not have are dropped
with st.container(border=True):
    c = st.columns([2, 2, 1, 1])
    roles = c[0].multiselect("Role", opts.roles, key="role", bind="query-params")
    op_types = c[1].multiselect("Op type", opts.op_types, key="type", bind="query-params")
    steps = c[2].multiselect("Step", opts.steps, key="step", bind="query-params")
    ranks = c[3].multiselect("Rank", opts.ranks, key="rank", bind="query-params")
    c = st.columns([3, 2, 2, 2])
    pattern = c[0].text_input("Name contains (or glob with * ?)", key="q", bind="query-params")
    only_problems = c[1].toggle("Problems only", key="problems", bind="query-params",
                                help="Records with NaN/Inf that reach a failure (not a mask's, written on "
                                     "purpose), or whose comparison verdict is error or nonfinite.")
    sort = c[2].selectbox("Sort by", opts.sort, key="sort", bind="query-params")
    descending = c[3].toggle("Descending", key="desc", bind="query-params")

page_size = 50
current = page.bound_value("page", int, 1)  # the pager is drawn below the table it pages
with page.guard("The op table could not be queried"):
    result = ov.filtered_page(
        store, run.run_id, steps=tuple(steps), ranks=tuple(ranks), roles=tuple(roles), op_types=tuple(op_types),
        pattern=pattern, only_problems=only_problems, sort=sort, descending=descending,
        page=max(0, current - 1), page_size=page_size)

shown = ov.display_frame(result.rows, summary=result.stats_basis)
event = st.dataframe(
    style_severity(shown.drop(columns=["rid"])), key="ops_table", on_select="rerun", selection_mode="single-row",
    hide_index=True, width="stretch", height=page.table_height(len(shown)),
)
left, right = st.columns([3, 1])
left.caption(f"{result.total} record(s) match; page {result.page + 1} of {result.pages}.")
if current != result.page + 1:  # a page past the end shows the last one (a filter shrank the table, an old link)
    st.session_state["page"] = result.page + 1
right.pagination(result.pages, key="page", bind="query-params")
picked = page.selected_row(shown, event)
if picked is not None:
    page.navigate("op_detail", session=info.name, run=run.name, op=int(picked["rid"]))

import streamlit as st

from precision_lab.ui import ops as ov
from precision_lab.ui import page
from precision_lab.ui.common import style_severity
from precision_lab.ui.overview import session_runs

store, acc = page.start("ops")
info = page.choose_session(store, acc)
st.title("Ops")
if info is None:
    st.info(page.no_session_text(acc))
    st.stop()
run = page.choose_run(session_runs(store, info["session_id"]))
if run is None:
    st.info("This session holds no runs.")
    st.stop()
st.write(
    f"Every record of run {page.plain(run['name'])}: its statistics and, where it was compared with the "
    "reference, the error and verdict. Rows are coloured by severity; select one to open its detail."
)

opts = ov.filter_options(store, run["run_id"])
# the filters live in the URL (?role=&type=&step=&rank=&q=&problems=&sort=&desc=&page=), so a copied link
# opens the same table; values the run does not have are dropped
page.from_url("f_roles", "role", page.parse_choice(opts["roles"]), [], multi=True)
page.from_url("f_types", "type", page.parse_choice(opts["op_types"]), [], multi=True)
page.from_url("f_steps", "step", page.parse_choice(opts["steps"]), [], multi=True)
page.from_url("f_ranks", "rank", page.parse_choice(opts["ranks"]), [], multi=True)
page.from_url("f_pattern", "q", str, "")
page.from_url("f_problems", "problems", page.parse_flag, False)
page.from_url("f_sort", "sort", page.parse_choice(ov.SORTABLE), "seq")
page.from_url("f_desc", "desc", page.parse_flag, False)
page.from_url("f_page", "page", page.parse_page, 1)
with st.container(border=True):
    c = st.columns([2, 2, 1, 1])
    roles = c[0].multiselect("Role", opts["roles"], key="f_roles")
    op_types = c[1].multiselect("Op type", opts["op_types"], key="f_types")
    steps = c[2].multiselect("Step", opts["steps"], key="f_steps")
    ranks = c[3].multiselect("Rank", opts["ranks"], key="f_ranks")
    c = st.columns([3, 2, 2, 2])
    pattern = c[0].text_input("Name contains (or glob with * ?)", key="f_pattern")
    only_problems = c[1].toggle("Problems only", key="f_problems",
                                help="Records with NaN/Inf, or whose comparison verdict is error or nonfinite.")
    sort = c[2].selectbox("Sort by", list(ov.SORTABLE), key="f_sort")
    descending = c[3].toggle("Descending", key="f_desc")
for param, value, default in (("role", roles, []), ("type", op_types, []), ("step", steps, []),
                              ("rank", ranks, []), ("q", pattern, ""), ("problems", only_problems, False),
                              ("sort", sort, "seq"), ("desc", descending, False)):
    page.to_url(param, value, default)

page_size = 50
current = st.session_state.get("f_page", 1)
with page.guard("The op table could not be queried"):
    result = ov.ops_page(store, ov.OpsFilter(
        run_id=run["run_id"], steps=tuple(steps), ranks=tuple(ranks), roles=tuple(roles), op_types=tuple(op_types),
        pattern=pattern, only_problems=only_problems, sort=sort, descending=descending,
        page=max(0, int(current) - 1), page_size=page_size,
    ))

shown = ov.display_frame(result.rows, summary=result.stats_basis)
event = st.dataframe(
    style_severity(shown.drop(columns=["rid"])), key="ops_table", on_select="rerun", selection_mode="single-row",
    hide_index=True, width="stretch", height=page.table_height(len(shown)),
)
left, right = st.columns([3, 1])
left.caption(f"{result.total} record(s) match; page {result.filter.page + 1} of {result.pages}.")
if st.session_state.get("f_page", 1) > result.pages:  # the filter shrank the table
    st.session_state["f_page"] = result.pages
right.number_input("Page", min_value=1, max_value=result.pages, step=1, key="f_page")
page.to_url("page", int(st.session_state["f_page"]), 1)
picked = page.selected_row(shown, event)
if picked is not None:
    page.navigate("detail", session=info["name"], run=run["name"], op=int(picked["rid"]))

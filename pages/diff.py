import pandas as pd
import streamlit as st

from precision_lab.ui import diff as dv
from precision_lab.ui import page
from precision_lab.ui.common import code_md, run_label, style_severity, text_columns
from precision_lab.ui.overview import session_runs

store, acc = page.start("diff")
info = page.choose_session(store, acc)
st.title("Diff")
if info is None:
    st.info(page.no_session_text(acc))
    st.stop()
sid = info["session_id"]
st.write(
    "Reference statistics, candidate statistics and the metrics between them, op by op in execution order. "
    "Records without a counterpart are listed as unmatched, never as passing. With several runs (for "
    "example after fixes), compare them all at once against the base run."
)
runs = session_runs(store, sid)
for card in dv.rerun_cards(store, sid):
    with st.container(border=True):
        st.markdown(f"**{page.plain(card['run'])}**: {page.plain(card['parent'])} re-run with "
                    f"{code_md(card['fix'])}")
        c = st.columns(3)
        c[0].metric("forward records with NaN/Inf", card["nonfinite_after"],
                    delta=card["nonfinite_after"] - card["nonfinite_before"], delta_color="inverse",
                    help=f"Records of the forward pass holding NaN/Inf (the Runs table's nonfinite_records counts "
                         f"the backward pass's too). Before: {card['nonfinite_before']} in {card['parent']}.")
        value, delta, why = dv.sqnr_card(card)
        c[1].metric("output SQNR vs fp32 (dB)", value, delta=delta, help=why)
        c[2].metric("first non-finite op", page.plain(card["first_after"] or "none"),
                    help=f"before: {card['first_before'] or 'none'}")
# the view lives in the URL (?view=&pair=&show=&q=&page=), so a copied link opens the same rows
MODES = ("pair", "runs")
page.from_url("diff_mode", "view", page.parse_choice(MODES), "pair")
page.from_url("diff_pattern", "q", str, "")
page.from_url("diff_show", "show", page.parse_choice(dv.SHOW_OPTIONS), "all")
page.from_url("diff_page", "page", page.parse_page, 1)
mode = st.radio("View", list(MODES), horizontal=True, key="diff_mode",
                format_func=lambda m: {"pair": "Reference vs candidate", "runs": "All runs side by side"}[m])
c = st.columns([3, 1])
pattern = c[0].text_input("Name contains (or glob with * ?)", key="diff_pattern")
show = c[1].selectbox("Show", list(dv.SHOW_OPTIONS), key="diff_show")
page.to_url("view", mode, "pair")
page.to_url("q", pattern, "")
page.to_url("show", show, "all")
page_size = 50
current = int(st.session_state.get("diff_page", 1))

if mode == "pair":
    pairs = dv.pair_options(store, sid)
    if not pairs:
        st.info("This session has no reference/candidate comparison. Ingest a dump together with its fp32 "
                "reference to get one.")
        st.stop()
    labels = [p["label"] for p in pairs]
    page.from_url("diff_pair", "pair", page.parse_choice(labels), labels[0])
    label = st.selectbox("Pair", labels, key="diff_pair")
    page.to_url("pair", label, labels[0])
    pair = pairs[labels.index(label)]
    with page.guard("The diff could not be queried"):
        result = dv.diff_page(store, sid, pair["ref_run_id"], pair["cand_run_id"], show=show, pattern=pattern,
                              page=current - 1, page_size=page_size)
    df = result.rows
    shown = df.drop(columns=["ref_rid", "cand_rid", "ref_nonfinite", "cand_nonfinite"])
    event = st.dataframe(style_severity(text_columns(shown, digits=4)), key="diff_table", hide_index=True, width="stretch",
                         height=page.table_height(len(shown)), on_select="rerun",
                         selection_mode="single-row")
    row = page.selected_row(df, event)
    if row is not None:
        names = {r["run_id"]: r["name"] for r in runs}
        if not pd.isna(row["cand_rid"]):
            page.navigate("detail", session=info["name"], run=names[pair["cand_run_id"]], op=int(row["cand_rid"]))
        else:
            page.navigate("detail", session=info["name"], run=names[pair["ref_run_id"]], op=int(row["ref_rid"]))
    with st.expander("Match summary"):
        st.dataframe(dv.unmatched_counts(store, sid), hide_index=True, key="match_summary")
else:
    if len(runs) < 2:
        st.info("This session holds a single run; N-run mode needs at least two.")
        st.stop()
    base_default = dv.base_run(store, sid)
    by_id = {r["run_id"]: r for r in runs}
    ids = list(by_id)
    base_id = st.selectbox("Base run", ids, index=ids.index(base_default["run_id"]), key="diff_base",
                           format_func=lambda i: run_label(by_id[i]))
    others = st.multiselect("Runs to compare", [i for i in ids if i != base_id],
                            default=[i for i in ids if i != base_id], key="diff_runs",
                            format_func=lambda i: run_label(by_id[i]))
    if not others:
        st.info("Choose at least one run to compare with the base run.")
        st.stop()
    with page.guard("The N-run diff could not be queried"):
        result = dv.nrun_page(store, sid, others, base_run_id=base_id, show=show, pattern=pattern,
                              page=current - 1, page_size=page_size)
    st.dataframe(text_columns(result.rows.drop(columns=["rid"]), digits=4), key="nrun_table", hide_index=True, width="stretch",
                 height=page.table_height(len(result.rows)))

left, right = st.columns([3, 1])
left.caption(f"{result.total} row(s); page {result.page + 1} of {result.pages}.")
if st.session_state.get("diff_page", 1) > result.pages:
    st.session_state["diff_page"] = result.pages
right.number_input("Page", min_value=1, max_value=result.pages, step=1, key="diff_page")
page.to_url("page", int(st.session_state["diff_page"]), 1)

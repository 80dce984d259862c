import pandas as pd
import streamlit as st

from precision_lab.ui import diff as dv
from precision_lab.ui import page
from precision_lab.ui.common import code_md, run_label, style_severity, text_columns
from precision_lab.ui.common import escape_md as plain

store, acc, info = page.require_session("diff")
sid = info.session_id
st.write(
    "Reference statistics, candidate statistics and the metrics between them, op by op in execution order. "
    "Records without a counterpart are listed as unmatched, never as passing. With several runs (for "
    "example after fixes), compare them all at once against the base run."
)
runs = dv.runs_by_id(store, sid).by_id
for card in dv.rerun_cards(store, sid):
    with st.container(border=True):
        st.markdown(f"**{plain(card.run)}**: {plain(card.parent)} re-run with "
                    f"{code_md(card.fix)}")
        c = st.columns(3)
        c[0].metric("forward records with unexpected NaN/Inf", card.nonfinite_after,
                    delta=card.nonfinite_after - card.nonfinite_before, delta_color="inverse",
                    help=f"Records of the forward pass holding NaN/Inf in a run where they reach the output, a "
                         f"gradient or a parameter; a run whose NaN/Inf are all intended (masks) counts 0 (the "
                         f"Runs table's nonfinite_records counts every one, the backward pass's too). Before: "
                         f"{card.nonfinite_before} in {plain(card.parent)}.")
        value, delta, why = dv.sqnr_card(card)
        c[1].metric("output SQNR vs fp32 (dB)", value, delta=delta, help=why)
        c[2].metric("first non-finite op", plain(card.first_after or "none"),
                    help=f"before: {plain(card.first_before or 'none')}")
# the view lives in the URL (?view=&pair=&show=&q=&page=; each widget's key is its parameter), so a copied link
# opens the same rows
# (a bound widget's URL value is the option as shown, so the options are the URL's words and the captions say them)
MODES = {"pair": "reference vs candidate", "runs": "all runs side by side",
         "data": "any two runs, paired by their data"}
mode = st.radio("View", list(MODES), captions=list(MODES.values()), horizontal=True, key="view", bind="query-params")
c = st.columns([3, 1])
pattern = c[0].text_input("Name contains (or glob with * ?)", key="q", bind="query-params")
show = c[1].selectbox("Show", list(dv.SHOW_CHOICES), key="show", bind="query-params")
page_size = 50
current = page.bound_value("page", int, 1)  # the pager is drawn below the table it pages

if mode == "pair":
    choices = dv.pair_choices(store, sid)
    pairs, matched = choices.by_label, choices.matched
    if not pairs:
        st.info("This session has no reference/candidate comparison. Ingest a dump together with its fp32 "
                "reference to get one.")
        st.stop()
    label = st.selectbox("Pair", list(pairs), key="pair", bind="query-params")
    pair = pairs[label]
    with page.guard("The diff could not be queried"):
        result = dv.diff_page(store, sid, pair.ref_run_id, pair.cand_run_id, show=show, pattern=pattern,
                              page=max(0, current - 1), page_size=page_size)
    df = result.rows
    shown = df.drop(columns=["ref_rid", "cand_rid", "ref_nonfinite", "cand_nonfinite"])
    event = st.dataframe(style_severity(text_columns(shown, digits=4)), key="diff_table", hide_index=True, width="stretch",
                         height=page.table_height(len(shown)), on_select="rerun",
                         selection_mode="single-row")
    row = page.selected_row(df, event)
    if row is not None:
        if not pd.isna(row["cand_rid"]):
            page.navigate("op_detail", session=info.name, run=runs[pair.cand_run_id].name,
                          op=int(row["cand_rid"]))
        else:
            page.navigate("op_detail", session=info.name, run=runs[pair.ref_run_id].name,
                          op=int(row["ref_rid"]))
    with st.expander("Match summary"):
        st.dataframe(matched, hide_index=True, key="match_summary")
elif mode == "data":
    ids = list(runs)
    other_sid = sid
    if acc.can_list:  # the candidate may come from any session the visitor may list (a shared link sees its own)
        table = page.cached_sessions_table(store)
        names = dict(zip(table["session_id"], table["session"]))
        other_sid = st.selectbox("Candidate from session", list(names), index=list(names).index(sid),
                                 key="data_session", format_func=names.get)
    cand_runs = runs if other_sid == sid else dv.runs_by_id(store, other_sid).by_id
    cand_ids = list(cand_runs)
    if len(ids) < 2 and other_sid == sid:
        st.info("This session holds a single run; pairing by data needs two: choose a candidate from another "
                "session." if acc.can_list else "This session holds a single run; pairing by data needs two.")
        st.stop()
    if not cand_ids:
        st.info("That session holds no run.")
        st.stop()
    c = st.columns(2)
    ref_id = c[0].selectbox("Reference run", ids, index=0, key="data_ref", format_func=lambda i: run_label(runs[i]))
    cand_id = c[1].selectbox("Candidate run", cand_ids, index=1 if other_sid == sid else 0, key="data_cand",
                             format_func=lambda i: run_label(cand_runs[i]))
    with page.guard("The two runs could not be paired"):
        got = dv.data_diff(store, ref_id, cand_id)
    (st.error if got.diverged else st.success)(plain(got.sentence))
    st.dataframe(text_columns(got.rows, digits=4), key="data_table", hide_index=True, width="stretch",
                 height=page.table_height(len(got.rows)))
    with st.expander(f"Unpaired calls ({len(got.unpaired)})"):
        st.dataframe(got.unpaired, hide_index=True, key="data_unpaired")
    st.stop()
else:
    if len(runs) < 2:
        st.info("This session holds a single run; N-run mode needs at least two.")
        st.stop()
    ids = list(runs)
    base_id = st.selectbox("Base run", ids, index=ids.index(dv.base_run_id(store, sid)), key="diff_base",
                           format_func=lambda i: run_label(runs[i]))
    others = st.multiselect("Runs to compare", [i for i in ids if i != base_id],
                            default=[i for i in ids if i != base_id], key="diff_runs",
                            format_func=lambda i: run_label(runs[i]))
    if not others:
        st.info("Choose at least one run to compare with the base run.")
        st.stop()
    with page.guard("The N-run diff could not be queried"):
        result = dv.nrun_page(store, sid, others, base_run_id=base_id, show=show, pattern=pattern,
                              page=max(0, current - 1), page_size=page_size)
    st.dataframe(text_columns(result.rows.drop(columns=["rid"]), digits=4), key="nrun_table", hide_index=True, width="stretch",
                 height=page.table_height(len(result.rows)))

left, right = st.columns([3, 1])
left.caption(f"{result.total} row(s); page {result.page + 1} of {result.pages}.")
if current != result.page + 1:  # a page past the end shows the last one (a filter shrank the table, an old link)
    st.session_state["page"] = result.page + 1
right.pagination(result.pages, key="page", bind="query-params")

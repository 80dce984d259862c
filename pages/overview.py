import streamlit as st

from precision_lab.services.jobs import (rerun_actions, rerun_blocker, running_jobs, start_grow, start_rerun,
                                        start_verify)
from precision_lab.services.cards import diagnosis_cards
from precision_lab.services.verify import untried, verification
from precision_lab.display import num_text
from precision_lab.origin import order_text
from precision_lab.services.origins import finite_text, producer_text
from precision_lab.services.report import norm_artefacts
from precision_lab.ui import diff as dv
from precision_lab.ui import overview as ov
from precision_lab.ui import page
from precision_lab.ui import timeline as tv
from precision_lab.ui.common import escape_md as plain
from precision_lab.ui.common import message_md

store, acc, info = page.require_session("overview", title=lambda info: f"Overview: {plain(info.name)}")
sid = info.session_id
view = page.session_views(store, sid)  # the session's view-models, cached until it changes

st.write(
    "Where the low-precision run first produced NaN/Inf, which ops carry the largest error against the "
    "reference (accumulated) or introduce it themselves (local), and what the diagnosis says."
)

st.subheader("Runs")
st.dataframe(view(ov.runs_table).drop(columns=["run_id"]).fillna({"parent": "", "fix": "", "order": ""}),
             hide_index=True, width="stretch", key="runs_table")

caveat = view(ov.order_caveat)
if caveat:
    st.warning(message_md(caveat), icon=":material/sort_by_alpha:")
warns = view(ov.warnings_table)
if len(warns):
    more = "+" if len(warns) >= ov.MAX_WARNINGS else ""
    with st.expander(f"{len(warns)}{more} warning(s) from reading or capturing this session"):
        st.dataframe(warns, hide_index=True, width="stretch", key="warnings_table")

for lr in view(ov.long_runs):
    with st.container(border=True):
        first = lr.first_nonfinite_step
        alerts = lr.alerts
        st.markdown(f"**{plain(lr.run)}**: a long run of {lr.steps} steps; "
                    + ("every step finite" if first is None else f":red[first non-finite value at step {first}]")
                    + f"; {len(alerts)} alert(s)"
                    + (f", the first at step {int(alerts['step'].min())}" if len(alerts) else ""))
        if len(alerts):
            st.dataframe(alerts.head(5), hide_index=True, width="stretch", key=f"alerts_{lr.run}")
        if st.button("Open the Timeline", key=f"timeline_{lr.run}", icon=":material/timeline:"):
            page.navigate("timeline", session=info.name, run=lr.run)

st.subheader("First non-finite producer")
firsts = view(ov.first_nonfinite_by_run)
for item in firsts:
    run, first, masks = item.run, item.first, item.intended
    quiet = (f"{len(masks)} op(s) wrote -inf that is no error by itself (a mask, a constant, or log(0)); not blamed: "
             + ", ".join(plain(m.op) for m in masks[:5]) + (", ..." if len(masks) > 5 else "")) if masks else ""
    if first is None:
        st.success(f"{plain(run.name)}: {plain(finite_text(masks))}.")
        if quiet:
            st.caption(quiet)
        continue
    with st.container(border=True):
        what = "value" if first.origin == "parameter" else "producer"
        st.markdown(f":red[**{plain(run.name)}**] first non-finite {what}: **{plain(producer_text(first))}** "
                    f"({plain(first.role)} {plain(first.index)}, {first.where})")
        st.caption(message_md(first.reason))
        st.caption(("" if first.certainty == "certain" else ":orange[**likely**] ") + plain(first.certainty_text))
        if first.first_nan:
            st.caption(f"The first NaN is made later, at {plain(first.first_nan.op)} "
                       f"(seq {first.first_nan.seq}), from that inf.")
        if quiet:
            st.caption(quiet)
        if item.ranks:  # a distributed run: where the other ranks' NaN/Inf came from
            st.markdown(f"Rank {first.rank} made it; the other ranks:")
            st.dataframe([{"rank": r.rank, "how": r.state, "first non-finite": r.op or "—",
                           "step": r.step, "role": r.role or "—"} for r in item.ranks],
                         hide_index=True, width="stretch", key=f"ranks_{run.run_id}")
        st.markdown(f"Path of ops leading to it ({order_text(first.order)}):")
        st.dataframe(
            [{"seq": p.seq, "op": p.op, "type": p.op_type,
              "NaN/Inf in inputs": p.nonfinite_in, "NaN/Inf in outputs": p.nonfinite_out}
             for p in first.path],
            hide_index=True, width="stretch", key=f"path_{run.run_id}",
        )
        if st.button("Open this op", key=f"open_first_{run.run_id}", icon=":material/bar_chart:"):
            page.navigate("op_detail", session=info.name, run=run.name, op=first.rid)

tree = ov.model_tree(store, firsts)
if tree is not None and len(tree.nodes) > 1:
    run, nodes = tree.run, tree.nodes
    with st.expander(f"The model as a tree: {plain(run.name)}", expanded=False):
        st.caption("Each module coloured by its worst headroom in bits below the run's format's max, the path "
                   "to the first non-finite producer outlined in red; click a module to zoom into it.")
        st.plotly_chart(tv.tree_figure(nodes), key="ov_tree", width="stretch")
        mods = tv.tree_modules(nodes)
        c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
        pick = c1.selectbox("Module", mods.options, format_func=mods.label, key="ov_module")
        if c2.button("Open on Op detail", key="ov_open_module", icon=":material/bar_chart:"):
            link = ov.module_link(store, run, pick)
            if link is not None:
                page.navigate("op_detail", session=info.name, run=link.run, op=link.op)

artefacts = view(norm_artefacts)
if artefacts:
    with st.expander(f"{len(artefacts)} norm artefact(s): Norm/Mean non-finite while the values are finite"):
        st.dataframe([{"run": a.run, "op": a.op, "tensor": f"{a.role} {a.index}",
                       "Max": num_text(a.max), "Min": num_text(a.min), "Norm": num_text(a.l2norm),
                       "why": a.reason}
                      for a in artefacts], hide_index=True, width="stretch", key="artefacts")


def _offenders(local: bool, key: str, empty: str) -> None:
    table = view(ov.offenders_table, local=local, n=10)
    if table.empty:
        st.caption(empty)
        return
    ev = st.dataframe(table.drop(columns=["rid"]), hide_index=True,
                      width="stretch", key=key, on_select="rerun", selection_mode="single-row")
    row = page.selected_row(table, ev)
    if row is not None:
        page.navigate("op_detail", session=info.name, run=row["run"], op=int(row["rid"]))


st.subheader("Top offenders")
st.caption("What a diagnosis names first, then the largest finite errors, worst verdict first (an error carried "
           "on ranks where it first appears); select a row to open the op.")
tab_acc, tab_loc = st.tabs(["Accumulated (vs reference)", "Local (op re-run in fp32)"])
with tab_acc:
    _offenders(False, "top_accumulated", "No comparison with a reference in this session.")
with tab_loc:
    _offenders(True, "top_local",
               "No local comparisons: they come from live captures, which re-run each op in fp32.")

st.subheader("Diagnosis")
cards = view(diagnosis_cards)
if not cards:
    st.caption("No diagnosis recorded for this session.")
# which fixes were tried is a view of the session (cached); whether the model can be re-run is the server's
blocked, offers = (rerun_actions(store, info.name, cards, made=view(verification)) if acc.can_rerun
                   else (None, [[] for _ in cards]))
to_verify = view(untried) if acc.can_rerun and not blocked and cards else []
if to_verify:
    if st.button(f"Verify the suggestions ({len(to_verify)} re-runs)", key="verify_fixes",
                 icon=":material/fact_check:",
                 help="Re-run the first suggested fixes not tried yet; each card then says which of them leave "
                      "the run finite, and its output SQNR against fp32."):
        st.session_state["_pl_verify"] = start_verify(store, info.name)
        st.rerun()
if acc.can_rerun and not blocked and any(f.first is not None for f in firsts) \
        and st.session_state.get("_pl_rerun") is None \
        and not view(verification).any_works() \
        and rerun_blocker(store, info.name) is None:  # no card with fixes asked: a dump or a capture, no model
    if st.button("Grow an fp32 island", key="grow_island", icon=":material/account_tree:",
                 help="Keep modules in fp32 from the first non-finite producer along the data flow until the run is "
                      "finite and meets the recipe's tolerance, then drop those not needed; every try is stored "
                      "as a re-run and the page opens the island's run."):
        st.session_state["_pl_rerun"] = start_grow(store, info.name)
        st.rerun()
_verifying = [j for j in st.session_state.get("_pl_verify", []) if j.session == info.name]
if _verifying and all(j.finished for j in _verifying):
    st.session_state.pop("_pl_verify")
    for j in _verifying:
        if j.error:
            st.error(f"Verifying {plain(j.fix)} failed: {message_md(j.error)}")
elif _verifying:
    @st.fragment(run_every=1.0)
    def _verify_progress():
        jobs = st.session_state.get("_pl_verify", [])
        if not jobs or all(j.finished for j in jobs):
            st.rerun()
        done = sum(j.finished for j in jobs)
        st.progress(done / len(jobs), text=f"Verifying {len(jobs)} suggested fixes: {done} done")

    _verify_progress()
for i, card in enumerate(cards):
    with st.container(border=True, key=f"card_{i}"):
        icon = {"error": ":red[**error**]", "warn": ":orange[**warning**]"}.get(card.severity, "**note**")
        st.markdown(f"{icon} · {plain(card.run or '')} · **{plain(card.op)}** "
                    f"· rule {plain(card.rule)}")
        st.markdown(message_md(card.message))
        if card.fixes:
            st.markdown("Proposed fixes: " + ", ".join(plain(f) for f in card.fixes))
            if blocked and card.rule != "fix-verified":
                st.caption("No re-run button: " + message_md(blocked))
        for j, action in enumerate(offers[i]):
            if action.running is not None:  # started here or in another tab: its progress, not a second one
                st.button(plain(action.label[:200]), key=f"rerun_{i}_{j}", icon=":material/hourglass_top:",
                          disabled=True, help="a re-run with this fix is in progress; the page updates when it ends")
            elif action.existing:  # already made from this run: open it, do not make a copy
                icon = ":material/check_circle:" if action.works else ":material/cancel:"
                if st.button(plain(action.label), key=f"rerun_{i}_{j}", icon=icon,
                             help=f"this fix was already run from this run: {plain(action.reason)}"):
                    page.navigate("diff", session=info.name, view="runs")
            elif st.button(plain(action.label), key=f"rerun_{i}_{j}", icon=":material/replay:",
                           help=plain(action.reason)):
                st.session_state["_pl_rerun"] = start_rerun(store, info.name, action.fix,
                                                            parent=action.parent)
                st.rerun()

_job = st.session_state.get("_pl_rerun")
# re-runs of this session started from another tab (or by another user of this server)
_elsewhere = [j for j in running_jobs(store, info.name) if j is not _job]
if _job is not None and _job.session == info.name and _job.finished:
    st.session_state.pop("_pl_rerun")
    if _job.error:
        st.error(f"The re-run with {plain(_job.fix)} failed: {message_md(_job.error)}")
    else:  # every run of the session side by side, the new one included, at the op the fix was for
        page.navigate("diff", session=info.name, view="runs", q=dv.landing_op(store, _job.run_id))
elif _job is not None and _job.session == info.name:
    @st.fragment(run_every=1.0)
    def _rerun_progress():
        job = st.session_state.get("_pl_rerun")
        if job is None or job.finished:
            st.rerun()
        st.progress(job.fraction, text=plain(f"Re-running with {job.fix}: {job.status}"[:200]))

    _rerun_progress()
if _elsewhere:
    @st.fragment(run_every=1.0)
    def _elsewhere_progress():
        jobs = [j for j in running_jobs(store, info.name) if j is not st.session_state.get("_pl_rerun")]
        if not jobs:
            st.rerun()  # they ended: the cards show their runs
        for j in jobs:
            st.progress(j.fraction, text=plain(f"Re-running with {j.fix} (started in another tab): {j.status}"[:200]))

    _elsewhere_progress()

st.subheader("Error along the run")
c1, c2 = st.columns([2, 1])
metrics = list(ov.ERROR_METRIC_LABELS)
# a statistics-only session has no element-wise error: it opens on its summaries' relative error
metric = c1.radio("Metric", metrics, horizontal=True, key="err_metric",
                  index=metrics.index(view(ov.default_error_metric)),
                  format_func=ov.ERROR_METRIC_LABELS.get)
outputs_only = c2.toggle("Outputs only", value=True, key="err_outputs")
series, note = view(ov.error_along_run, metric, outputs_only=outputs_only)
if series.empty:
    st.caption("No comparisons to plot: add an fp32 reference to see where the runs diverge.")
else:
    if note:
        st.caption(note)
    fig = ov.error_figure(series, metric, first_nonfinite=[f.first for f in firsts])
    ev = st.plotly_chart(fig, key="err_plot", on_select="rerun", selection_mode="points", width="stretch")
    pts = (ev or {}).get("selection", {}).get("points", []) if isinstance(ev, dict) else \
        (ev.selection.points if ev is not None else [])
    if pts and pts[0].get("customdata"):
        cd = pts[0]["customdata"]
        runs = {f.run.run_id: f.run.name for f in firsts}
        page.navigate("op_detail", session=info.name, run=runs.get(cd[2], cd[2]), op=int(cd[3]))
    if series.attrs.get("bucket", 1) > 1:
        st.caption(f"{series.attrs['bucket']} consecutive records per point (worst kept).")


st.subheader("Share")
st.caption("Export the whole session as one file another Precision Lab imports, download a static HTML page "
           "that opens offline (for an issue tracker), or make a read-only link to this server.")
_file = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in info.name).strip("-") or "session"
c_zip, c_html = st.columns(2)
with c_zip:
    from precision_lab.services.share import export_bytes

    # callables run only when clicked (in their own thread, with their own cursor)
    st.download_button("Export session (.zip)",
                       data=page.while_allowed(lambda: export_bytes(store, info.name)), file_name=f"{_file}.zip", mime="application/zip", key="export_zip", on_click="ignore",
                       icon=":material/download:")
with c_html:
    from precision_lab.ui.html_report import render_html

    st.download_button("HTML report", data=page.while_allowed(lambda: render_html(store, info.name, public=True)),
                       file_name=f"{_file}.html", mime="text/html", key="export_html", on_click="ignore",
                       icon=":material/description:")
if not acc.read_only:
    from precision_lab.services.share import create_share_token, share_url

    if st.button("Create a read-only share link", key="share_link", icon=":material/link:",
                 help="Anyone with the link sees this session, read-only; a new link replaces the old one."):
        links = st.session_state.setdefault("_pl_share_urls", {})
        links[info.name] = share_url(st.context.url or "/", create_share_token(store, info.name))
    link = st.session_state.get("_pl_share_urls", {}).get(info.name)
    if link:
        st.code(link, language=None)

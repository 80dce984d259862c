import streamlit as st

from precision_lab.formats import FORMAT_NAMES
from precision_lab.services import timeline as svc
from precision_lab.ui import page
from precision_lab.ui import timeline as tv

store, acc, info = page.require_session("timeline")
by_name = tv.long_runs_by_name(store, info.session_id)
if not by_name.runs:
    st.info("This session has no timeline. Record a training run over many steps with "
            "`precision_lab.capture(model, options=CaptureOptions(every=50, keep_last=4))` and call "
            "`cap.step(loss=loss)` after each step: every step is summarised, every 50th recorded in full, and "
            "the last 4 steps before a NaN/Inf are kept.")
    st.stop()
name = page.url_select("Run", by_name.names, param="run", key="tl_run", format_func=by_name.label)
run = by_name.run(name)
fmt = st.sidebar.selectbox("Format", list(FORMAT_NAMES), index=list(FORMAT_NAMES).index(svc.run_format(run).name),
                           key="tfmt", bind="query-params", help="The format headroom and underflow are measured against.")

with page.guard("This run's timeline could not be loaded"):
    headline = tv.run_steps(store, run.run_id)
    first, alerts, steps = headline.first_nonfinite_step, headline.alerts, headline.steps

c1, c2, c3 = st.columns(3)
c1.metric("Steps", run.steps)
c2.metric("First non-finite step", "none" if first is None else first)
early = [a for a in alerts if first is None or a.step < first]
c3.metric("Alerts", len(alerts), help="Alerts before the first non-finite step: "
          f"{len(early)}" + (f", the first at step {min(a.step for a in early)}" if early else ""))

with page.guard("The ranks could not be drawn"):
    by_rank = tv.ranks_figure(store, run.run_id, first)
if by_rank is not None:  # a distributed run: which rank went non-finite at which step
    st.subheader("Ranks × steps", anchor=False)
    st.plotly_chart(by_rank, key="tl_ranks", width="stretch")

st.subheader("Alerts", anchor=False)
if alerts:
    st.dataframe(tv.alerts_frame(alerts), hide_index=True, width="stretch", key="tl_alerts",
                 height=page.table_height(len(alerts)))
else:
    st.caption("No alert fired on this run.")
with st.expander("Alert rules"):
    st.dataframe(tv.rules_frame(), hide_index=True, width="stretch")

st.subheader("Ops over steps", anchor=False)
metric = st.radio("Colour", list(tv.METRICS), format_func=tv.METRICS.get, horizontal=True, key="tl_metric")
with page.guard("The heatmap could not be drawn"):
    hm = svc.heatmap(store, run.run_id, metric=metric, fmt=fmt)
    if not hm.cells:
        st.caption("No summarised op in this run.")
    else:
        ev = st.plotly_chart(tv.heatmap_figure(hm, metric=metric, fmt=fmt, first_nonfinite=first, alerts=alerts),
                             key="tl_heatmap", on_select="rerun", selection_mode="points", width="stretch")
        st.caption("Click a cell to open that op at that step on Op detail (the nearest step with full records).")
        pts = ev.selection.points if ev is not None else []
        target = tv.cell_target(pts[0], hm.ops) if pts else None
        if target is not None:
            rec = svc.record_at(store, run.run_id, *target)
            if rec is None:
                st.warning(f"{target[0]} has no full records in this run.")
            else:
                page.navigate("op_detail", session=info.name, run=run.name, op=rec.rid)

    labels = [tv.series_label(o.op, o.role, o.index) for o in hm.ops]
    chosen = st.multiselect("Ops to plot", labels, default=tv.default_ops(hm, alerts), key="tl_ops")
    if chosen:
        series = tv.op_series_by_label(store, run.run_id, chosen, hm.ops, fmt)
        st.plotly_chart(tv.series_figure(series, fmt=fmt, first_nonfinite=first, alerts=alerts),
                        key="tl_series", width="stretch")

st.subheader("The model as a tree", anchor=False)
st.caption("Each module coloured by its worst headroom below the format's max over the run; the path from the "
           "model to the first op that went non-finite is outlined in red. Click a module to zoom into it.")
with page.guard("The tree could not be drawn"):
    nodes = svc.module_tree(store, run.run_id, fmt=fmt)
    st.plotly_chart(tv.tree_figure(nodes), key="tl_tree", width="stretch")
    mods = tv.tree_modules(nodes)
    if mods:
        c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
        pick = c1.selectbox("Module", mods.options, format_func=mods.label, key="tl_module")
        if c2.button("Open on Op detail", key="tl_open_module", icon=":material/bar_chart:"):
            rec = svc.record_at(store, run.run_id, pick, first if first is not None else run.last_step)
            if rec is None:
                st.warning(f"{pick} has no full records in this run.")
            else:
                page.navigate("op_detail", session=info.name, run=run.name, op=rec.rid)

st.subheader("Loss and gradient norm", anchor=False)
if any(r.loss is not None or r.grad_norm is not None for r in steps):
    st.plotly_chart(tv.step_figure(steps, first), key="tl_steps_plot", width="stretch")
else:
    st.caption("No loss or gradient recorded: pass `loss=` to `cap.step()` and run backward inside the capture.")
with st.expander("Steps"):
    st.dataframe(tv.steps_frame(steps), hide_index=True, width="stretch", key="tl_steps")

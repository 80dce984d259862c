import streamlit as st

from precision_lab.services.report import norm_artefacts
from precision_lab.ui import detail as dv
from precision_lab.ui import page
from precision_lab.ui.common import escape_md as plain
from precision_lab.ui.common import message_md, text_columns
from precision_lab.ui.overview import first_nonfinite_by_run

store, acc, info = page.require_session("op_detail")
run = page.choose_run(store, info.session_id)
if run is None:
    st.info("This session holds no runs.")
    st.stop()

# the op picker: a step (when the run has several), a name filter, then the matching records of that step (the
# current one among them when it is of that step); opened without an op, it lands on the first non-finite producer
first = next((f.first for f in first_nonfinite_by_run(store, info.session_id)
              if f.run.run_id == run.run_id and f.first), None)
page.scoped("op", "pick_op", run.run_id)  # a record number chosen in another run is no op of this one
current = page.peek("op", "pick_op")
current_rid = int(current) if current is not None and str(current).isdigit() else None
asked = page.linked("op") if page.page_key("pick_op") not in st.session_state else None
if asked is not None and dv.record_named(store, run.run_id, asked) is None:
    page.not_found(f"Run {run.name} has no op {asked}; open one from the Ops page.")
current_rec = dv.record_named(store, run.run_id, current_rid) if current_rid is not None else None
first_rec = dv.record_named(store, run.run_id, first.rid) if first else None
steps = dv.step_choices(store, run.run_id)
step = None
if steps:
    landing = current_rec or first_rec
    if asked is not None and current_rec is not None and page.linked("step") is None:
        st.session_state[page.page_key("pick_step")] = current_rec.step  # a link to an op opens its step
    step = page.url_select("Step", steps, param="step", key="pick_step",
                           default=landing.step if landing else steps[0])
    if current_rec is not None and current_rec.step != step:
        current_rid = None  # another step was chosen: pick among its ops
landing_rid = first_rec.rid if first_rec and (step is None or first_rec.step == step) else None
find = st.sidebar.text_input("Find op by name", key="op_find", placeholder="e.g. fc1 or *linear*output*")
choices = dv.op_choices(store, run.run_id, find, step=step,
                        include_rid=current_rid if current_rid is not None else landing_rid, steps=bool(steps))
if not choices:
    st.info("No record of this run matches the name filter.")
    st.stop()
rid = page.url_select("Op", choices.options, param="op", key="pick_op", default=landing_rid,
                      format_func=choices.label)

with page.guard("This op could not be loaded"):
    rec, stats, others = dv.op_record(store, run.run_id, rid)

st.subheader(plain(rec.name), anchor=False)  # a dump's name, shown as typed
flag = " · :red[**contains NaN/Inf**]" if rec.nonfinite else ""
st.markdown(f"run **{plain(run.name)}** · {plain(rec.op_type)} · {plain(rec.direction)} · "
            f"seq {rec.seq} · step {rec.step} · rank {rec.rank} · {plain(rec.dtype)} "
            f"{plain(list(rec.stats.shape))}{flag}")
if rec.location:
    st.caption(f"Called from {plain(rec.location)}")
st.write(
    "Magnitudes of the values on a log2 scale against the limits of the chosen number formats; the table "
    "counts exactly how many values would overflow, become subnormal or round to zero in each."
)

series = [(f"{run.name} (this)", stats)]
for o in others[:3]:
    with page.guard(f"The {o.side} record could not be loaded"):
        series.append((f"{o.run} ({o.side})", dv.load_stats(store, o.run_id, o.rid)))
if others:
    st.caption("Compared with: " + "; ".join(f"{plain(o.run)} ({o.side}, {o.match} match): "
                                              f"{plain(o.name or '-')}" for o in others))

formats = page.choose_formats(dv.default_formats(rec.dtype))

art = next((a for a in norm_artefacts(store, info.session_id)
            if a.run_id == run.run_id and a.rid == rid), None)
if art:
    st.info(message_md(art.reason))

with_hist = [(label, s) for label, s in series if s is not None and s.hist is not None]
if with_hist:
    log_y = st.toggle("Log count axis", value=True, key="hist_log")
    st.plotly_chart(dv.histogram_figure(with_hist, formats, log_y=log_y), key="hist_plot", width="stretch")
    hidden = [f"{plain(label)}: {dv.not_drawn(s)}" for label, s in with_hist if dv.not_drawn(s)]
    if hidden:
        st.caption("Not on the log axis (counted in the tables): " + "; ".join(hidden))
    st.markdown("**Exact counts per format** (round-to-nearest-even, from the stored histogram)")
    cols = st.columns(len(with_hist))
    for i, (col, (label, s)) in enumerate(zip(cols, with_hist)):
        with col:
            st.caption(plain(label))
            table = dv.representability_table(s, formats)
            st.dataframe(table, hide_index=True, width="stretch", key=f"repr_{i}",
                         column_config={c: st.column_config.NumberColumn(format="%.4f")
                                        for c in table.columns if c.endswith("%")})

summary_only = [(label, s) for label, s in series if s is not None and s.hist is None]
if summary_only:
    st.markdown("**Summary statistics against the format limits** (these records carry Max/Min/Mean/Norm only, "
                "no histogram)")
    st.plotly_chart(dv.summary_figure(series, formats), key="summary_plot", width="stretch")
if formats:
    st.markdown("**Headroom**: bits between the largest magnitude and each format's max (negative: it overflows)")
    st.dataframe(text_columns(dv.headroom_tables(series, formats), ("max finite", "absmax", "headroom (bits)",
                                                                    "min |x| > 0", "footroom (bits)"), 4),
                 hide_index=True, width="stretch", key="headroom")
    if summary_only:
        with st.expander("Where each summary statistic lands in each format"):
            for i, (label, s) in enumerate(series):
                st.caption(plain(label))
                st.dataframe(dv.summary_values_table(s, formats), hide_index=True, width="stretch",
                             key=f"vals_{i}")

if stats.hist is not None:
    with st.expander("What if this tensor were stored in each format?", expanded=rec.dtype == "float32"):
        what_if = dv.what_if_table(stats)
        st.dataframe(text_columns(what_if, ("max finite", "smallest normal")), hide_index=True, width="stretch",
                     key="what_if", column_config={c: st.column_config.NumberColumn(format="%.4f")
                                                   for c in what_if.columns if c.endswith("%")})

st.markdown("**Comparison metrics**")
metrics = dv.metrics_table(store, run.run_id, rid)
if metrics.empty:
    st.caption("This record was not compared with another run.")
else:
    st.dataframe(metrics, width="stretch", key="metrics")

st.markdown("**Statistics** (float64)")
st.dataframe(dv.stats_table(series), width="stretch", key="stats")

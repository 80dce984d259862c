import streamlit as st

from precision_lab.ui import page
from precision_lab.ui.common import escape_md as plain
from precision_lab.ui.sessions import IngestFailed, ingest_upload, open_sample
from precision_lab.services.diagnose import check_sessions
from precision_lab.services.samples import list_samples
from precision_lab.services.upload import upload_key

store, acc = page.start("sessions")
cfg = page.get_config()

st.title("Precision Lab")
st.write(
    "Find where a model's numbers go wrong in fp16, bf16 or fp8, and why. Upload a dump folder "
    "(msprobe, .npy/.pt/.safetensors folders, or Precision Lab captures) with an optional fp32 "
    "reference of the same model, or open a sample, then follow the first non-finite op."
)

if acc.shared:
    page.navigate("overview", session=acc.session)

flash = st.session_state.pop("_pl_import_message", None)
if flash:  # set by the import below, shown after the rerun that lists the new session
    st.success(plain(flash))

table = page.cached_sessions_table(store) if acc.can_list else None
if table is not None and table.empty:
    st.info("No sessions yet. Upload a dump folder (or a .zip of one) below, optionally with its fp32 "
            "reference, or open a sample in one click." if acc.can_upload else page.no_session_text(acc))


def _uploader(label: str, key: str):
    kind = st.segmented_control(f"{label} as", ["folder", ".zip"], default="folder", key=f"{key}_kind",
                                label_visibility="collapsed")
    if kind == ".zip":
        return st.file_uploader(f"{label} (.zip)", type=["zip"], key=f"{key}_zip",
                                max_upload_size=cfg.max_upload_mb)
    return st.file_uploader(f"{label} (folder)", accept_multiple_files="directory", key=f"{key}_dir",
                            max_upload_size=cfg.max_upload_mb)


def _as_list(x):
    if x is None:
        return []
    return list(x) if isinstance(x, list) else [x]


if table is not None and not table.empty:
    st.subheader("Sessions")
    cut = list(table.loc[~table["diagnosed"], "session"])
    if cut:
        st.warning(f"{len(cut)} session(s) were stored without their diagnoses (a write stopped before it finished): "
                   f"{plain(', '.join(cut[:5]))}{', ...' if len(cut) > 5 else ''}. Their findings are incomplete "
                   "until they are diagnosed (`precision-lab check` does the same).")
        if acc.can_upload and st.button("Diagnose them now", key="check_sessions"):
            with page.guard("Diagnosis failed"):
                done = check_sessions(store)
                st.session_state["_pl_import_message"] = "; ".join(f"{name}: {what}" for name, what in done)
            st.rerun()
    st.caption("Select a row to open its overview.")
    event = st.dataframe(
        table.drop(columns=["session_id"]), key="sessions_table", on_select="rerun", selection_mode="single-row",
        hide_index=True, width="stretch",
    )
    picked = page.selected_row(table, event)
    if picked is not None:
        page.navigate("overview", session=picked["session"])

    if acc.can_delete:
        with st.expander("Rename or delete a session"):
            target = st.selectbox("Session", list(table["session"]), key="manage_session")
            new = st.text_input("New name", key="rename_to")
            if st.button("Rename", key="rename", disabled=not new.strip()):
                with page.guard("Rename failed"):
                    store.rename_session(target, new)
                st.rerun()
            if st.button("Delete…", key="delete"):
                st.session_state["_pl_confirm_delete"] = target
            pending = st.session_state.get("_pl_confirm_delete")
            if pending:
                st.warning(f"Delete session {plain(pending)} with all its runs, records and comparisons? "
                           "This cannot be undone.")
                yes, no = st.columns(2)
                if yes.button("Yes, delete", key="delete_yes", type="primary"):
                    with page.guard("Delete failed"):
                        store.delete_session(pending)
                    st.session_state.pop("_pl_confirm_delete", None)
                    st.rerun()
                if no.button("Cancel", key="delete_no"):
                    st.session_state.pop("_pl_confirm_delete", None)
                    st.rerun()

if acc.can_upload:
    st.subheader("New session")
    left, right = st.columns(2)
    with left:
        st.markdown("**Dump to analyse** (fp16 / bf16 / fp8 run)")
        cand = _as_list(_uploader("Dump", "up_cand"))
    with right:
        st.markdown("**fp32 reference** (optional, same model and inputs)")
        ref = _as_list(_uploader("Reference", "up_ref"))
    name = st.text_input("Session name (optional)", key="new_session_name",
                         placeholder="default: <dump>-vs-<reference>")
    if st.button("Ingest", type="primary", key="ingest", disabled=not cand):
        key = (upload_key(cand), upload_key(ref), name)
        done = st.session_state.setdefault("_pl_ingested", {})
        if key in done:  # the uploader hands back the same files on every rerun
            page.navigate("overview", session=done[key])
        bar = st.progress(0.0, text="reading the dump")
        try:
            session = ingest_upload(store, cand, ref, session=name or None, progress=page.progress_callback(bar),
                                    max_depth=cfg.max_path_depth, zip_limits=cfg.zip_limits(), config=cfg)
        except IngestFailed as e:
            bar.empty()
            page.show_error(e, "The upload could not be ingested")
        else:
            done[key] = session
            page.navigate("overview", session=session)

    st.subheader("Import a shared session")
    st.caption("A .zip made by Export (Overview page) or `precision-lab export` on another Precision Lab. An "
               "existing session is never replaced: a name already taken gets a suffix.")
    shared_zip = st.file_uploader("Exported session (.zip)", type=["zip"], key="import_zip",
                                  max_upload_size=cfg.max_upload_mb)
    if st.button("Import", key="import_session", disabled=shared_zip is None):
        from precision_lab.services.share import ShareError, import_session

        try:
            imported = import_session(store, shared_zip.getvalue(), filename=shared_zip.name, config=cfg)
        except ShareError as e:
            page.show_error(e, "The file could not be imported")
        except Exception as e:  # one sentence naming the file, whatever failed
            from precision_lab.readers import first_line

            page.show_error(ValueError(f"{shared_zip.name}: {first_line(e)}"), "The file could not be imported")
        else:
            st.session_state["_pl_import_message"] = imported.message
            st.rerun()

    samples = list_samples()
    if samples:
        st.subheader("Samples")
        st.caption("Real dumps shipped with Precision Lab; opening one ingests it once, then reuses the session.")
        cols = st.columns(min(3, len(samples)))
        for i, sample in enumerate(samples):
            with cols[i % len(cols)]:
                if st.button(f"Open sample: {sample.name}", key=f"sample_{sample.name}", help=sample.label,
                             width="stretch"):
                    bar = st.progress(0.0, text=f"ingesting {sample.name}")
                    with page.guard(f"Sample {sample.name} could not be opened"):
                        session = open_sample(store, sample, progress=page.progress_callback(bar))
                    page.navigate("overview", session=session)
elif acc.read_only and table is None:
    st.info(page.no_session_text(acc))


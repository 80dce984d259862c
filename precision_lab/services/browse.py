"""What the dashboard and the CLI show: the read use cases over a session.

The view-models in ``precision_lab.ui`` and the CLI commands call these; the
questions themselves are answered in ``precision_lab.store`` (all SQL lives
there).
"""

from __future__ import annotations

from ..store.dashboard import (ACCUMULATED_KINDS, ERROR_METRICS, LOCAL_KINDS, PROBLEM_SEVERITIES, SHOW_OPTIONS,
                               SORTABLE, DiffPage, OpsFilter, OpsPage, all_runs, base_run, comparison_bases,
                               counterparts, diagnosis_cards, diff_page, error_series, filter_options, find_records,
                               has_record, nrun_page, ops_page, pair_options, record, record_comparisons, runs_table,
                               session_exists, session_warnings, top_offenders, unmatched_counts)
from ..store.queries import (count_records, last_accumulated_output, run_diagnoses, run_row, session_data_version,
                             session_list, session_runs)
from ..store.timeline import full_steps

__all__ = ["ACCUMULATED_KINDS", "ERROR_METRICS", "LOCAL_KINDS", "PROBLEM_SEVERITIES", "SHOW_OPTIONS", "SORTABLE",
           "DiffPage", "OpsFilter", "OpsPage", "all_runs", "base_run", "comparison_bases", "counterparts",
           "diagnosis_cards", "diff_page", "error_series", "filter_options", "find_records", "full_steps", "has_record",
           "nrun_page", "ops_page", "pair_options", "record", "record_comparisons", "runs_table", "session_exists", "session_list",
           "session_runs", "session_warnings", "count_records", "last_accumulated_output",
           "run_diagnoses", "run_row", "session_data_version", "top_offenders", "unmatched_counts"]

"""A diagnosis rule added from outside the package, the way a plug-in adds one: ``register_rule`` (and
``register_fact`` for a fact the built-in ones do not give), or the ``precision_lab.rules`` entry point group."""

from __future__ import annotations

from pathlib import Path

import pytest

from precision_lab.fixes.facts import FACTS, register_fact
from precision_lab.fixes.rulebook import EXPLAINED, FINITE, RULES, UNEXPLAINED, finding, register_rule, rules_of
from precision_lab.records import Diagnosis

from plugin_kit import doc_examples, install

SAMPLE = Path(__file__).resolve().parents[1] / "sample_dumps" / "fp16-layernorm"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    store = Store(tmp_path_factory.mktemp("plugins") / "p.duckdb")
    with store.held():  # the file opened once for the reads of the ingest, not once per read
        session = ingest([SAMPLE], store=store)
    yield store, session
    close_all()


@pytest.fixture
def added():
    """Names registered by a test, taken out again after it."""
    rules_before, facts_before = set(RULES.names()), set(FACTS.names())
    yield
    for name in set(RULES.names()) - rules_before:
        RULES.unregister(name)
    for name in set(FACTS.names()) - facts_before:
        FACTS.unregister(name)


def _diagnose(store, session):
    from precision_lab.services.diagnose import diagnose

    return diagnose(store, session)


def _tensor_count(store, run_id: str) -> int:
    return int(store.df("SELECT count(*) AS n FROM tensors WHERE run_id = ?", [run_id])["n"].iloc[0])


def test_a_run_rule_with_a_new_fact_shows_up_in_the_diagnosis(lab, added):
    store, session = lab

    @register_fact("records_held")
    def records_held(store, run_id):
        return _tensor_count(store, run_id)

    @register_rule("record-count", kind="run", needs=("records_held",), names_op=False,
                   when=(FINITE, EXPLAINED, UNEXPLAINED))
    def record_count(ctx, run, origin):
        n = ctx.facts.records_held(run.run_id)
        return [Diagnosis("", run.run_id, "", "record-count", f"{n} records", (), "error", -1)]

    found = _diagnose(store, session)
    cand = next(r for r in store.runs(store.session(session).session_id).to_dict("records")
                if r["kind"] == "candidate")
    mine = [d for d in found if d.rule == "record-count"]
    # counted here by a query of its own; a rule that names no op reports at info, whatever it wrote
    assert [(d.run_id, d.message, d.severity) for d in mine] == \
        [(cand["run_id"], f"{_tensor_count(store, cand['run_id'])} records", "info")]
    # the op rule's finding stays first, the run rules' come after it
    assert found[0].rule == "norm-statistics" and found[-1].rule == "record-count"
    assert "record-count" in [r.name for r in rules_of("run")] and "record-count" not in [r.name for r in
                                                                                        rules_of("op")]


def test_an_op_rule_ranked_ahead_of_a_built_in_one_writes_the_diagnosis(lab, added):
    store, session = lab
    before = _diagnose(store, session)
    assert [d.rule for d in before if d.severity == "error"] == ["norm-statistics"]

    @register_rule("layer-norm-seen", before="norm-statistics")
    def layer_norm_seen(ctx, ev):
        if ev.module_facts.get("class") != "LayerNorm" and "norm" not in (ev.op_type or "").lower():
            return None
        return finding(ev, "layer-norm-seen", f"`{ev.where}` is a normalisation in {ev.fmt.name}", ["stats-fp32"])

    names = RULES.names()
    assert names.index("layer-norm-seen") == names.index("norm-statistics") - 1
    got = [d for d in _diagnose(store, session) if d.severity == "error"]
    # the op rule's sentence, then what the diagnosis adds to every producer's: where the first NaN appears
    assert [(d.rule, d.op, d.message.split(". ")[0], d.fixes) for d in got] == \
        [("layer-norm-seen", before[0].op, f"`{before[0].op}` is a normalisation in fp16", ("stats-fp32",))]
    added_after = before[0].message[before[0].message.index(". That value is inf; "):]
    assert got[0].message == f"`{before[0].op}` is a normalisation in fp16" + added_after
    RULES.unregister("layer-norm-seen")
    assert _diagnose(store, session) == before


def test_a_rule_whose_fact_nobody_answers_is_not_tried(lab, added):
    store, session = lab
    before = _diagnose(store, session)
    tried = []

    @register_rule("needs-the-moon", kind="run", needs=("moon_phase",), when=(FINITE, EXPLAINED, UNEXPLAINED))
    def needs_the_moon(ctx, run, origin):
        tried.append(run.run_id)
        return []

    assert _diagnose(store, session) == before and tried == []


def test_a_rule_that_names_an_op_may_not_report_info(lab, added):
    store, session = lab

    @register_rule("mislabelled", kind="run", when=(EXPLAINED,))
    def mislabelled(ctx, run, origin):
        return [Diagnosis("", run.run_id, origin.op, "mislabelled", "x", (), "info", origin.seq)]

    with pytest.raises(ValueError, match="names_op=False"):
        _diagnose(store, session)


def test_a_rule_from_an_entry_point_is_registered_on_first_read(tmp_path, monkeypatch, added):
    # the entry point names the module: importing it registers its rules
    install(tmp_path, monkeypatch, {"pl_rule_plugin.py": "from precision_lab.fixes.rules import register_rule\n"
                                                         "@register_rule('from-entry-point', kind='run')\n"
                                                         "def found(ctx, run, origin):\n"
                                                         "    return []\n"},
            {"precision_lab.rules": ["mine = pl_rule_plugin"]}, (RULES,))
    assert "from-entry-point" in RULES.names()
    assert RULES["from-entry-point"].kind == "run" and RULES.names()[-1] == "from-entry-point"


def test_every_built_in_rule_declares_facts_the_store_answers():
    from precision_lab.services.diagnose import StoreFacts

    facts = StoreFacts(store=None)
    for rule in RULES.values():
        assert rule.answered(facts), rule.name
    assert [r.name for r in rules_of("run") if not r.names_op] == ["fix-verified", "compiled"]


def test_the_worked_example_in_the_architecture_notes_registers_as_it_says(lab, added, tmp_path, monkeypatch):
    import importlib

    from precision_lab.services.diagnose import StoreFacts

    store, session = lab
    blocks = doc_examples("Adding a rule")
    assert list(blocks) == ["my_rules.py", "my_facts.py"]
    install(tmp_path, monkeypatch, blocks, {})
    for name in blocks:
        importlib.import_module(name[:-3])
    rule = RULES["large-local-error"]
    names = RULES.names()
    assert rule.kind == "run" and rule.needs == ("worst_local_errors",) and rule.when == (FINITE,)
    assert names.index("large-local-error") == names.index("precision-loss") - 1
    sid = store.session(session).session_id
    with store.extend_session(session) as w:
        w.add_warning("dump.json", "step 3: a tensor file is missing")
    assert StoreFacts(store).reader_warnings(sid) == ["step 3: a tensor file is missing"]

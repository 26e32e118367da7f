"""The plan message's one schema (dymem_tf/cc/pass/plan_schema.h) and the shared op sets (dymem_tf/cc/op_sets.h), as
the Python side reads them (the native side is tested with the graph pass: tests/test_graph_pass.py)."""
import pytest

from dymem_tf import op_sets
from dymem_tf.passes import plan_message


def test_the_schema_gives_a_version_and_every_record_its_fields():
    schema = plan_message.schema()
    assert schema.version >= 2
    assert schema.records["out"] == ("producer", "port", "swap_out")
    assert schema.records["seqadded"] == ("chain",)
    assert {"out", "in", "ctrl", "var", "vin", "vkeep", "vout", "vread", "clone", "reroute", "seq",
            "seqadded"} == set(schema.records)


def test_a_record_has_exactly_the_schemas_fields():
    assert plan_message.record("ctrl", "a", "b") == "ctrl\ta\tb"
    assert plan_message.record("in", "x/out", "x/in", "", "") == "in\tx/out\tx/in\t\t"  # empty fields stay
    with pytest.raises(ValueError, match="has 2 fields \\(from, to\\), not 3"):
        plan_message.record("ctrl", "a", "b", "c")
    with pytest.raises(ValueError, match="no record kind 'bogus'"):
        plan_message.record("bogus", "a")
    with pytest.raises(ValueError, match="tab or a newline"):
        plan_message.record("ctrl", "a\tb", "c")


def test_a_message_starts_with_its_version_line():
    text = plan_message.message([plan_message.record("ctrl", "a", "b")])
    assert text == f"dymem-plan\t{plan_message.schema().version}\nctrl\ta\tb\n"
    assert plan_message.records_of(text) == [["ctrl", "a", "b"]]


def test_the_op_sets_come_from_their_one_definition():
    from dymem_tf.passes import graph_capture, step_pass
    from dymem_tf.planning import offload

    sets = op_sets.op_sets()
    assert sets["kStepInputTypes"][0] == "IteratorGetNext" and "ResourceApply" in sets["kVariableUpdatePrefixes"]
    assert step_pass.INPUT_OP_TYPES == op_sets.STEP_INPUT_TYPES | {"IteratorGetNextAsOptional"}
    assert graph_capture.is_gradient_name("model/gradient_tape/dense/MatMul")
    assert set(op_sets.VARIABLE_UPDATE_PREFIXES) < set(offload.VARIABLE_USER_PREFIXES)

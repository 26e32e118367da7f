"""The plan message's one schema (dymem_tf/cc/pass/plan_schema.h) and the shared op sets (dymem_tf/cc/op_sets.h), as
the Python side reads them (the native side is tested with the graph pass: tests/test_graph_pass.py)."""
import keyword
import re

import pytest

from dymem_tf import op_sets
from dymem_tf.passes import plan_message


def test_the_schema_gives_a_version_and_every_record_its_fields():
    schema = plan_message.schema()
    assert schema.version >= 4
    assert schema.records["out"] == ("producer", "port", "swap_out", "keep_rows")
    assert schema.records["ctrl"] == ("src", "dst")
    assert schema.records["seqadded"] == ("chain",)
    assert {"out", "in", "ctrl", "var", "vin", "vkeep", "vout", "vread", "clone", "reroute", "seq",
            "seqadded"} == set(schema.records)


def test_a_record_is_written_by_field_name_in_the_schemas_order():
    assert plan_message.record("ctrl", dst="b", src="a") == "ctrl\ta\tb"
    assert plan_message.record("out", swap_out="x/o", port=1, producer="x", keep_rows=2) == "out\tx\t1\tx/o\t2"
    empty = plan_message.record("in", swap_out="x/out", swap_in="x/in", trigger="", consumers="")
    assert empty == "in\tx/out\tx/in\t\t"  # empty fields stay


@pytest.mark.parametrize("kind, fields, fragment", [
    ("ctrl", {"src": "a", "dst": "b", "via": "c"}, "a 'ctrl' record has no field 'via' (its fields: src, dst)"),
    ("ctrl", {"src": "a"}, "a 'ctrl' record needs the field 'dst' (its fields: src, dst)"),
    ("out", {"producer": "x", "port": 0, "swap_in": "x/o"}, "no field 'swap_in'"),  # a misnamed field
    ("bogus", {"a": "b"}, "no record kind 'bogus'"),
    ("ctrl", {"src": "a\tb", "dst": "c"}, "the field 'src' of a 'ctrl' record holds a tab or a newline"),
    ("ctrl", {"src": "a", "dst": "c\n"}, "the field 'dst' of a 'ctrl' record holds a tab or a newline"),
])
def test_a_record_refuses_fields_the_schema_does_not_give_its_kind(kind, fields, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        plan_message.record(kind, **fields)


def test_a_message_starts_with_its_header_naming_each_kinds_columns():
    schema = plan_message.schema()
    text = plan_message.message([plan_message.record("ctrl", src="a", dst="b")])
    head, *rest = text.splitlines()
    assert head.split("\t")[:2] == ["dymem-plan", str(schema.version)]
    assert head.split("\t")[2:] == [f"{kind}:{','.join(names)}" for kind, names in schema.records.items()]
    assert "ctrl:src,dst" in head.split("\t") and rest == ["ctrl\ta\tb"]
    assert plan_message.records_of(text) == [["ctrl", "a", "b"]]


def test_every_field_name_can_be_a_keyword_argument():
    """record() takes the fields as keywords: a schema field called ``from`` could not be passed."""
    for kind, names in plan_message.schema().records.items():
        assert all(n.isidentifier() and not keyword.iskeyword(n) for n in names), kind
        assert len(set(names)) == len(names), kind


def test_the_op_sets_come_from_their_one_definition():
    from dymem_tf.passes import graph_capture, step_pass
    from dymem_tf.planning import offload

    sets = op_sets.op_sets()
    assert sets["kStepInputTypes"][0] == "IteratorGetNext" and "ResourceApply" in sets["kVariableUpdatePrefixes"]
    assert step_pass.INPUT_OP_TYPES == op_sets.STEP_INPUT_TYPES | {"IteratorGetNextAsOptional"}
    assert graph_capture.is_gradient_name("model/gradient_tape/dense/MatMul")
    assert set(op_sets.VARIABLE_UPDATE_PREFIXES) < set(offload.VARIABLE_USER_PREFIXES)

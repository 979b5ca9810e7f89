"""CPU: the bookkeeping of the TE-suite comparison (recipe of a test id, JUnit outcomes)."""

from test_gpu_te_suites import outcomes, recipe_of


def test_recipe_of_te_test_ids():
    assert recipe_of("TestGroupedLinearOp::test_grouped_linear[False-fp8_delayed_scaling-dtype0-True]") == \
        "fp8_delayed_scaling"
    assert recipe_of("TestGroupedLinearOp::test_grouped_linear[None-dtype1]") == "none"
    assert recipe_of("TestX::test_y[mxfp8-True]") == "mxfp8"
    assert recipe_of("TestX::test_general[fp8_current_scaling]") == "fp8_current_scaling"


def test_outcomes_read_junit(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="m.C" name="a"/>'
        '<testcase classname="m.C" name="b"><failure message="x"/></testcase>'
        '<testcase classname="m.C" name="c"><skipped message="y"/></testcase>'
        '<testcase classname="m.C" name="d"><error message="z"/></testcase>'
        '</testsuite></testsuites>')
    assert outcomes(xml) == {"m.C::a": "passed", "m.C::b": "failed", "m.C::c": "skipped", "m.C::d": "failed"}

"""The heavy, self-contained tests marked ``beside`` run in a pytest process of their own, a
background job beside the session's (conftest ``BESIDE``): here their outcome is checked, test
by test, from that process's junit report. Run alone (or with only some files), the marked
tests run in this process instead and this test checks that nothing was moved."""

import xml.etree.ElementTree as ET

import pytest
from conftest import BESIDE


@pytest.mark.slow
@pytest.mark.late
def test_the_tests_marked_beside_pass_in_a_process_of_their_own(tests_beside):
  moved, code, report, tail = tests_beside
  assert moved == BESIDE
  if not moved:
    assert code is None
    return
  cases = ET.parse(report).getroot().iter("testcase")
  outcome = {}
  for case in cases:
    name = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
    failed = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
    outcome[name] = failed[0] if failed else "passed"
  assert code == 0 and outcome == dict.fromkeys(moved, "passed"), tail

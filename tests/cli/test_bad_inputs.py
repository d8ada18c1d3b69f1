"""The catalogue of bad inputs (`tandem.tools.bad_inputs`): every case ends in a named refusal or is valid,
and `docs/bad-inputs.md` is the table the catalogue writes now."""

from pathlib import Path

import pytest

from tandem.tools import bad_inputs

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"


@pytest.fixture(scope="module")
def outcomes():
    return [bad_inputs.run_case(case) for case in bad_inputs.catalogue()]


def test_every_bad_input_gets_a_named_refusal_and_valid_input_passes(outcomes):
    assert len(outcomes) >= 200
    defects = [f"{o.case.area}: {o.case.what}: {o.result}: {o.message}" for o in outcomes if not o.ok]
    assert defects == []
    for o in outcomes:
        if o.result == "refused":
            assert o.message, o.case.what  # a refusal says something


def _rows(text: str) -> list[tuple[str, str, str]]:
    """(area, input, outcome class) of each table row; the messages' wording may vary with the Python version."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) >= 4 and cells[0].lstrip("| ").isdigit():
            rows.append((cells[1], cells[2], cells[3].split(":")[0]))
    return rows


def test_the_committed_table_lists_the_catalogue_and_its_outcomes(outcomes):
    expected = _rows(bad_inputs.markdown(outcomes))
    assert len(expected) == len(outcomes)
    assert _rows(DOC.read_text()) == expected, (
        "regenerate: python -m tandem.tools.bad_inputs --out docs/bad-inputs.md"
    )


def test_a_defect_is_reported_as_one():
    def crash():
        raise KeyError("boom")

    outcome = bad_inputs.run_case(bad_inputs.Case("api", "crash", crash))
    assert outcome.result == "defect" and not outcome.ok
    silent = bad_inputs.run_case(bad_inputs.Case("api", "silently accepted", lambda: None))
    assert silent.result == "accepted" and not silent.ok

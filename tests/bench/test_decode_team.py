"""bench.decode's team scenario: the question sequences as team.json writes them."""

from __future__ import annotations

import json

from bench.common import qa_documents
from bench.decode_team import TEAM_FILE, team_sequences


def test_every_sequence_is_five_first_three_paraphrased_two_repeated() -> None:
    names = list(json.loads(TEAM_FILE.read_text())["documents"])
    sequences = team_sequences(qa_documents(names))
    assert sorted(sequences) == sorted(names)
    for name, seq in sequences.items():
        kinds = [q.kind for q in seq]
        assert len(seq) == 10 and kinds.count("first") == 5, name
        assert kinds.count("paraphrase") == 3 and kinds.count("repeat") == 2, name
        for i, q in enumerate(seq):
            if q.kind == "first":
                assert q.of is None
                continue
            assert q.of is not None and q.of < i and seq[q.of].kind == "first"
            assert (q.text == seq[q.of].text) == (q.kind == "repeat")  # a repeat word for word, a paraphrase not
        assert len({q.text for q in seq if q.kind == "first"}) == 5

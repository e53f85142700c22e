"""The broken-config corpus through the reader: one field wrong each, refused naming that field."""

from __future__ import annotations

import json

import pytest
from m3_config_layouts import CORPUS, broken_config

from sglang_m3.config import M3ConfigError, M3TextSpec


def test_corpus_is_large_and_names_are_unique():
    assert len(CORPUS) >= 20
    assert len({entry.name for entry in CORPUS}) == len(CORPUS)


def test_unbroken_shipped_layout_gives_the_checkpoint_spec(shipped_top, tiny_spec):
    assert M3TextSpec.from_config(shipped_top) == tiny_spec


@pytest.mark.parametrize("entry", CORPUS, ids=[entry.name for entry in CORPUS])
def test_broken_config_is_refused_naming_its_field(entry, shipped_top):
    with pytest.raises(M3ConfigError) as refused:
        M3TextSpec.from_config(broken_config(shipped_top, entry))
    for expected in entry.expected:
        assert expected in str(refused.value), f"{entry.name}: {refused.value}"


@pytest.mark.parametrize("entry", CORPUS, ids=[entry.name for entry in CORPUS])
def test_broken_config_json_is_refused_from_its_directory(entry, shipped_top, tmp_path):
    """The same configs as files: the reader takes the directory's config.json, not the object."""
    (tmp_path / "config.json").write_text(json.dumps(broken_config(shipped_top, entry)))
    with pytest.raises(M3ConfigError, match=entry.expected[0].replace(".", r"\.")):
        M3TextSpec.from_config(None, str(tmp_path))

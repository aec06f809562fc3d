"""``benchmarks.vllm_pd --kvservice KEY=VALUE``: the settings both kvservice engines get."""

from __future__ import annotations

import pytest

from benchmarks.vllm_pd import _setting, _variable


def test_a_value_is_json_and_a_bare_word_a_string() -> None:
    assert _setting("poll_interval_s=0.0001") == ("poll_interval_s", 0.0001)
    assert _setting("host=10.0.0.5") == ("host", "10.0.0.5")
    assert _setting("max_posts_per_tick=4") == ("max_posts_per_tick", 4)


@pytest.mark.parametrize("text", ["poll_interval_s", "=0.1", "1poll=0.1", "poll interval=0.1"])
def test_what_is_not_key_equals_value_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        _setting(text)


def test_an_engine_variable_is_name_equals_text() -> None:
    assert _variable("OMP_WAIT_POLICY=PASSIVE") == ("OMP_WAIT_POLICY", "PASSIVE")
    assert _variable("GOMP_SPINCOUNT=0") == ("GOMP_SPINCOUNT", "0")  # text, not JSON
    assert _variable("EMPTY=") == ("EMPTY", "")


@pytest.mark.parametrize("text", ["OMP_WAIT_POLICY", "=PASSIVE", "1X=2", "A B=1"])
def test_what_is_not_name_equals_value_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        _variable(text)


@pytest.mark.parametrize(("setting", "message"), [
    ("prot=7100", "kv_connector_extra_config.kvservice.prot: unknown key; did you mean port?"),
    ("poll_interval_s=0", "kv_connector_extra_config.kvservice.poll_interval_s: must be a positive number, got 0"),
])
def test_a_setting_the_engines_would_refuse_is_refused_before_any_starts(
        setting: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.vllm_pd import main

    with pytest.raises(SystemExit) as exit_:  # no phase selected: nothing would start past the check either
        main(["--kvservice", setting, "--phases", "no such phase"])
    assert exit_.value.code == 2
    assert f"--kvservice: {message}" in capsys.readouterr().err


def test_a_configuration_misspelt_is_refused_naming_the_ones_there_are(capsys: pytest.CaptureFixture[str]) -> None:
    """``--configs`` once ran what it recognised and dropped the rest without a word."""
    from benchmarks.vllm_pd import main

    with pytest.raises(SystemExit) as exit_:  # refused before the model is made or an engine starts
        main(["--configs", "kvservice,nixl-quite"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--configs: no configuration nixl-quite (of kvservice, kvservice-lw, nixl, nixl-quiet)" in err

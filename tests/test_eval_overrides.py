"""studies/eval_overrides.py: rotkv eval with CacheSpec fields it has no flag for."""

import pytest

from rotkv.eval import methods
from rotkv_testing import load_benchmark


def test_parse_and_refuse_a_field_the_cache_would_not_tell_apart(monkeypatch):
    tool = load_benchmark("eval_overrides", "studies")
    assert tool.parse("refine_salient=2,refine_values=false,window_share=0.5") == {
        "refine_salient": 2, "refine_values": False, "window_share": 0.5}
    with pytest.raises(SystemExit, match="clip_k"):
        tool.main(["clip_k=0.9", "--", "--out", "x"])
    assert tool.main(["refine_salient=2"]) == 2  # no "--": the usage
    seen = {}

    def fake_cli(argv):
        seen["argv"] = argv
        seen["method"] = methods.cached_method("oscar-refine", None, None)
        seen["peer"] = methods.cached_method("hf-quanto-int4", None, None)
        return 0

    monkeypatch.setattr("rotkv.cli.main", fake_cli)
    monkeypatch.setattr(methods, "cached_method", methods.cached_method)  # restored after the test
    assert tool.main(["refine_salient=2", "--", "--out", "x"]) == 0
    assert seen["argv"] == ["eval", "--out", "x"]
    assert seen["method"].overrides == {"refine_salient": 2} and seen["peer"].overrides == {}

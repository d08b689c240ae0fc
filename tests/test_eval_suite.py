"""The multi-domain evaluation suite: its texts (sources, splits, no shared text with calibration), the
stratified and paired intervals of its summary, the CLI's checks, and a tiny end-to-end run on SmolLM2."""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os

import pytest

from rotkv.calibrate.corpus import default_files
from rotkv.eval.suite import SPLITS, SUITES, sources, suite_texts, summarize


def _lines(path: str, min_len: int) -> set[str]:
    with open(path, encoding="utf-8") as f:
        return {line.strip() for line in f if len(line.strip()) >= min_len}


# ---- the texts ------------------------------------------------------------------------------------------
def test_every_domain_has_a_dev_and_a_test_text_recorded_in_sources():
    src = sources()
    for name, domains in SUITES.items():
        assert len(domains) >= 4
        for split in SPLITS:
            texts = suite_texts(name, split)
            assert list(texts) == list(domains)
            for d, path in texts.items():
                info = src[f"suite/{d}_{split}.txt"]
                assert info["license"] and info["package"] and info["version"] and info["files"]
                with open(path, "rb") as f:
                    assert hashlib.sha256(f.read()).hexdigest() == info["sha256"], path


EXTRA = sorted(glob.glob(os.path.join(os.path.dirname(default_files("calib")[0]), "extra", "calib_*.txt")))


def test_extra_calibration_texts_are_recorded_in_sources_and_not_in_the_default_corpus():
    src = sources()
    assert len(EXTRA) == 3
    for path in EXTRA:
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == src["extra/" + os.path.basename(path)]["sha256"], path
    assert not set(EXTRA) & set(default_files("calib"))


def test_suite_texts_share_no_line_with_calibration_and_dev_none_with_test():
    calib = set().union(*[_lines(p, 40) for p in default_files("calib") + EXTRA])
    for name in SUITES:
        for split in SPLITS:
            for d, path in suite_texts(name, split).items():
                assert not _lines(path, 40) & calib, (d, split)
        dev, test = suite_texts(name, "dev"), suite_texts(name, "test")
        for d in SUITES[name]:
            # docutils' two parts repeat a few short link targets; no longer line is shared
            assert not _lines(dev[d], 80) & _lines(test[d], 80), d


def test_unknown_suite_or_split_is_named():
    with pytest.raises(ValueError, match="`suite`"):
        suite_texts("nope", "dev")
    with pytest.raises(ValueError, match="`split`"):
        suite_texts("mixed", "train")


# ---- the summary ----------------------------------------------------------------------------------------
def _rec(method, length, kls, bpe=3.0):
    nll = [1.0 + k for k in kls]
    return {"method": method, "task": "nll", "length": length, "variant": None, "depth": None, "n": 4 * len(kls),
            "windows": len(kls), "kl": sum(kls) / len(kls), "kl_ci95": 0.0, "nll": sum(nll) / len(nll), "ppl": 3.0,
            "top1": 0.9, "bpe_measured": bpe, "per_window": {"kl": kls, "nll": nll, "top1": [0.9] * len(kls)}}


def test_summary_mean_over_domains_and_its_stratified_and_paired_intervals():
    per = {"a": [_rec("int4", 2048, [0.01, 0.03]), _rec("m", 2048, [0.02, 0.05])],
           "b": [_rec("int4", 2048, [0.10, 0.10, 0.10]), _rec("m", 2048, [0.05, 0.08, 0.11])]}
    s = summarize(per)["lengths"][2048]
    m = s["methods"]["m"]
    # each domain weighs the same: (mean a + mean b) / 2
    assert m["kl"] == pytest.approx((0.035 + 0.08) / 2)
    var_a = ((0.02 - 0.035) ** 2 + (0.05 - 0.035) ** 2) / 1 / 2
    var_b = ((0.05 - 0.08) ** 2 + 0 + (0.11 - 0.08) ** 2) / 2 / 3
    assert m["kl_ci95"] == pytest.approx(1.96 * math.sqrt(var_a + var_b) / 2)
    p = s["paired"]["m vs int4"]
    # per-window differences: a: +0.01, +0.02; b: -0.05, -0.02, +0.01
    assert p["kl_diff"] == pytest.approx((0.015 + (-0.02)) / 2)
    dv_a = ((0.01 - 0.015) ** 2 + (0.02 - 0.015) ** 2) / 1 / 2
    dv_b = ((-0.05 + 0.02) ** 2 + 0 + (0.01 + 0.02) ** 2) / 2 / 3
    assert p["kl_diff_ci95"] == pytest.approx(1.96 * math.sqrt(dv_a + dv_b) / 2)
    assert p["kl_ratio"] == pytest.approx(m["kl"] / s["methods"]["int4"]["kl"])
    assert m["per_domain"]["b"]["kl"] == pytest.approx(0.08)


def test_summary_leaves_out_a_method_missing_in_a_domain():
    per = {"a": [_rec("int4", 2048, [0.01, 0.03]), _rec("m", 2048, [0.02, 0.05])], "b": [_rec("int4", 2048, [0.1, 0.1])]}
    s = summarize(per)["lengths"][2048]
    assert "m" not in s["methods"] and s["incomplete"] == ["m"] and not s["paired"]


def test_summary_refuses_pairs_on_different_windows():
    per = {"a": [_rec("int4", 2048, [0.01, 0.03]), _rec("m", 2048, [0.02, 0.05, 0.01])]}
    with pytest.raises(ValueError, match="different windows"):
        summarize(per)


# ---- the CLI --------------------------------------------------------------------------------------------
def _args(argv):
    from rotkv.cli.eval import register

    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    return ap.parse_args(["eval", "--out", "/tmp/unused-suite-out", *argv])


@pytest.mark.parametrize("argv, match", [
    (["--split", "test"], "--split picks a part of a --suite"),
    (["--suite", "nope"], "--suite has to be one of mixed"),
    (["--suite", "mixed", "--text", "x.txt"], "pass --suite or --text"),
    (["--suite", "mixed", "--tasks", "niah"], "nll task only"),
])
def test_suite_flags_are_checked_naming_the_flag(argv, match):
    from rotkv.cli.errors import UsageError
    from rotkv.cli.eval import _suite_defaults

    with pytest.raises(UsageError, match=match):
        _suite_defaults(_args(argv))


def test_suite_defaults_keep_the_windows_at_every_length():
    from rotkv.cli.eval import _suite_defaults
    from rotkv.eval.config import make_config
    from rotkv.eval.suite import domain_config

    args = _args(["--suite", "mixed"])
    _suite_defaults(args)
    assert (args.split, args.tasks, args.windows, args.new_tokens, args.sink, args.window) == \
        ("dev", "nll", 16, 128, "preset", "preset")
    cfg = domain_config(make_config("full", nll_windows=args.windows), suite_texts("mixed", "dev")["code"])
    assert cfg.windows_at(2048) == cfg.windows_at(8192) == 16
    assert make_config("full", nll_windows=16).windows_at(8192) == 4  # the plain eval still scales them


# ---- the real model -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_suite_run_end_to_end_and_report_only(tmp_path):
    from rotkv.eval.config import make_config
    from rotkv.eval.suite import evaluate_suite, rebuild_suite
    from rotkv.hf.models import load_model

    loaded = load_model(device="cpu")
    cfg = make_config("smoke", methods=["int4", "naive-int2"], tasks=["nll"], lengths={"nll": [160]},
                      nll_windows=2, new_tokens=4, chunk=64, sink=16, window=32)
    s = evaluate_suite(cfg, "mixed", "dev", str(tmp_path), loaded=loaded, log=lambda m: None)
    block = s["lengths"][160]
    assert set(block["methods"]) == {"plain-fp32", "int4", "naive-int2"}
    for d in SUITES["mixed"]:
        assert os.path.exists(os.path.join(tmp_path, d, "report.md"))
        assert block["methods"]["int4"]["per_domain"][d]["windows"] == 2
    i4, n2 = block["methods"]["int4"], block["methods"]["naive-int2"]
    assert i4["kl"] < n2["kl"] and block["paired"]["naive-int2 vs int4"]["kl_diff"] > 0
    text = open(os.path.join(tmp_path, "suite.md")).read()
    assert "naive-int2 vs int4" in text and "KL code" in text
    before = json.load(open(os.path.join(tmp_path, "suite.json")))
    os.remove(os.path.join(tmp_path, "suite.md"))
    again = rebuild_suite(cfg, "mixed", "dev", str(tmp_path))
    assert json.loads(json.dumps(again)) == before and os.path.exists(os.path.join(tmp_path, "suite.md"))


def test_suite_compare_pairs_two_folders_on_the_same_windows(tmp_path, capsys):
    from rotkv_testing import load_benchmark

    compare = load_benchmark("suite_compare", "studies")
    for run, kls in (("old", {"a": [0.02, 0.04], "b": [0.1, 0.2]}), ("new", {"a": [0.01, 0.03], "b": [0.1, 0.1]})):
        os.makedirs(tmp_path / run)
        json.dump({"domains": ["a", "b"], "split": "test"}, open(tmp_path / run / "suite.json", "w"))
        for d, ks in kls.items():
            os.makedirs(tmp_path / run / d)
            json.dump({"records": [_rec("oscar-mix", 2048, ks)]}, open(tmp_path / run / d / "results.json", "w"))
            json.dump({"config": {"texts": [f"/x/{d}_test.txt"], "nll_windows": 2, "new_tokens": 64, "chunk": 512}},
                      open(tmp_path / run / d / "config.json", "w"))
    assert compare.main([f"old={tmp_path / 'old'}:oscar-mix", f"new={tmp_path / 'new'}:oscar-mix"]) == 0
    out = capsys.readouterr().out
    # differences per window: a -0.01, -0.01; b 0, -0.1 -> mean over domains (-0.01 - 0.05) / 2; measured bits first
    assert "| new | 3.000 | 0.0200 | 0.1000 | 0.0600 | -0.0300 ± " in out and "domains lower" not in out
    json.dump({"config": {"texts": ["/x/b_test.txt"], "nll_windows": 3, "new_tokens": 64, "chunk": 512}},
              open(tmp_path / "new" / "b" / "config.json", "w"))
    with pytest.raises(SystemExit, match="other windows"):
        compare.main([f"old={tmp_path / 'old'}:oscar-mix", f"new={tmp_path / 'new'}:oscar-mix"])


def test_suite_compare_domains_interval_over_domains_with_one_window_each(tmp_path, capsys):
    from rotkv_testing import load_benchmark

    compare = load_benchmark("suite_compare", "studies")
    domains = ("prose", "code", "docs", "dialogue")
    for run, kls, bpe in (("old", [0.02, 0.03, 0.04, 0.05], 3.0), ("new", [0.01, 0.02, 0.03, 0.05], 2.9)):
        for d, k in zip(domains, kls):  # no suite.json: a run stopped early counts the domains it finished
            os.makedirs(tmp_path / run / d)
            json.dump({"records": [_rec("oscar-refine", 8192, [k], bpe)]}, open(tmp_path / run / d / "results.json", "w"))
            json.dump({"config": {"texts": [f"/x/{d}_dev.txt"], "nll_windows": 1, "new_tokens": 64, "chunk": 512}},
                      open(tmp_path / run / d / "config.json", "w"))
    args = ["--length", "8192", "--interval", "domains",
            f"old={tmp_path / 'old'}:oscar-refine", f"new={tmp_path / 'new'}:oscar-refine"]
    assert compare.main(args) == 0
    out = capsys.readouterr().out
    # differences -0.01, -0.01, -0.01, 0: mean -0.0075, sd 0.005, t(0.975, 3) = 3.182 -> 3.182 * 0.005 / 2 = 0.0080
    assert "| new | 2.900 | 0.0100 | 0.0200 | 0.0300 | 0.0500 | 0.0275 | -0.0075 ± 0.0080 | 3/4 | 0.79x |" in out
    assert "Suite split dev, 8192 tokens" in out
    # the default interval pairs over windows: with one window per domain it has no spread
    assert compare.main(["--length", "8192"] + args[4:]) == 0
    assert "| new | 2.900 | 0.0100 | 0.0200 | 0.0300 | 0.0500 | 0.0275 | -0.0075 ± 0.0000 | 0.79x |" in capsys.readouterr().out
    os.remove(tmp_path / "new" / "dialogue" / "results.json")
    with pytest.raises(SystemExit, match="other windows"):
        compare.main(args)

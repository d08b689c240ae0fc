"""The converted-model cache (rotkv.hf.models): an interrupted conversion leaves nothing behind, a stale partial
copy of a dead process is removed, and an unwritable cache folder is one RotkvWarning naming ROTKV_CACHE_DIR."""

import os

import pytest

from rotkv.config import RotkvWarning
from rotkv.hf import models
from rotkv_testing import char_tokenizer, make_tiny_llama


def _dead_pid() -> int:
    pid = 2**22 - 1
    while pid > 1:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
        pid -= 1
    pytest.skip("no free process id")


def test_ctrl_c_during_the_copy_leaves_no_partial_folder(tmp_path, monkeypatch):
    import safetensors.torch

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_model", interrupted)
    out = str(tmp_path / "models" / "tiny-0123")
    with pytest.raises(KeyboardInterrupt):
        models._save_converted(make_tiny_llama(), char_tokenizer(), out)
    assert os.listdir(tmp_path / "models") == []


def test_a_dead_process_partial_copy_is_removed_and_a_live_one_kept(tmp_path):
    root = tmp_path / "models"
    dead, live = root / f"other-1.tmp-{_dead_pid()}", root / f"other-2.tmp-{os.getppid()}"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"partial")
    out = str(root / "tiny-0123")
    models._save_converted(make_tiny_llama(), char_tokenizer(), out)
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    assert not dead.exists() and live.exists()


def test_an_unwritable_cache_folder_is_one_rotkv_warning(tmp_path):
    (tmp_path / "afile").write_text("x")
    out = str(tmp_path / "afile" / "models" / "tiny-0123")  # ROTKV_CACHE_DIR pointing at a file
    with pytest.warns(RotkvWarning, match="could not cache the converted model.*set ROTKV_CACHE_DIR to a writable folder"):
        models._save_converted(make_tiny_llama(), char_tokenizer(), out)


def test_a_file_that_is_not_a_model_is_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        models.resolve_model_path(str(tmp_path / "afile"))

"""How the command line reports failures, and the checks that run before a model is loaded.

- A user error (ValueError, FileNotFoundError, ...: a bad flag, file or artifact) is one line naming
  the flag or field, exit code 2.
- Any other failure is one line saying what failed, with a hint that ``--debug`` (or
  ``ROTKV_DEBUG=1``) shows the traceback, exit code 1.

Everything that can be checked without the model (flags, the preset, artifact files, prompt files,
output paths, the device) is checked first: the first load of a GGUF model converts it, which takes a while on a CPU.
"""

from __future__ import annotations

import os
import sys
import traceback

USER_ERRORS = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model")
DEBUG_HINT = "run with --debug (or ROTKV_DEBUG=1) for the traceback"


class UsageError(ValueError):
    """A bad command-line value; the message names the flag."""


def debug_requested(args=None) -> bool:
    from rotkv import switches

    return bool(getattr(args, "debug", False)) or switches.debug()


def one_line(e: BaseException) -> str:
    """The exception's message on one line (a KeyError's quotes and repeated whitespace removed)."""
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(str(msg).split()) or type(e).__name__


def report(command: str, e: BaseException, debug: bool) -> int:
    """Print ``e`` for ``rotkv <command>`` and return the exit code (2: user error, 1: anything else)."""
    if debug:
        traceback.print_exc()
    if isinstance(e, USER_ERRORS):
        print(f"rotkv {command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"rotkv {command}: failed: {type(e).__name__}: {one_line(e)} ({DEBUG_HINT})", file=sys.stderr)
    return 1


def warn(command: str, msg: str) -> None:
    print(f"rotkv {command}: warning: {msg}", file=sys.stderr, flush=True)


def note(command: str, msg: str) -> None:
    """A line of information (a default taken), not a problem."""
    print(f"rotkv {command}: note: {msg}", file=sys.stderr, flush=True)


def check_device(device: str | None, flag: str = "--device") -> None:
    """A device string torch understands and that exists here (``cuda`` without CUDA is refused)."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"{flag} has to be cpu, cuda or cuda:N but got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {device}: CUDA is not available on this machine; use {flag} cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise UsageError(f"{flag} has to be cpu, cuda or cuda:N but got {device!r}")


def resolve_device(device: str | None, flag: str = "--device") -> str | None:
    """``auto`` -> ``cuda`` when CUDA is available, else ``cpu``; any other value is checked
    (:func:`check_device`) and returned as given. Runs before the model loads."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        check_device(device, flag)
    except UsageError as e:
        raise UsageError(str(e).replace("cpu, cuda or cuda:N", "cpu, cuda, cuda:N or auto")) from None
    return device


def check_out_path(path: str, flag: str = "--out") -> None:
    """An output file that can be written: not a directory, no file where a parent folder must be,
    and the nearest existing parent folder writable. Folders that do not exist yet are created later."""
    if not path:
        raise UsageError(f"{flag} is empty")
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise UsageError(f"{flag} {path} is a directory; pass a file name")
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: the folder {parent} is not writable")


def check_out_dir(path: str, flag: str = "--out") -> None:
    """An output folder that can be written: not a file, and writable (or creatable: its nearest existing
    parent folder writable)."""
    if not path:
        raise UsageError(f"{flag} is empty")
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise UsageError(f"{flag} {path} is a file; pass a folder (it holds several output files)")
    if os.path.isdir(full):
        if not os.access(full, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: the folder is not writable")
        return
    check_out_path(path, flag)


def read_text_file(path: str, flag: str) -> str:
    """The UTF-8 text of ``path``; a missing file, a directory or undecodable bytes name ``flag``."""
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path}: no such file")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a directory, not a file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


def check_model(model: str | None) -> None:
    """The --model argument names a model that exists here (resolving it reads no weights)."""
    from rotkv.hf.models import resolve_model_path

    path, gguf, _ = resolve_model_path(model)
    if gguf is None:  # a Hugging Face model directory: its weights and tokenizer files are there too
        files = os.listdir(path)
        if not any(f.endswith((".safetensors", ".bin", ".pt", ".pth")) or f.endswith(".safetensors.index.json")
                   for f in files):
            raise UsageError(f"--model {path}: no weights in that folder (model*.safetensors or pytorch_model*.bin)")
        if not any(f in TOKENIZER_FILES for f in files):
            raise UsageError(f"--model {path}: no tokenizer in that folder (one of {', '.join(TOKENIZER_FILES)})")

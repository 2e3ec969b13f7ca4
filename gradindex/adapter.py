"""PEFT (LoRA) adapters: loading one onto its base model, finding its layers, hashing its weights.

A LoRA layer computes ``y = W x + s · B (A x)``; PEFT keeps ``A`` and ``B`` as plain ``nn.Linear``
modules (``...q_proj.lora_A.default``, ``...q_proj.lora_B.default``), so the linear capture rule
gives their per-example gradients exactly: ``lora_A`` sees ``x`` and ``s Bᵀ g``, ``lora_B`` sees
``A x`` and ``s g``. With an adapter loaded, those are the layers hooked by default; the base
layers (``...q_proj.base_layer``) can be chosen with layer patterns too.

The adapter is loaded into the base model in place (PEFT's injected model, not its wrapper), so
layer names are the base model's plus ``.lora_A.default``: an index captured in a Trainer on a
``PeftModel`` and a build from ``BASE --adapter DIR`` name the layers alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_LAYER = re.compile(r"\.lora_[AB]\.[^.]+$")
"""Qualified names of LoRA's ``A`` and ``B`` linears (one per adapter name)."""
NEEDS_PEFT = "loading a PEFT adapter needs the peft package: pip install 'gradindex[peft]'"


def is_adapter_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | os.PathLike) -> str:
    """The base model an adapter folder names (``base_model_name_or_path`` of its config)."""
    p = Path(path) / ADAPTER_CONFIG
    try:
        base = json.loads(p.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{str(p)!r} is not a readable PEFT adapter config ({e}); save the adapter again "
                         "(model.save_pretrained)") from None
    if not base:
        raise ValueError(f"the adapter in {str(path)!r} names no base model; pass it: "
                         f"gradindex build BASE_DIR --adapter {path}")
    return str(base)


def local_model(name: str | os.PathLike, adapter_dir: str | os.PathLike | None = None) -> Path | None:
    """The model ``name`` on this machine: the path itself, or for a hub id (``org/name``) the snapshot the local
    Hugging Face cache holds (nothing is downloaded); ``None`` where neither is here. A relative path an adapter
    names (``adapter_dir``: PEFT records the base as the training script was given it) is also looked for beside
    the adapter's folder and in it, so an index's queries find it from any working folder."""
    p = Path(name)
    if p.exists():
        return p.resolve() if adapter_dir is not None else p
    if adapter_dir is not None and not p.is_absolute():
        for near in (Path(adapter_dir).resolve().parent / p, Path(adapter_dir).resolve() / p):
            if near.exists():
                return near
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(name)):
        return None
    try:
        from huggingface_hub import snapshot_download

        snap = Path(snapshot_download(str(name), local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a valid id, no huggingface_hub: not here
        return None
    return snap if (snap / "config.json").is_file() else None


def adapter_base_path(adapter_dir: str | os.PathLike) -> Path:
    """The local folder (or file) of the base model the adapter in ``adapter_dir`` names; refused in one line,
    naming the fix, where it is not on this machine."""
    name = adapter_base(adapter_dir)
    local = local_model(name, adapter_dir)
    if local is None:
        raise FileNotFoundError(
            f"the adapter in {str(adapter_dir)!r} names its base model {name!r} (base_model_name_or_path in its "
            f"{ADAPTER_CONFIG}), which is not on this machine (gradindex reads local models only and found no copy "
            "in the Hugging Face cache, nor beside the adapter's folder); pass the base model's folder or .gguf file "
            f"as the model and this folder as its adapter (gradindex build BASE_DIR DATA --adapter {adapter_dir}; "
            "querying an index built so: --model BASE_DIR)")
    return local


def check_adapter_base(adapter_dir: str | os.PathLike, base: str | os.PathLike, warn: bool = True) -> None:
    """Refuse ``base`` for an adapter whose config names another model (``base_model_name_or_path``).

    An adapter of the right shapes loads onto any base of the same architecture, and its gradients would
    be those of a model it was never trained with. Where the named base is a folder or file on this machine
    (or a hub id in the local Hugging Face cache, :func:`local_model`) and not ``base`` itself, the two are
    compared: another config, or weight files of the same names and sizes with other contents
    (:func:`gradindex.checksum.sample_digest`), is refused. A base not on this machine is refused where the
    adapter records another model class (PEFT's ``auto_mapping``), else cannot be compared: a warning says so
    (``warn``; PEFT still refuses shapes that do not fit). A base saved in another file layout is compared by
    its config alone.
    """
    try:
        name = adapter_base(adapter_dir)
    except ValueError:
        return  # no base named: nothing to compare (a malformed config is reported where it is loaded)
    given, named = Path(base), local_model(name, adapter_dir)
    if named is None:
        _check_base_class(adapter_dir, name, given)
        if warn:
            logging.getLogger(__name__).warning(
                "the adapter in %r names its base model %r, which is not on this machine: gradindex cannot check "
                "that %r is that model (PEFT checks the shapes only); if it is not, the scores are those of a model "
                "the adapter was never trained with", str(adapter_dir), name, str(given))
        return
    if not given.exists() or named.resolve() == given.resolve():
        return
    why = _differs(named, given)
    if why:
        raise ValueError(
            f"the adapter in {str(adapter_dir)!r} does not fit this base model: it was trained on the model in "
            f"{name!r} (base_model_name_or_path in its {ADAPTER_CONFIG}), and {str(given)!r} is another "
            f"model ({why}), so its gradients would be those of a model the adapter was never trained with; pass "
            f"the base model it was trained from ({str(named)!r}), or the adapter trained on this one")


def _check_base_class(adapter_dir: str | os.PathLike, name: str, given: Path) -> None:
    """Refuse a base folder whose ``architectures`` lack the model class the adapter was saved from (PEFT's
    ``auto_mapping.base_model_class``, written for adapters saved without a task type)."""
    try:
        saved = (json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text()).get("auto_mapping") or {})
        archs = json.loads((given / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return
    cls = saved.get("base_model_class") if isinstance(saved, dict) else None
    if cls and archs and cls not in archs:
        raise ValueError(
            f"the adapter in {str(adapter_dir)!r} does not fit this base model: it was trained on a {cls} ({name!r}, "
            f"base_model_name_or_path in its {ADAPTER_CONFIG}) and {str(given)!r} is a {', '.join(archs)}; pass the "
            "base model it was trained from, or the adapter trained on this one")


_CONFIG_NOISE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures")


def _differs(a: Path, b: Path) -> str:
    """How the models in ``a`` and ``b`` (folders, or files) differ; '' when they look the same or cannot
    be compared."""
    from gradindex.checksum import sample_digest

    if a.is_file() and b.is_file():
        return "" if sample_digest(a) == sample_digest(b) else "its weights file differs"
    if not (a.is_dir() and b.is_dir()):
        return ""
    try:
        ca, cb = ({k: v for k, v in json.loads((p / "config.json").read_text()).items() if k not in _CONFIG_NOISE}
                  for p in (a, b))
    except (OSError, ValueError, AttributeError):
        return ""
    if ca != cb:
        keys = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
        return f"its config.json differs in {', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}"
    files = [sorted((f.name, f.stat().st_size) for f in p.iterdir() if f.suffix in (".safetensors", ".bin"))
             for p in (a, b)]
    if not files[0] or files[0] != files[1]:
        return ""  # another file layout (sharding, format): not comparable file by file
    changed = [n for n, _ in files[0] if sample_digest(a / n) != sample_digest(b / n)]
    return f"its weights differ ({', '.join(changed[:2])})" if changed else ""


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The model inside a ``PeftModel`` (LoRA layers injected in place), or ``model`` itself."""
    if any(c.__name__ == "PeftModel" for c in type(model).__mro__):
        inner = getattr(getattr(model, "base_model", None), "model", None)
        if isinstance(inner, nn.Module):
            return inner
    return model


class _Noise(logging.Filter):
    """bitsandbytes' log lines that say nothing to a gradindex user: "MatMul8bitLt: inputs will be cast ... to
    float16" on every int8 layer call (the inputs are quantized in float16 by design), and, where it is installed,
    on import (PEFT imports it for any adapter) "Failed to load CPU gemm_4bit_forward from kernels-community" (an
    optional kernel fetched from the hub; it falls back to its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return "inputs will be cast" not in msg and "from kernels-community" not in msg


def quiet_bitsandbytes() -> None:
    """Filter :class:`_Noise` out of bitsandbytes' loggers (before it is imported: the kernel line is logged then)."""
    for name in ("bitsandbytes.autograd._functions", "bitsandbytes.backends.cpu.ops"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _Noise) for f in log.filters):
            log.addFilter(_Noise())


def attach_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> nn.Module:
    """``model`` with the PEFT adapter of ``adapter_dir`` injected (frozen); refused when it does not fit."""
    quiet_bitsandbytes()  # (peft imports bitsandbytes where it is installed)
    try:
        from peft import PeftModel
    except ImportError:
        raise ImportError(NEEDS_PEFT) from None
    p = Path(adapter_dir)
    if not is_adapter_dir(p):
        raise FileNotFoundError(f"{str(p)!r} has no {ADAPTER_CONFIG}; pass a PEFT adapter folder "
                                "(peft_model.save_pretrained(DIR)) or a merged model as the model")
    fix = "pass the base model it was trained from (see base_model_name_or_path in its adapter_config.json)"
    try:
        wrapped = PeftModel.from_pretrained(model, str(p), is_trainable=False)
    except Exception as e:  # noqa: BLE001 - peft and torch raise many types for a misfit
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()] or [""]
        first = next((ln for ln in lines if ln.startswith(("size mismatch", "Missing key", "Unexpected key"))),
                     lines[0])[:200]  # (torch's header line, "Error(s) in loading state_dict", says nothing)
        raise ValueError(f"the adapter in {str(p)!r} does not fit this base model ({type(e).__name__}: "
                         f"{first}); {fix}") from None
    _check_all_loaded(wrapped, p, fix)
    inner = unwrap_peft(wrapped)
    inner.gradindex_adapter = str(p.resolve())
    return inner


def _check_all_loaded(wrapped: nn.Module, path: Path, fix: str) -> None:
    """Refuse an adapter whose saved weights and the injected LoRA weights are not the same set."""
    from safetensors import safe_open

    f = path / "adapter_model.safetensors"
    if not f.is_file():
        return  # a .bin adapter: PEFT loaded it; no key check
    with safe_open(str(f), "pt") as s:
        saved = set(s.keys())
    injected = {re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", n)
                for n, _ in wrapped.named_parameters() if ADAPTER_LAYER.search(n.rsplit(".", 1)[0])}
    missing, extra = sorted(injected - saved), sorted(saved - injected)
    if missing or extra:
        what = (f"{len(missing)} LoRA weight(s) of the model are not in the file (e.g. {missing[0]})" if missing
                else f"{len(extra)} saved weight(s) have no place in the model (e.g. {extra[0]})")
        raise ValueError(f"the adapter in {str(path)!r} does not fit this base model: {what}; {fix}")


def adapter_layers(names) -> list[str]:
    """The names among ``names`` that are LoRA ``A``/``B`` linears."""
    return [n for n in names if ADAPTER_LAYER.search(n)]


def adapter_path(model: nn.Module) -> str | None:
    """The adapter folder :func:`attach_adapter` loaded into ``model``, if any."""
    return getattr(unwrap_peft(model), "gradindex_adapter", None)


def adapter_fingerprint(model: nn.Module) -> str | None:
    """Hash of every LoRA weight (names, dtypes, shapes, values), or ``None`` for a model without one."""
    h, seen = hashlib.blake2b(digest_size=16), False
    for name, p in unwrap_peft(model).named_parameters():
        if ADAPTER_LAYER.search(name.rsplit(".", 1)[0]):
            seen = True
            h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest() if seen else None

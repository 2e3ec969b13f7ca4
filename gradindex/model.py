"""Loading a causal LM and its tokenizer from a local directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from gradindex.spec.layout import MANIFEST

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


_DEVICE = re.compile(r"(auto|cpu|mps|cuda(:\d+)?)")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` (CUDA when torch sees a GPU, else CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``."""
    if isinstance(device, torch.device):
        return device
    d = str(device).strip().lower()
    if not _DEVICE.fullmatch(d):
        raise ValueError(f"device {device!r} is not one of auto, cpu, cuda, cuda:N, mps")
    if d == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if d.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU; use --device cpu")
        if ":" in d and int(d.split(":")[1]) >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    if d == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' asked for, but torch sees no MPS device; use --device cpu")
    return torch.device(d)


def max_positions(model) -> int | None:
    """The most tokens the model's position embeddings take (``n_positions`` / ``max_position_embeddings``)."""
    cfg = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


TOKENIZER_UNSET = 10**9
"""A tokenizer's ``model_max_length`` at or above this is transformers' "no limit recorded" sentinel."""


def length_limit(model, tokenizer=None) -> tuple[int | None, str]:
    """The most tokens an example may have, and which limit that is and why.

    The smaller of the model's position embeddings (:func:`max_positions`: a longer example indexes
    past them) and the tokenizer's ``model_max_length`` (the length the model was trained to read; a
    tokenizer that records none has transformers' huge sentinel, ignored). ``(None, "")``: neither.
    """
    positions = max_positions(model)
    tok = getattr(tokenizer, "model_max_length", None)
    tok = tok if isinstance(tok, int) and 0 < tok < TOKENIZER_UNSET else None
    if tok is not None and (positions is None or tok < positions):
        of = f", fewer than the model's {positions} positions" if positions is not None else ""
        return tok, (f"the tokenizer's model_max_length {tok}{of}: the longest input the model is meant to read "
                     "(tokenizer_config.json)")
    if positions is not None:
        return positions, (f"the model's {positions} positions: a longer example would index past its position "
                           "embeddings")
    return None, ""


def vocab_size(model) -> int | None:
    """Rows of the input embedding: token ids must be below this."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError):
        return None


def resolve_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(set(DTYPES))}") from None


def resolve_pad_id(model=None, tokenizer=None, pad_id: int | None = None) -> int:
    """The token id padding is filled with: ``pad_id`` if given, else the tokenizer's pad token, else
    the model config's ``pad_token_id`` or ``eos_token_id``, else 0.

    Padded positions are masked out of attention and loss, so any valid id gives the same
    gradients; pre-tokenized data and queries need no tokenizer for it.
    """
    if pad_id is not None:
        return int(pad_id)
    if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
        return int(tokenizer.pad_token_id)
    config = getattr(model, "config", None)
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, list | tuple):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def load_causal_lm(model_dir: str | os.PathLike, dtype: str = "float32", device: str = "auto",
                   adapter: str | os.PathLike | None = None, chat_template: str | None = None):
    """``(model, tokenizer)`` from a local directory, model in eval mode on ``device``.

    ``adapter``: a PEFT adapter folder to load onto the model (:mod:`gradindex.adapter`); a
    ``model_dir`` that is itself an adapter folder loads the base its config names, then the
    adapter. ``chat_template``: template text or file given to the tokenizer (:mod:`gradindex.chat`).
    """
    from gradindex.adapter import adapter_base, attach_adapter, is_adapter_dir

    dev = resolve_device(device)
    if is_adapter_dir(model_dir) and not (Path(model_dir) / "config.json").exists():
        adapter, model_dir = adapter or model_dir, adapter_base(model_dir)
    model, tok_dir = _load_base(Path(model_dir), dtype)
    if adapter is not None:
        model = attach_adapter(model, adapter)
        if (Path(adapter) / "tokenizer_config.json").is_file():
            tok_dir = Path(adapter)  # a Trainer saves the tokenizer it trained with beside the adapter
    model.to(dev).eval()
    return model, load_tokenizer(tok_dir, chat_template)


def index_model_options(manifest: dict) -> dict:
    """``load_causal_lm`` keywords that reopen an index's model as it was built: its adapter and chat template."""
    return {"adapter": manifest.get("adapter_id") or None, "chat_template": manifest.get("chat_template") or None}


def _load_base(p: Path, dtype: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not (p / "config.json").exists():
        hint = ""
        if (p / MANIFEST).is_file():  # an index folder given where the model goes
            from gradindex.manifest import read_manifest

            try:
                built_from = read_manifest(p)["model_id"]
                hint = f" ({str(p)!r} is a gradindex index, built from the model in {built_from!r})"
            except (ValueError, KeyError, TypeError, OSError):
                hint = f" ({str(p)!r} looks like a gradindex index)"
        raise FileNotFoundError(f"{str(p)!r} has no config.json; pass a local transformers model directory{hint}")
    refuse_custom_code(p)
    config = AutoConfig.from_pretrained(p, local_files_only=True, trust_remote_code=False)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{str(p)!r} holds an encoder-decoder {config.model_type!r} model ({_saved_as(config)}); gradindex "
            "attributes decoder-only causal LMs, and AutoModelForCausalLM would keep this model's decoder only, "
            "dropping the encoder: use a decoder-only model (e.g. GPT-2, Llama, Qwen2)"
        )
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"{str(p)!r} holds a {config.model_type!r} model, which is not a causal LM; gradindex "
            "build needs a model that AutoModelForCausalLM loads (e.g. GPT-2, Llama)"
        )
    try:
        model, info = AutoModelForCausalLM.from_pretrained(p, dtype=resolve_dtype(dtype), local_files_only=True,
                                                           trust_remote_code=False, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - safetensors, torch and transformers raise many types
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"could not load the weights in {str(p)!r} ({type(e).__name__}: {first}); the weights file is "
            "missing, truncated or corrupt: save the model there again (model.save_pretrained)"
        ) from None
    check_loaded(p, config, info)
    return model, p


def refuse_custom_code(path: Path) -> None:
    """Refuse a model whose architecture exists only as code shipped in its directory (``auto_map``).

    gradindex never runs such code (``trust_remote_code``); without this check transformers would
    stop to ask on the terminal, or fail with advice to pass a flag gradindex does not have.
    """
    import json

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # AutoConfig reports it
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if isinstance(raw, dict) and raw.get("auto_map") and model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{str(path)!r} holds a {model_type!r} model defined by code in its own directory (auto_map in "
            "config.json), which gradindex does not run: use an architecture built into transformers (many "
            "custom decoders load as 'llama' or 'mistral' once their config and weights are converted)"
        )


def _saved_as(config) -> str:
    archs = getattr(config, "architectures", None) or []
    return "saved as " + ", ".join(archs) if archs else "no architectures in config.json"


def _causal_class_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: set[str] = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        out.update([v] if isinstance(v, str) else v)
    return out


def check_loaded(path: Path, config, info: dict) -> None:
    """Refuse a causal LM whose weights did not all come from the checkpoint.

    A directory saved from a model without an LM head (``LlamaModel``, a classifier) still loads
    into ``AutoModelForCausalLM``, with the missing weights (an untied ``lm_head``) drawn at random
    and the checkpoint's own head dropped: its gradients would be those of another model.
    """
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    archs = list(getattr(config, "architectures", None) or [])
    headless = bool(archs) and not set(archs) & _causal_class_names()
    fix = ("gradindex needs the causal LM itself: save the model loaded with AutoModelForCausalLM "
           "(e.g. AutoModelForCausalLM.from_pretrained(...).save_pretrained(DIR)) with its trained LM head")
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        what = f"{_saved_as(config)}, with no causal LM head; " if headless else ""
        raise ValueError(f"{str(path)!r} ({what}{len(missing)} weight(s) missing: {shown}) would load with those "
                         f"weights drawn at random; {fix}")
    if headless and unexpected:
        shown = ", ".join(unexpected[:3]) + (", ..." if len(unexpected) > 3 else "")
        raise ValueError(f"{str(path)!r} is {_saved_as(config)}, not a causal LM: its weights {shown} have no "
                         f"place in one and would be dropped; {fix}")


def load_tokenizer(model_dir: str | os.PathLike, chat_template: str | os.PathLike | None = None):
    """The tokenizer of a local model directory, with a pad token (eos or unk when it has none), and
    ``chat_template`` (text or file) as its chat template when given."""
    from transformers import AutoTokenizer

    from gradindex.chat import set_chat_template

    tokenizer = AutoTokenizer.from_pretrained(Path(model_dir), local_files_only=True, trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    set_chat_template(tokenizer, chat_template)
    return tokenizer

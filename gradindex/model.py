"""Loading a causal LM and its tokenizer from a local directory."""

from __future__ import annotations

import contextlib
import functools
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
                   adapter: str | os.PathLike | None = None, chat_template: str | None = None,
                   index_tokenizer: dict | None = None, base_quantization: str | None = None):
    """``(model, tokenizer)`` from a local directory or a ``.gguf`` file, model in eval mode on ``device``.

    ``adapter``: a PEFT adapter folder to load onto the model (:mod:`gradindex.adapter`); a
    ``model_dir`` that is itself an adapter folder loads the base its config names, then the
    adapter. ``chat_template``: template text or file given to the tokenizer (:mod:`gradindex.chat`).
    A GGUF file (:func:`load_gguf`) is de-quantized to ``dtype``; its tokenizer comes from the file.
    ``index_tokenizer``: the tokenizer fingerprint an index recorded (:func:`index_model_options`); a
    tokenizer that differs from it is refused (:func:`gradindex.fingerprint.check_tokenizer`).
    ``base_quantization``: ``int8`` or ``nf4`` loads the base quantized (bitsandbytes, :mod:`gradindex.quantize`),
    only under an adapter, whose LoRA layers are then what is attributed.
    """
    from gradindex.adapter import adapter_base_path, attach_adapter, check_adapter_base, is_adapter_dir
    from gradindex.quantize import check_base_quantization

    dev = resolve_device(device)
    if is_adapter_dir(model_dir) and not (Path(model_dir) / "config.json").exists():
        adapter, model_dir = adapter or model_dir, adapter_base_path(model_dir)
    elif adapter is not None:  # (an index reopened checked its base at its build: no warning then)
        check_adapter_base(adapter, model_dir, warn=index_tokenizer is None)
    quant = check_base_quantization(base_quantization, adapter, is_gguf(model_dir))
    model, tok_dir = _load_base(Path(model_dir), dtype, quant, dev)
    if adapter is not None:
        model = attach_adapter(model, adapter)
        if (Path(adapter) / "tokenizer_config.json").is_file():
            tok_dir = Path(adapter)  # a Trainer saves the tokenizer it trained with beside the adapter
    if quant is None:  # (a quantized base is loaded onto the device: bitsandbytes quantizes it there)
        model.to(dev)
    model.eval()
    tokenizer = load_tokenizer(tok_dir, chat_template)
    check_tokenizer_fits(model, tokenizer, tok_dir)
    if index_tokenizer:
        from gradindex.fingerprint import check_tokenizer

        check_tokenizer(index_tokenizer, tokenizer, f"the tokenizer of {str(tok_dir)!r}")
    return model, tokenizer


def check_tokenizer_fits(model, tokenizer, where: str | os.PathLike = "") -> None:
    """Refuse a tokenizer with more tokens than the model's input embedding has rows: its ids past the
    embedding would index out of it (an ``IndexError`` in the capture), so it is not this model's."""
    rows = vocab_size(model)
    try:
        size = len(tokenizer) if tokenizer is not None else 0
    except TypeError:  # a stand-in without a vocabulary (pre-tokenized data)
        return
    if rows is not None and size > rows:
        of = f" in {str(where)!r}" if str(where) else ""
        raise ValueError(
            f"the tokenizer{of} has {size:,} tokens but the model's input embedding has {rows:,} rows: token ids "
            f"{rows:,} and above would index past it, so this is another model's tokenizer; put the model's own "
            "tokenizer beside its weights (tokenizer.save_pretrained(MODEL_DIR))")


def index_model_options(manifest) -> dict:
    """``load_causal_lm`` keywords that reopen an index's model as it was built: its adapter and chat template,
    the base quantization it recorded, and the tokenizer fingerprint it recorded (none before tokenizers were
    fingerprinted: not checked). A base quantized otherwise than gradindex loads one (the in-loop capture records
    what the training loop used, e.g. bitsandbytes' default 4-bit ``fp4``) is refused, naming what to do."""
    from gradindex.quantize import BASE_QUANTIZATIONS
    from gradindex.spec.manifest import Manifest

    m = Manifest.of(manifest)
    quant = m.base_quantization
    if quant and quant not in BASE_QUANTIZATIONS:
        raise ValueError(
            f"this index's base model was quantized as {quant!r} when its gradients were captured, and gradindex "
            f"loads a base quantized only as {' or '.join(BASE_QUANTIZATIONS)} "
            "(gradindex.quantize.quantization_config): load the model as it was trained and pass it (Python: "
            "model=..., e.g. QueryEngine(index, model=..., tokenizer=...)), or train on a base quantized so")
    return {"adapter": m.adapter_id, "chat_template": m.chat_template, "index_tokenizer": m.tokenizer,
            **({"base_quantization": quant} if quant else {})}


def _load_base(p: Path, dtype: str, quant: str | None = None, device: torch.device | None = None):
    from transformers import AutoModelForCausalLM

    if is_gguf(p):
        return load_gguf(p, dtype), p
    config = causal_config(p)
    refuse_weightless(p)
    extra = {}
    if quant is not None:
        from gradindex.quantize import quantization_config

        extra = {"quantization_config": quantization_config(quant, resolve_dtype(dtype)),
                 "device_map": {"": str(device or "cpu")}}
    try:
        model, info = AutoModelForCausalLM.from_pretrained(p, dtype=resolve_dtype(dtype), local_files_only=True,
                                                           trust_remote_code=False, output_loading_info=True, **extra)
    except Exception as e:  # noqa: BLE001 - safetensors, torch and transformers raise many types
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"could not load the weights in {str(p)!r} ({type(e).__name__}: {first}); the weights file is "
            "missing, truncated or corrupt: save the model there again (model.save_pretrained)"
        ) from None
    check_loaded(p, config, info)
    if quant is not None:
        from gradindex.quantize import prepare

        prepare(model)
    return model, p


def causal_config(p: Path):
    """The transformers config of the decoder-only causal LM in ``p`` (refused by name: no config.json,
    an index folder, code shipped in the folder, an encoder-decoder or a model that is not a causal LM)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not (p / "config.json").exists():
        hint = ""
        if (p / MANIFEST).is_file():  # an index folder given where the model goes
            from gradindex.spec.manifest import Manifest

            try:
                built_from = Manifest.read(p).model_id
                hint = f" ({str(p)!r} is a gradindex index, built from the model in {built_from!r})"
            except (ValueError, KeyError, TypeError, OSError):
                hint = f" ({str(p)!r} looks like a gradindex index)"
        if not p.exists():
            raise FileNotFoundError(f"{str(p)!r} does not exist; pass a local transformers model directory (or a "
                                    ".gguf file)")
        if p.is_file():
            raise FileNotFoundError(f"{str(p)!r} is a file, not a model directory; pass a local transformers model "
                                    "directory (or a .gguf file)")
        raise FileNotFoundError(f"{str(p)!r} has no config.json; pass a local transformers model directory{hint}")
    refuse_custom_code(p)
    config = AutoConfig.from_pretrained(p, local_files_only=True, trust_remote_code=False)
    check_causal(p, config)
    return config


def check_causal(p: Path, config) -> None:
    """Refuse a config of an encoder-decoder or of a model that is not a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

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


WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                "*.h5", "*.msgpack", "*.gguf")
"""Files that may hold a model's weights (transformers' ``model.safetensors``, ``pytorch_model.bin``, their
sharded forms and index, and other formats): a folder with none of them is config-only."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def is_weightless(model_dir: str | os.PathLike) -> bool:
    """Whether ``model_dir`` holds a ``config.json`` and no weights file (:data:`WEIGHT_FILES`): a config-only
    folder, which ``gradindex plan`` sizes a build from (:func:`load_meta_model`) and nothing else loads."""
    p = Path(model_dir)
    return (p / "config.json").is_file() and not any(next(p.glob(g), None) for g in WEIGHT_FILES)


def refuse_weightless(model_dir: str | os.PathLike) -> None:
    """Refuse a config-only folder (:func:`is_weightless`) where the model's weights are needed, naming
    ``gradindex plan`` as what takes one."""
    if is_weightless(model_dir):
        raise ValueError(
            f"{str(model_dir)!r} holds a config.json but no weights (no model.safetensors, pytorch_model.bin or "
            "their shards): this command needs the weights; `gradindex plan MODEL_DIR DATA` takes a weightless "
            "folder and estimates the build from the config alone"
        )


def load_meta_model(model_dir: str | os.PathLike, dtype: str = "float32"):
    """``(model, tokenizer or None)`` of a config-only folder: the causal LM built from its ``config.json``
    on the meta device (shapes and dtypes, no storage: a 70B model in well under a second and a few MB),
    in eval mode, and the folder's tokenizer when it has tokenizer files (:data:`TOKENIZER_FILES`)."""
    from transformers import AutoModelForCausalLM

    p = Path(model_dir)
    config = causal_config(p)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype), trust_remote_code=False)
    model.eval()
    has_tokenizer = any((p / f).is_file() for f in TOKENIZER_FILES)
    return model, load_tokenizer(p) if has_tokenizer else None


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


def check_loaded(path: Path, config, info: dict, fix: str | None = None) -> None:
    """Refuse a causal LM whose weights did not all come from the checkpoint.

    A directory saved from a model without an LM head (``LlamaModel``, a classifier) still loads
    into ``AutoModelForCausalLM``, with the missing weights (an untied ``lm_head``) drawn at random
    and the checkpoint's own head dropped: its gradients would be those of another model. ``fix``: what the
    error tells to do (default: save the causal LM itself).
    """
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    archs = list(getattr(config, "architectures", None) or [])
    headless = bool(archs) and not set(archs) & _causal_class_names()
    fix = fix or ("gradindex needs the causal LM itself: save the model loaded with AutoModelForCausalLM "
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
    """The tokenizer of a local model directory or GGUF file (with the chat template the file holds), with a
    pad token (eos or unk when it has none), and ``chat_template`` (text or file) as its chat template when given."""
    from transformers import AutoTokenizer

    from gradindex.chat import set_chat_template

    p = Path(model_dir)
    if is_gguf(p):
        tokenizer = _gguf_tokenizer(p)
    else:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    set_chat_template(tokenizer, chat_template)
    return tokenizer


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file (``*.gguf``): a model gradindex de-quantizes (:func:`load_gguf`)."""
    return str(path).lower().endswith(".gguf")


def is_model_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a model that :func:`load_causal_lm` opens: a folder with a ``config.json`` or an
    adapter config, or a GGUF file."""
    from gradindex.adapter import is_adapter_dir

    p = Path(path)
    return (p / "config.json").is_file() or is_adapter_dir(p) or (is_gguf(p) and p.is_file())


def model_file(model) -> dict | None:
    """The file a model was loaded from when it is a single file (a GGUF: path, bytes, BLAKE2b, architecture),
    which the index records as its model; ``None`` for a model folder."""
    from gradindex.adapter import unwrap_peft

    return getattr(unwrap_peft(model), "gradindex_file", None)


def load_gguf(p: Path, dtype: str = "float32"):
    """The causal LM in the GGUF file ``p``, de-quantized by transformers into a plain ``dtype`` model (every
    weight an ordinary tensor, so the capture hooks see ``nn.Linear`` layers), with ``gradindex_file`` set
    (:func:`model_file`). Refused in one line: no file, no ``gguf`` package, an unreadable file, an architecture
    transformers cannot read from GGUF, a model that is not a causal LM."""
    from transformers import AutoModelForCausalLM

    from gradindex.checksum import file_digest

    arch = gguf_architecture(p)
    config = _gguf_config(p, arch)
    try:
        with _quiet_gguf_bar():
            model, info = from_gguf(AutoModelForCausalLM, p, dtype=resolve_dtype(dtype), output_loading_info=True,
                                    **_dequantized())
    except Exception as e:  # noqa: BLE001 - gguf, torch and transformers raise many types
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"could not load the {arch!r} weights in {str(p)!r} ({type(e).__name__}: {first}); "
                         f"{_gguf_fix(arch)}") from None
    check_loaded(p, config, info, fix=f"the file's tensors are not those transformers reads as a {arch!r} model: "
                 "convert it again (llama.cpp's convert_hf_to_gguf.py), or pass the model folder it was converted from")
    model.gradindex_file = {"path": str(p.resolve()), "format": "gguf", "architecture": arch,
                            "bytes": p.stat().st_size, "blake2b": file_digest(p)}
    return model


def from_gguf(auto, p: Path, **kw):
    """``auto.from_pretrained`` (a transformers ``Auto*`` class) of the GGUF file ``p`` alone: pointed at an empty
    folder, so that files lying beside ``p`` (another model's config or tokenizer files) are not read with it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gradindex-gguf-") as empty:
        return auto.from_pretrained(empty, gguf_file=str(p.resolve()), local_files_only=True, trust_remote_code=False,
                                    **kw)


NEEDS_GGUF = ("reading a .gguf model needs the gguf and accelerate packages (transformers de-quantizes the file "
              "with gguf and loads it through accelerate): pip install 'gradindex[gguf]'")


def gguf_architecture(p: Path) -> str:
    """``general.architecture`` of the GGUF file ``p`` (its header alone is read)."""
    if not p.is_file():
        raise FileNotFoundError(f"{str(p)!r} is not a file; pass a GGUF model file or a model folder")
    import importlib.util

    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError(NEEDS_GGUF) from None
    if importlib.util.find_spec("accelerate") is None:
        raise ValueError(NEEDS_GGUF)
    try:
        field = GGUFReader(str(p)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception as e:  # noqa: BLE001 - numpy, struct and the reader raise many types for a bad file
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{str(p)!r} is not a readable GGUF file ({type(e).__name__}: {first}); it is truncated "
                         "or corrupt: download or convert it again") from None


def _gguf_tokenizer(p: Path):
    """The tokenizer in the GGUF file ``p``, the file refused in one line as :func:`load_gguf` refuses it (a command
    that reads only the tokenizer, e.g. ``dedup --model``, would otherwise meet gguf's and transformers' errors)."""
    from transformers import AutoTokenizer

    _check_gguf_architecture(p, gguf_architecture(p))
    try:
        return from_gguf(AutoTokenizer, p)
    except Exception as e:  # noqa: BLE001 - gguf, struct and transformers raise many types for a bad file
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"could not read the tokenizer in {str(p)!r} ({type(e).__name__}: {first}); the file is "
                         "truncated or corrupt, or holds no tokenizer: download or convert it again") from None


def _check_gguf_architecture(p: Path, arch: str) -> None:
    """Refuse a GGUF whose architecture this transformers does not de-quantize, naming those it does."""
    supported = _gguf_architectures()
    if supported is not None and not _gguf_readable(arch, supported):
        raise ValueError(f"{str(p)!r} holds a {arch!r} model, an architecture transformers cannot de-quantize from "
                         f"GGUF; {_gguf_fix(arch)}")


def _gguf_config(p: Path, arch: str):
    """The transformers config transformers reads from the GGUF ``p`` (refused as :func:`causal_config` does)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _check_gguf_architecture(p, arch)
    try:
        config = from_gguf(AutoConfig, p)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a GGUF it cannot read
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"transformers cannot read the {arch!r} model in {str(p)!r} from GGUF ({type(e).__name__}: "
                         f"{first}); {_gguf_fix(arch)}") from None
    check_causal(p, config)
    return config


def _gguf_fix(arch: str) -> str:
    import transformers

    return (f"transformers {transformers.__version__} reads GGUF architectures {', '.join(_gguf_architectures() or [])}"
            f"; convert the {arch!r} model to a model folder (config.json, model.safetensors and its tokenizer "
            "files, e.g. the original checkpoint saved with save_pretrained) and pass that folder")


def _gguf_architectures() -> list[str] | None:
    """The GGUF architectures this transformers de-quantizes (``None``: it does not say)."""
    names: set[str] = set()
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return None
    names.update(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    try:  # transformers >= 5.2x: architectures its newer GGUF loader reads
        from transformers.integrations.gguf.utils import GGUF_ARCHS
    except ImportError:
        GGUF_ARCHS = {}
    return sorted(names | set(GGUF_ARCHS))


def _gguf_readable(arch: str, supported: list[str]) -> bool:
    """Whether ``arch`` is among ``supported``, spelled either way (GGUF's ``qwen2moe`` is ``qwen2_moe``)."""
    def norm(a: str) -> str:
        return re.sub(r"[^a-z0-9]", "", a.lower())

    return norm(arch) in {norm(a) for a in supported}


@contextlib.contextmanager
def _quiet_gguf_bar():
    """transformers' GGUF de-quantization draws a tqdm bar of its own, whatever its progress-bar setting (which
    gradindex turns off): the bar is turned off with the others while the file loads."""
    try:
        import transformers.modeling_gguf_pytorch_utils as utils
    except ImportError:
        yield
        return
    bar = getattr(utils, "tqdm", None)
    if bar is not None:
        utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            utils.tqdm = bar


def _dequantized() -> dict:
    """``from_pretrained`` keywords that de-quantize every GGUF weight: transformers >= 5 otherwise keeps quantized
    blocks behind matmul kernels where it has them, layers the capture cannot hook."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}

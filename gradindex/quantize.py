"""A quantized base model under a LoRA adapter (``--base-quantization int8|nf4``, bitsandbytes).

The set-up of a user with one GPU: the base model's weights held in 8 or 4 bits (QLoRA), a float LoRA
adapter trained on top. The base's quantized linears are frozen integers, so they have no weight gradient
to attribute; what is attributed is the adapter's ``lora_A``/``lora_B`` (plain ``nn.Linear`` modules inside
PEFT's bitsandbytes LoRA wrappers), whose per-example gradients the linear capture rule gives exactly as
for a float base: the quantized layers only change the forward values and the gradients flowing back.

bitsandbytes, because it is the library transformers' ``BitsAndBytesConfig``, PEFT's LoRA layers
(``peft.tuners.lora.bnb``) and Bergson load quantized bases with, it is maintained with torch's releases,
and it runs on CPU (0.50 tested) as well as CUDA. Quantization is done at load time from the float checkpoint.

* ``int8``: ``load_in_8bit`` with ``llm_int8_threshold=0``: int8 weights (per output row) times int8 inputs (per
  token). LLM.int8()'s default threshold of 6 keeps the input columns holding an outlier above 6 in float16, but
  it picks those columns over the whole batch, so an example's gradient would depend on the examples batched
  with it (on a tiny model, up to 0.7% of a row on 2 of 16 examples; none at threshold 0): a row, and a query's
  score, would change with ``--batch-size`` and with the other queries asked at once.
* ``nf4``: QLoRA's 4-bit NormalFloat weights with double quantization, de-quantized to the model's ``--dtype`` for
  each product (inputs unquantized: every example's gradient is its own).
"""

from __future__ import annotations

import torch
from torch import nn

from gradindex.adapter import quiet_bitsandbytes, unwrap_peft

BASE_QUANTIZATIONS = {"int8": "8-bit weights, row-wise 8-bit inputs (bitsandbytes load_in_8bit, outlier threshold 0)",
                      "nf4": "4-bit NormalFloat with double quantization, QLoRA's (bitsandbytes load_in_4bit)"}
NEEDS_BNB = ("a quantized base (--base-quantization) needs the bitsandbytes package: "
             "pip install 'gradindex[quantize]'")
NEEDS_ADAPTER = ("--base-quantization {q} loads the base model's layers as frozen {q} integers, which have no "
                 "weight gradient to attribute: give the LoRA adapter trained on that base (--adapter DIR), or "
                 "leave --base-quantization out")


def check_base_quantization(name: str | None, adapter, gguf: bool = False) -> str | None:
    """``name`` normalized (``None`` or ``'none'``: no quantization); refused in one line where it cannot be used:
    an unknown name, no adapter, a GGUF file (de-quantized, not re-quantized), bitsandbytes missing."""
    if name is None or str(name).lower() in ("", "none"):
        return None
    q = str(name).lower()
    if q not in BASE_QUANTIZATIONS:
        raise ValueError(f"--base-quantization {name!r} is not one of none, {', '.join(BASE_QUANTIZATIONS)}")
    if adapter is None:
        raise ValueError(NEEDS_ADAPTER.format(q=q))
    if gguf:
        raise ValueError(f"--base-quantization {q} quantizes a model folder's float weights as it loads them; a .gguf "
                         "file is de-quantized instead: pass the base model's folder, or leave --base-quantization out")
    _import_bnb()
    return q


def _import_bnb():
    """Import bitsandbytes (quietly: :func:`quiet_bitsandbytes`)."""
    quiet_bitsandbytes()
    try:
        import bitsandbytes
    except ImportError:
        raise ValueError(NEEDS_BNB) from None
    return bitsandbytes


def quantization_config(name: str, dtype: torch.dtype):
    """transformers' ``BitsAndBytesConfig`` of ``name`` (:data:`BASE_QUANTIZATIONS`), computing in ``dtype``."""
    from transformers import BitsAndBytesConfig

    if name == "int8":  # (threshold 0: no per-batch outlier columns, :data:`BASE_QUANTIZATIONS`)
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def prepare(model: nn.Module) -> nn.Module:
    """Make a bitsandbytes model's forward the same function on every CPU: bitsandbytes' 4-bit layers, on a CPU
    with AVX-512 BF16 and an input that needs no gradient, repack their weights in place on first use and compute
    in bfloat16 (so the weights' bytes, and the model fingerprint, would change after the first batch); they
    de-quantize and compute in the compute dtype instead, as everywhere else."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def quantized_kind(weight) -> str | None:
    """``int8``, ``nf4``/``fp4`` or the storage dtype of a quantized weight; ``None`` for a float one."""
    name = type(weight).__name__
    if name == "Int8Params":
        return "int8"
    if name == "Params4bit":
        return str(getattr(weight, "quant_type", None) or "4bit")
    if isinstance(weight, torch.Tensor) and not (weight.is_floating_point() or weight.is_complex()):
        return str(weight.dtype).replace("torch.", "")
    return None


def base_quantization(model: nn.Module) -> str | None:
    """How the model's base weights are quantized (:func:`quantized_kind` of the first quantized linear), or
    ``None`` when none is."""

    for m in unwrap_peft(model).modules():
        kind = quantized_kind(getattr(m, "weight", None))
        if kind:
            return kind
    return None


def refuse_quantized(chosen: dict[str, nn.Module]) -> None:
    """Refuse hooking a quantized layer: its weight is frozen integers with no gradient (one line, the fix named)."""
    for name, m in chosen.items():
        kind = quantized_kind(getattr(m, "weight", None))
        if kind:
            raise ValueError(
                f"layer {name} is a quantized base layer ({kind}): its weights are frozen integers with no gradient "
                "to attribute; attribute the LoRA adapter's layers (leave --layers out, or choose '*lora_*'), or "
                "load the base unquantized (leave --base-quantization out)")

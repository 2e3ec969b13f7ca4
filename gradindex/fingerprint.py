"""Fingerprints that tie an index to the model, data and settings that built it."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

from gradindex.errors import IndexMismatchError

_CHUNK = 1 << 24
"""Bytes hashed per step (the only copy a GPU parameter makes on the host)."""


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the config and of every parameter's name, dtype, shape and every byte of its values.

    Every value counts: one changed weight anywhere changes the fingerprint. Values are hashed in
    the dtype they are loaded in, so a float32 and a bfloat16 load of one checkpoint differ (their
    gradients do too); the build identity records that dtype separately, so a mismatch is named.
    Costs one streaming read of the weights (``benchmarks/fingerprint.py``). Under FSDP2 every rank
    must call it (each sharded parameter is gathered in turn); ``DistributedDataParallel``'s wrapper
    is looked through, so a wrapped and a plain model hash alike.
    """
    model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    h = hashlib.blake2b(digest_size=16)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        # runtime settings, not the function the weights compute: use_cache; the special token ids, which TRL's
        # SFTTrainer writes onto the live model's config from the tokenizer (the saved base config lacks them)
        skip = ("torch_dtype", "dtype", "_name_or_path", "transformers_version", "use_cache", "pad_token_id",
                "bos_token_id", "eos_token_id")
        d = {k: v for k, v in cfg.to_dict().items() if k not in skip}
        h.update(json.dumps(d, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        if hasattr(p, "full_tensor"):  # a DTensor sharded by FSDP2: gathered (a collective: every rank calls this)
            p = p.full_tensor()
        flat = p.detach().reshape(-1)
        step = max(1, _CHUNK // flat.element_size())
        for s in range(0, flat.numel(), step):
            h.update(flat[s:s + step].contiguous().view(torch.uint8).cpu().numpy().data)
    return h.hexdigest()


def digest_bytes(chunks) -> str:
    h = hashlib.blake2b(digest_size=16)
    for c in chunks:
        h.update(c)
    return h.hexdigest()


TOKENIZER_PARTS = {
    "vocabulary": "vocabulary",
    "merges": "merges",
    "special_tokens": "special tokens",
    "encoding": "text splitting (normalizer, pre-tokenizer or the bos/eos it adds)",
    "chat_template": "chat template",
}
"""The parts of a tokenizer's fingerprint (:func:`tokenizer_fingerprint`), with the words naming each."""

PROBE = "Hello,  world!\n\tThe 2024 café — naïve 東京 🙂 x=1; don't   stop.\r\nEND"
"""A text whose ids (special tokens added) catch normalizer, pre-tokenizer and post-processor differences."""


def tokenizer_fingerprint(tokenizer, chat: bool = False) -> dict:
    """What makes a tokenizer turn text into the ids it does, each part hashed: its vocabulary, its merges
    (BPE; a Unigram model's scores; a slow SentencePiece model's file), its special and added tokens, how it
    splits text (the ids of :data:`PROBE`), and with ``chat`` (an index built from chat records) its chat
    template. ``size`` is its length. Parts are hashed from what the tokenizer does, not from how a library
    version serializes it, so a tokenizer reloaded by another ``tokenizers`` version hashes alike."""
    from gradindex.chat import template_of

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    specials = {"map": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
                "added": sorted((int(i), str(t), bool(getattr(t, "special", False)))
                                for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items())}
    out = {"size": len(tokenizer), "vocabulary": _json_digest(vocab), "merges": _json_digest(_merges(tokenizer)),
           "special_tokens": _json_digest(specials),
           "encoding": _json_digest(list(tokenizer(PROBE, add_special_tokens=True)["input_ids"]))}
    if chat:
        out["chat_template"] = _json_digest(template_of(tokenizer))
    return out


def _merges(tokenizer):
    """A tokenizer's merge rules as ``[a, b]`` pairs (BPE, either serialization), a Unigram model's scores, a slow
    SentencePiece model's bytes digest, or ``None``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model = json.loads(backend.to_str()).get("model", {})
        if "merges" in model:
            return [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]]
        if model.get("type") == "Unigram":
            return model.get("vocab")
        return None
    sp = getattr(tokenizer, "sp_model", None)
    if sp is not None and hasattr(sp, "serialized_model_proto"):
        return digest_bytes([sp.serialized_model_proto()])
    return None


def _json_digest(value) -> str:
    return digest_bytes([json.dumps(value, ensure_ascii=False, default=str).encode()])


def tokenizer_differences(recorded: dict, now: dict) -> list[str]:
    """The parts (:data:`TOKENIZER_PARTS`) in which two tokenizer fingerprints differ, in words; parts one of
    them lacks are not compared (an index built before the tokenizer was fingerprinted has none)."""
    diffs = []
    for key, words in TOKENIZER_PARTS.items():
        if key in recorded and key in now and recorded[key] != now[key]:
            sizes = ""
            if key == "vocabulary" and recorded.get("size") is not None and now.get("size") is not None:
                sizes = f" (index: {recorded['size']:,} tokens, now: {now['size']:,})"
            diffs.append(f"its {words} differ{'s' if not words.endswith('s') else ''}{sizes}")
    return diffs


def check_tokenizer(recorded: dict | None, tokenizer, what: str = "this tokenizer", index_dir="") -> None:
    """Refuse ``tokenizer`` where it is not the one whose fingerprint an index recorded (``recorded``:
    the index's ``build.tokenizer``): the same text would become other ids, and other rows. Nothing is
    checked where the index recorded none (built before tokenizers were fingerprinted, or with no tokenizer)
    or where there is no tokenizer (token-id queries)."""
    if not recorded or tokenizer is None:
        return
    diffs = tokenizer_differences(recorded, tokenizer_fingerprint(tokenizer, chat="chat_template" in recorded))
    if diffs:
        index = f"the index in {str(index_dir)!r}" if str(index_dir) else "this index"
        raise IndexMismatchError(
            f"{what} is not the one that built {index}: " + "; ".join(diffs) + ". The same text would become "
            "other token ids; use the tokenizer the index was built with (the model folder or GGUF file it was built "
            "from), or rebuild the index with this one")

"""Small models built from configs, a local BPE tokenizer, and a short trainer.

Used by the demo, the tests and the benchmarks: nothing here touches a network.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn


def tiny_gpt2(vocab_size: int = 512, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
              n_positions: int = 128, seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                     n_positions=n_positions, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()


def tiny_llama(vocab_size: int = 512, n_layer: int = 2, hidden: int = 64, n_head: int = 4,
               intermediate: int = 128, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
                      max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      attention_bias=True)
    return LlamaForCausalLM(cfg).eval()


def train_tokenizer(texts: Sequence[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on ``texts`` (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")


def save_model_dir(model: nn.Module, tokenizer, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(p)
    if tokenizer is not None:
        tokenizer.save_pretrained(p)
    return p


def train_lm(model: nn.Module, sequences: Sequence[Sequence[int]], steps: int, batch_size: int = 16,
             lr: float = 3e-3, seed: int = 0, pad_id: int = 0, log_every: int = 0) -> list[float]:
    """A few AdamW steps of next-token training on token sequences; returns the losses."""
    from gradindex.data import collate

    g = torch.Generator().manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        idx = torch.randint(len(sequences), (batch_size,), generator=g).tolist()
        ids = [list(sequences[i]) for i in idx]
        b = collate(ids, ids, pad_id)
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.detach().item())
        if log_every and (step + 1) % log_every == 0:
            print(f"  step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.3f}", flush=True)
    model.eval()
    return losses


STDLIB_MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
    "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "inspect", "io",
    "ipaddress", "itertools", "json", "logging", "mailbox", "math", "mimetypes", "operator", "os",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "shlex", "shutil",
    "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse",
    "uuid", "warnings", "weakref", "zipfile",
)


def stdlib_corpus(min_chars: int = 80, max_chars: int = 600, limit: int | None = None) -> list[str]:
    """Real English text with no download: paragraphs of the Python standard library's docstrings.

    Deterministic for a given Python version (modules and members are visited in sorted order).
    """
    import importlib
    import inspect

    seen: set[str] = set()
    out: list[str] = []
    for modname in STDLIB_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        objs = [mod] + [v for _, v in sorted(vars(mod).items()) if inspect.isclass(v) or inspect.isfunction(v)]
        for obj in objs:
            doc = inspect.getdoc(obj) or ""
            for para in doc.split("\n\n"):
                text = " ".join(para.split())
                if min_chars <= len(text) <= max_chars and text not in seen and not text.startswith(">>>"):
                    seen.add(text)
                    out.append(text)
                    if limit is not None and len(out) >= limit:
                        return out
    return out

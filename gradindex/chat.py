"""Chat records → token ids and labels with the tokenizer's chat template, loss on assistant turns only.

A chat record is TRL's conversational form, ``{"messages": [{"role": ..., "content": ...}, ...]}``.
The ids are ``tokenizer.apply_chat_template(messages)``, as TRL's ``SFTTrainer`` tokenizes them.
The targets are the assistant turns' tokens:

* a template with ``{% generation %}`` markers: the tokens the template marks
  (``return_assistant_tokens_mask``), exactly TRL's ``assistant_only_loss`` labels;
* any other template: for each assistant turn, the tokens that rendering the conversation up to
  and including that turn adds after the conversation before it with the generation prompt (the
  turn's content and its end-of-turn token), so the template must render earlier turns unchanged.

A template given by file (``--chat-template``) is set on the tokenizer (:func:`set_chat_template`);
the build records the template it used in the manifest, and whatever reopens the index applies it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

IGNORE = -100
"""Label of a position with no target (transformers' and TRL's ignore index)."""
MESSAGES = "messages"
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
NO_TEMPLATE = ("the tokenizer has no chat template, so 'messages' records cannot be tokenized; a build takes one "
               "with --chat-template FILE (a Jinja chat template, e.g. the training model's tokenizer_config.json "
               "'chat_template') and keeps it for the index's queries; a query on an index built without one takes "
               "the model's own (give the model folder a chat_template.jinja or tokenizer_config.json "
               "'chat_template'), or ask it as --prompt/--completion instead; in Python, set tokenizer.chat_template")


def set_chat_template(tokenizer, template: str | os.PathLike | None) -> None:
    """Give ``tokenizer`` the chat template ``template`` (its text, or a file holding it: a Jinja file, or a
    ``tokenizer_config.json`` whose ``chat_template`` is taken); ``None``: keep it."""
    if template is None or tokenizer is None:
        return
    text = str(template)
    if "{" not in text:  # a path, not template text
        p = Path(text)
        if not p.is_file():
            raise FileNotFoundError(f"chat template file {text!r} does not exist; pass a Jinja chat template file")
        text = _template_text(p.read_text(encoding="utf-8"), text)
    if not text.strip():
        raise ValueError(f"chat template {str(template)!r} is empty; pass a Jinja chat template")
    tokenizer.chat_template = text


def _template_text(text: str, where: str) -> str:
    """The template a file holds: its text, or the ``chat_template`` of a JSON object (a ``tokenizer_config.json``,
    whose JSON would otherwise be rendered as the template itself: every record the same text)."""
    import json

    if not text.lstrip().startswith("{") or text.lstrip().startswith(("{%", "{{", "{#")):
        return text
    try:
        obj = json.loads(text)
    except ValueError:
        return text
    t = obj.get("chat_template") if isinstance(obj, dict) else None
    if isinstance(t, list):  # named variants: [{"name": "default", "template": ...}, ...]
        t = next((v.get("template") for v in t if isinstance(v, dict) and v.get("name") == "default"), None)
    if not isinstance(t, str) or not t.strip():
        raise ValueError(f"chat template file {where!r} is a JSON file with no 'chat_template' text; pass a Jinja "
                         "chat template file, or the tokenizer_config.json that holds one")
    return t


def template_of(tokenizer) -> str | None:
    """The tokenizer's chat template text (the ``default`` one of named variants), or ``None``."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default")
    return t or None


def has_generation_markers(template: str) -> bool:
    return _GENERATION.search(template) is not None


def check_messages(messages, row: int) -> list[dict]:
    """The row's messages as a list of ``{"role", "content", ...}`` dicts; a one-line error otherwise."""
    if not isinstance(messages, list | tuple) or not messages:
        what = "missing or null" if messages is None else f"a {type(messages).__name__}" if not isinstance(
            messages, list | tuple) else "an empty list"
        raise ValueError(f"row {row}: 'messages' is {what}; a chat record holds a list of "
                         '{"role": ..., "content": ...} turns (fix or drop that row)')
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"row {row}: turn {j} of 'messages' is not a {{\"role\": ..., \"content\": ...}} "
                             "object with a string role (fix or drop that row)")
        if m.get("content") is None and not m.get("tool_calls"):
            raise ValueError(f"row {row}: turn {j} ({m['role']}) of 'messages' has no 'content'; every turn needs its "
                             "text as a string 'content' (\"\" for an empty one) (fix or drop that row)")
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise ValueError(f"row {row}: turn {j} ({m['role']}) has a {type(m['content']).__name__} content, "
                             "not a string (fix or drop that row)")
        out.append({k: v for k, v in m.items() if v is not None})  # datasets fills absent keys with None
    if not any(m["role"] == "assistant" for m in out):
        roles = ", ".join(m["role"] for m in out)
        raise ValueError(f"row {row}: the conversation has no assistant turn (roles: {roles}), so it has no "
                         "target to take a loss on: add the assistant's reply, or drop that row")
    return out


def _render(tokenizer, messages: list[dict], row: int, **kw) -> dict:
    """``apply_chat_template`` of ``messages``; a template that fails (bad Jinja, or its own
    ``raise_exception``) is refused in one line naming the row."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    except TemplateError as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"row {row}: the chat template cannot render this conversation ({type(e).__name__}: "
                         f"{first}); fix the template (a build takes one with --chat-template FILE) or that "
                         "row") from None


def chat_tokens(tokenizer, messages, row: int) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one conversation: labels are the ids on assistant tokens, ``IGNORE`` elsewhere."""
    if tokenizer is None:
        raise ValueError(f"row {row} is a chat record and there is no tokenizer to apply its chat template with")
    template = template_of(tokenizer)
    if template is None:
        raise ValueError(NO_TEMPLATE)
    msgs = check_messages(messages, row)
    if has_generation_markers(template):
        out = _render(tokenizer, msgs, row, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        ids, mask = _prefix_mask(tokenizer, msgs, row)
    if not any(mask):
        raise ValueError(f"row {row}: the chat template marks no assistant token: the assistant turns are empty, or "
                         "the template does not render them; give each assistant turn its content, or use a template "
                         "that renders the assistant's turns (a build takes one with --chat-template FILE)")
    return ids, [t if m else IGNORE for t, m in zip(ids, mask, strict=True)]


def _prefix_mask(tokenizer, msgs: list[dict], row: int) -> tuple[list[int], list[int]]:
    """Assistant tokens as the difference between renderings of growing prefixes of the conversation."""
    ids = list(_render(tokenizer, msgs, row)["input_ids"])
    mask = [0] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = list(_render(tokenizer, msgs[:i], row, add_generation_prompt=True)["input_ids"]) if i else []
        upto = list(_render(tokenizer, msgs[: i + 1], row)["input_ids"])
        if upto[: len(before)] != before or ids[: len(upto)] != upto:
            raise ValueError(
                f"row {row}: the chat template renders turn {i} differently once later turns follow, so the "
                "assistant's tokens cannot be found; use a template with {% generation %} markers "
                "(--chat-template FILE), as TRL's assistant_only_loss does"
            )
        mask[len(before): len(upto)] = [1] * (len(upto) - len(before))
    return ids, mask


def render_turns(messages, sep: str = "\n") -> str:
    """A conversation as text with its roles: ``[user] ...`` then ``[assistant] ...``, one turn a line."""
    if not isinstance(messages, list | tuple):
        return str(messages)
    return sep.join(f"[{m.get('role', '?')}] {m.get('content') or ''}" for m in messages if isinstance(m, dict))

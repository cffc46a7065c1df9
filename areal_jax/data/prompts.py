"""Turn question texts into prompt text and token ids with a Hugging Face tokenizer."""

from __future__ import annotations

from areal_jax.data.config import DatasetConfig

_CHUNK = 1024


def render_prompts(
    questions: list[str], tokenizer, config: DatasetConfig, section: str = "dataset"
) -> list[tuple[str, list[int]]]:
    """(prompt text, prompt token ids) for each question, formatted as ``config`` (the config
    section ``section``) says.

    With ``config.use_chat_template`` each question (plus ``instruction_suffix``) is one user turn
    after an optional system turn, rendered with ``add_generation_prompt=True``; otherwise the
    optional system prompt and the question are joined by a newline and tokenized directly.
    """
    if config.use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{section}.use_chat_template is true but the tokenizer has no chat template; "
            f"set {section}.use_chat_template=false"
        )
    out: list[tuple[str, list[int]]] = []
    for start in range(0, len(questions), _CHUNK):
        users = [q + config.instruction_suffix for q in questions[start : start + _CHUNK]]
        if config.use_chat_template:
            system = (
                [{"role": "system", "content": config.system_prompt}]
                if config.system_prompt
                else []
            )
            chats = [[*system, {"role": "user", "content": u}] for u in users]
            texts, ids = _apply_chat_template(tokenizer, chats, config, section)
        else:
            prefix = f"{config.system_prompt}\n" if config.system_prompt else ""
            texts = [prefix + u for u in users]
            ids = tokenizer(texts)["input_ids"]
        out.extend((text, [int(t) for t in row]) for text, row in zip(texts, ids, strict=True))
    return out


def _apply_chat_template(tokenizer, chats: list, config: DatasetConfig, section: str):
    """(texts, token ids) of ``chats`` through the tokenizer's chat template; a template that
    raises (``raise_exception``, as many do for a system turn they do not support) or fails is
    a ``ValueError`` naming the section. Any error counts: a template is a program of the
    model's files (a division by zero, the sandbox's range limit) and names its own."""
    try:
        texts = tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    except Exception as e:  # noqa: BLE001 - whatever the template raises, named below
        hint = (f" (it was given {section}.system_prompt: the template may not take a system "
                f"turn; leave system_prompt empty)" if config.system_prompt else "")
        raise ValueError(f"{section}: the tokenizer's chat template failed: {type(e).__name__}: "
                         f"{e!s:.300}{hint}; or set {section}.use_chat_template=false") from e
    return texts, ids

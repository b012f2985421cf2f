"""Token-exact chat formatting for self-distillation, with the target's own chat template.

Conversations grow token by token: each turn's prompt is the previous context (including exactly
the tokens the target wrote) plus the template's text between that answer and the next generation
prompt. Nothing the target wrote is ever re-tokenised, so the loss mask marks exactly its tokens.
"""

from __future__ import annotations

from typing import Any, Optional

from headway.errors import HeadwayError

_SENTINEL = "\u2063HEADWAY_SENTINEL\u2063"


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Token ids that end an assistant turn: the tokenizer's eos plus the model's generation eos
    ids."""
    ids: list[int] = []
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise HeadwayError(
            "the target's tokenizer has no eos token: set tokenizer.eos_token in its tokenizer_config.json"
        )
    return ids


class ChatFormat:
    """Builds prompt token ids for first turns, follow-up turns and Magpie-style user prefixes."""

    def __init__(
        self, tokenizer: Any, system_prompt: Optional[str] = None, generation_config: Any = None
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise HeadwayError(
                "the target's tokenizer has no chat template; self-distillation needs one "
                "(add `chat_template` to tokenizer_config.json or chat_template.jinja in the model directory)"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.stop_ids = stop_token_ids(tokenizer, generation_config)

    def _messages(self, system: Optional[str], *pairs: tuple[str, str]) -> list[dict]:
        sys_text = system if system is not None else self.system_prompt
        msgs = [{"role": "system", "content": sys_text}] if sys_text is not None else []
        return msgs + [{"role": r, "content": c} for r, c in pairs]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja raises for templates that refuse a message layout
            raise HeadwayError(
                f"the target's chat template cannot render this conversation: {e}"
            ) from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first_turn(self, user: str, system: Optional[str] = None) -> list[int]:
        """Prompt ids for the first user message, ending with the assistant generation prompt."""
        return self.encode(
            self._render(self._messages(system, ("user", user)), add_generation_prompt=True)
        )

    def next_turn(
        self, user: str, last_token: Optional[int], system: Optional[str] = None
    ) -> list[int]:
        """Ids to append after an assistant answer so that the target answers `user` next.

        `last_token` is the last token the target wrote; when it is the turn-closing token the
        template would write itself, it is not written twice.
        """
        text = self._render(
            self._messages(system, ("user", "u"), ("assistant", _SENTINEL), ("user", user)),
            add_generation_prompt=True,
        )
        if _SENTINEL not in text:
            raise HeadwayError(
                "the target's chat template drops assistant messages; "
                "multi-turn prompts need one that keeps them"
            )
        after = text.split(_SENTINEL, 1)[1]
        if last_token is not None and last_token in self.stop_ids:
            closing = self.tokenizer.convert_ids_to_tokens(last_token)
            if isinstance(closing, str) and after.startswith(closing):
                after = after[len(closing) :]
        return self.encode(after)

    def user_prefix(self, system: Optional[str] = None) -> list[int]:
        """The template up to where a user's message starts (Magpie: the target writes the
        question)."""
        text = self._render(
            self._messages(system, ("user", _SENTINEL)), add_generation_prompt=False
        )
        return self.encode(text.split(_SENTINEL, 1)[0])

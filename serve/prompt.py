"""The prompt a capabilities model sees: one definition for serving, evaluation and training data.

A prompt is the chat template applied to a system message and the user's query; the answer is the contract's
rendering of the tools. Two styles:

- ``catalog`` (the default for a base model): the system message lists every tool ("name: description"), so a
  model that was never trained on the registry can still read what each tool does;
- ``short``: the system message only states the task; for a model fine-tuned on the registry, which knows the
  tools by name. Prompts are ~30 tokens instead of ~1,300 for the catalog.

Training data renders the same messages with the answer as the assistant turn (``training_text``), so the model is
trained on exactly the token sequence the engine will feed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tooltrie.compiler.contract import Contract
from tooltrie.compiler.tokenizer_info import BUNDLED_TOKENIZERS_DIR, TokenizerInfo
from tooltrie.registry.model import Registry

DEFAULT_CHAT_TEMPLATE = BUNDLED_TOKENIZERS_DIR / "smollm2-135m" / "chat_template.jinja"
TASK = ("You choose the tools that answer the user's request. Reply with the names of as many tools as the user "
        "asks for, the most relevant first, separated by \"{separator}\".")
# The number of tools goes in the user's turn, after the query: the system turn (with the catalog) is then the same
# for every k, so one cached prefix serves every request.
USER = "{query}\nNumber of tools: {k}"
CATALOG_SYSTEM = TASK + "\nTools:\n{catalog}"
STYLES = {"catalog": CATALOG_SYSTEM, "short": TASK}
_QUERY_MARK = "\x00QUERY\x00"
_ANSWER_MARK = "\x00ANSWER\x00"


@dataclass(frozen=True)
class Prompt:
    """How a query becomes the model's input. ``system`` may use ``{k}``, ``{separator}`` and ``{catalog}``;
    ``user`` must use ``{query}`` and may use ``{k}``."""

    system: str = CATALOG_SYSTEM
    user: str = USER
    chat_template: str = DEFAULT_CHAT_TEMPLATE.read_text(encoding="utf-8")

    @classmethod
    def style(cls, name: str, *, chat_template: str | Path | None = None) -> Prompt:
        if name not in STYLES:
            raise ValueError(f"unknown prompt style {name!r}; choose one of {sorted(STYLES)}")
        template = Path(chat_template or DEFAULT_CHAT_TEMPLATE).read_text(encoding="utf-8")
        return cls(system=STYLES[name], chat_template=template)

    @cached_property
    def _template(self):  # type: ignore[no-untyped-def]
        import jinja2

        return jinja2.Environment(autoescape=False).from_string(self.chat_template)

    def system_text(self, registry: Registry, contract: Contract, k: int) -> str:
        catalog = "\n".join(f"{tool.name}: {tool.description}" for tool in registry.tools)
        return self.system.format(k=k, separator=contract.separator, catalog=catalog)

    def parts(self, registry: Registry, contract: Contract, k: int) -> tuple[str, str]:
        """The text around the query: (prefix shared by every query, suffix after it)."""
        messages = [{"role": "system", "content": self.system_text(registry, contract, k)},
                    {"role": "user", "content": self._user(_QUERY_MARK, k)}]
        prefix, suffix = self._template.render(messages=messages, add_generation_prompt=True).split(_QUERY_MARK)
        return prefix, suffix

    def _user(self, query: str, k: int) -> str:
        # The query is put in after formatting: braces in it are text, not fields.
        return self.user.format(query=_QUERY_MARK, k=k).replace(_QUERY_MARK, query)

    def text(self, registry: Registry, contract: Contract, query: str, k: int) -> str:
        prefix, suffix = self.parts(registry, contract, k)
        return prefix + query + suffix

    def ids(self, tokenizer: TokenizerInfo, registry: Registry, contract: Contract, query: str, k: int) -> list[int]:
        """:meth:`text` tokenized whole, the query as plain text (``TokenizerInfo.encode_prompt``): what the engine
        feeds, what evaluation and training data use."""
        prefix, suffix = self.parts(registry, contract, k)
        return tokenizer.encode_prompt(prefix, query, suffix)

    def training_text(self, registry: Registry, contract: Contract, query: str,
                      tools: Sequence[str]) -> tuple[str, str]:
        """(prompt, completion) for one training example: the completion is the contract's rendering of
        ``tools`` as the assistant turn closes it (then whatever the template appends, e.g. ``<|im_end|>``)."""
        k, answer = len(tools), contract.render(tools)
        messages = [{"role": "system", "content": self.system_text(registry, contract, k)},
                    {"role": "user", "content": self._user(query, k)},
                    {"role": "assistant", "content": _ANSWER_MARK}]
        closed = self._template.render(messages=messages, add_generation_prompt=False)
        prompt = self.text(registry, contract, query, k)
        before, after = closed.split(_ANSWER_MARK)
        if before != prompt:
            raise ValueError("the chat template renders the assistant turn differently from the generation "
                             "prompt; training text would not match what the engine feeds the model")
        return prompt, answer + after

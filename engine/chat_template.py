"""Render chat messages to a prompt with a jinja2 chat template.

The GGUF's own `tokenizer.chat_template` is used when present; models without one (the
embedded Gemma 3 270M base model among them) get the Gemma template shipped here, and
`--chat-template FILE` overrides both. Templates run in jinja2's sandbox: they come from
model files, which are not trusted code.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template failed to render these messages (bad roles, template bug)."""


def builtin_template(name: str = "gemma") -> str:
    return resources.files("engine").joinpath(f"templates/{name}.jinja").read_text("utf-8")


def _raise(msg: str) -> None:
    raise ChatTemplateError(msg)


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template plus the special-token strings it may reference."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        object.__setattr__(self, "_tmpl", env.from_string(self.source))

    @classmethod
    def resolve(
        cls, override: str | Path | None, gguf_template: str | None, bos: str, eos: str
    ) -> ChatTemplate:
        """Pick the template: explicit file, else the GGUF's, else the shipped Gemma one."""
        if override is not None:
            source = Path(override).read_text("utf-8")
        elif gguf_template:
            source = gguf_template
        else:
            source = builtin_template("gemma")
        return cls(source, bos, eos)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        try:
            out: str = self._tmpl.render(  # type: ignore[attr-defined]
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        return out

"""LLM backends: anything with ``complete(list[str]) -> list[str]`` (:class:`LLMBackend`), a causal LM's
``generate`` through :class:`CallableBackend`, or an OpenAI-compatible HTTP server through
:class:`OpenAICompatibleBackend`."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Protocol

__all__ = ["CallableBackend", "LLMBackend", "OpenAICompatibleBackend"]


class LLMBackend(Protocol):
    """Anything that completes a batch of prompts."""

    def complete(self, prompts: list[str]) -> list[str]: ...


class CallableBackend:
    """Wraps any ``generate(list[str]) -> list[str]``, e.g. :meth:`CausalLMModule.generate` of any backbone."""

    def __init__(self, generate: Callable[[list[str]], list[str]]) -> None:
        self.generate = generate

    def complete(self, prompts: list[str]) -> list[str]:
        out = list(self.generate(list(prompts)))
        if len(out) != len(prompts):
            raise ValueError(f"the backend answered {len(out)} of {len(prompts)} prompts")
        return [str(o) for o in out]


class OpenAICompatibleBackend:
    """``POST {base_url}/chat/completions`` (OpenAI-compatible servers: vLLM, llama.cpp, TGI...), one request per
    prompt, standard library only. ``base_url`` includes the version prefix, e.g. ``http://localhost:8000/v1``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        temperature: float = 0.0,
        timeout: float = 60.0,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.temperature, self.timeout = model, api_key, temperature, timeout

    def complete(self, prompts: list[str]) -> list[str]:
        out = []
        for prompt in prompts:
            body = {
                "model": self.model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": self.temperature,
            }
            headers = {"Content-Type": "application/json"}
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            request = urllib.request.Request(
                self.url, data=json.dumps(body).encode(), headers=headers, method="POST"
            )
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                data = json.loads(response.read().decode())
            try:
                out.append(str(data["choices"][0]["message"]["content"]))
            except (KeyError, IndexError, TypeError):
                raise ValueError(f"unexpected response from {self.url}: {str(data)[:200]}") from None
        return out

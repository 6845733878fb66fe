"""Reading OpenAI completion/chat bodies and stream chunks (dicts from JSON), no I/O.

Shapes: /v1/completions answers choices[i].text (stream chunks: choices[i].text);
/v1/chat/completions answers choices[i].message.content (chunks: choices[i].delta.content);
`usage.completion_tokens` counts generated tokens.
"""
from __future__ import annotations


def is_greedy(body: dict) -> bool:
    """True for requests whose output is deterministic: `temperature` given and 0, one choice.

    An absent temperature is NOT greedy: OpenAI's default is 1.0, and vLLM uses 1.0 or the
    model's generation_config default, so such outputs are sampled and comparing them with
    another build would measure sampling noise, not the build.
    """
    t = body.get("temperature")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and t == 0 and body.get("n", 1) == 1


def first_choice(body: dict) -> dict:
    choices = body.get("choices") or []
    return choices[0] if choices and isinstance(choices[0], dict) else {}


def response_text(body: dict) -> str:
    """Text of the first choice of a non-streaming completion or chat response ("" if none)."""
    c = first_choice(body)
    if "message" in c:
        return (c.get("message") or {}).get("content") or ""
    return c.get("text") or ""


def chunk_text(chunk: dict) -> str:
    """Text a stream chunk adds to the first choice ("" for role/usage-only/finish chunks)."""
    c = first_choice(chunk)
    if "delta" in c:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


def completion_tokens(body: dict) -> int | None:
    """usage.completion_tokens of a response or final stream chunk, None when absent."""
    n = (body.get("usage") or {}).get("completion_tokens")
    return n if isinstance(n, int) else None


def same_words(a: str, b: str, n_words: int) -> bool:
    """Agreement rule for shadow comparison: equal first `n_words` whitespace-separated words
    after strip (a shorter text must match in full, so "4" vs "4 apples" disagree)."""
    return a.strip().split()[:n_words] == b.strip().split()[:n_words]

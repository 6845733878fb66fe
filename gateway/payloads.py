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
    """choices[0] of a body or chunk, {} when there is none or it is malformed."""
    choices = body.get("choices")
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}


def one_choice(body: dict) -> bool:
    """True when a request asks for one choice (n and best_of absent or 1): its stream is one answer."""
    return body.get("n") in (None, 1) and body.get("best_of") in (None, 1)


def _choice_text(body: dict, part: str) -> str:
    """choices[0][part].content for chat ("message" or "delta"), else choices[0].text; "" when
    absent or of the wrong type (a malformed body or chunk has no text)."""
    c = first_choice(body)
    if part in c:
        inner = c.get(part)
        text = inner.get("content") if isinstance(inner, dict) else None
    else:
        text = c.get("text")
    return text if isinstance(text, str) else ""


def response_text(body: dict) -> str:
    """Text of the first choice of a non-streaming completion or chat response ("" if none)."""
    return _choice_text(body, "message")


def chunk_text(chunk: dict) -> str:
    """Text a stream chunk adds to the first choice ("" for role/usage-only/finish chunks)."""
    return _choice_text(chunk, "delta")


def other_delta(chunk: dict) -> bool:
    """True when a chat chunk's delta carries more than role and text (tool calls, reasoning):
    a stream with such deltas cannot be continued as plain text."""
    delta = first_choice(chunk).get("delta")
    return isinstance(delta, dict) and any(v for k, v in delta.items() if k not in ("role", "content"))


def completion_tokens(body: dict) -> int | None:
    """usage.completion_tokens of a response or final stream chunk, None when absent."""
    usage = body.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if _is_int(n) else None


# sentence punctuation, quotes and brackets around a word; operators (+ - = / *) stay words
AROUND = ".,;:!?\"'`()[]{}*_"


def words(text: str, n_words: int) -> list[str]:
    """The first `n_words` whitespace-separated words of `text`, case-folded, without the sentence
    punctuation, quotes, brackets and markdown emphasis around them (AROUND: "Paris." and "paris" are
    one word, "+" and "-" differ); a word of those characters only is dropped."""
    out = [w.strip(AROUND).casefold() for w in text.split()]
    return [w for w in out if w][:n_words]


def same_words(a: str, b: str, n_words: int) -> bool:
    """Agreement rule for shadow comparison: equal first `n_words` words (`words`: case and the
    punctuation around a word do not count, so "10." and "10" agree; a shorter text must match in
    full, so "4" vs "4 apples" disagree)."""
    return words(a, n_words) == words(b, n_words)


def continuation(body: dict, sent_text: str, sent_tokens: int, chat: bool) -> dict | None:
    """The request that continues a stream from where it broke, on another build of the same model.

    `body` is the client's request, `sent_text` the text of the first choice already sent to the
    client, `sent_tokens` the text chunks already sent (vLLM streams one token per chunk unless
    started with --stream-interval, so this is the token count the client has seen).
    - completions: `prompt` + `sent_text`;
    - chat: `sent_text` as the final assistant message (appended to it if the client already
      asked to continue one), with vLLM's `continue_final_message: true` and
      `add_generation_prompt: false` (vLLM chat template options, not OpenAI's API);
    - `max_tokens` / `max_completion_tokens` / `min_tokens` lowered by `sent_tokens`.
    Returns None when the request cannot be continued: n > 1 or best_of (choices interleave),
    a token limit that is not an integer (it could not be lowered), `echo` (the sent text
    holds the prompt), a completions prompt that is not one string (token ids, a batch), chat
    messages that are not a list of dicts, or a final assistant message whose content is not
    a string. Check `tokens_left` too: with none left there is nothing to continue.
    """
    if not one_choice(body) or body.get("echo"):
        return None
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if out.get(key) is None:
            continue
        if not _is_int(out[key]):
            return None
        out[key] = max(out[key] - sent_tokens, 0)
    if not chat:
        if not isinstance(body.get("prompt"), str):
            return None
        out["prompt"] = body["prompt"] + sent_text
        return out
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return None
    last = messages[-1]
    if body.get("continue_final_message") and last.get("role") == "assistant":
        if not isinstance(last.get("content"), str):
            return None
        messages = [*messages[:-1], {**last, "content": last["content"] + sent_text}]
    else:
        messages = [*messages, {"role": "assistant", "content": sent_text}]
    out.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
    return out


def tokens_left(body: dict, sent_tokens: int) -> int | None:
    """Tokens the request may still generate after `sent_tokens` (None: no limit given)."""
    limits = [body[k] for k in ("max_tokens", "max_completion_tokens") if _is_int(body.get(k))]
    return max(min(limits) - sent_tokens, 0) if limits else None


def _is_int(value) -> bool:
    """An integer JSON number (bool is an int to Python, not to JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)
